"""FSDP2's padded shards on real gloo ranks: a model that 3 ranks divide nowhere, trained whole.

``WideNet`` is 64 wide (3 ranks hold 22, 22 and 20 rows of each weight) with a 2-row head (one
rank's piece of it is empty). The fsdp hand plan shards every parameter's dim 0, padded; the
ranks train it against eager PyTorch in float64: accumulation with ``no_sync()``, torch's
``clip_grad_norm_``, AdamW, an eval pass, then a DCP save and a resume into a meta-built model.
Twice: each rank passing its own rows (``batch="per_rank"``: the gradient is a partial sum, which
the padded reduce-scatter reduces) with ``reshard_after_forward=True``, and the whole batch on
every rank (each keeps its piece of the whole gradient) with False. Under two policies that cast
("bf16-mixed", and float64 masters cast to float32), the plan casts each padded piece, the ranks
gather the cast pieces in the policy's dtype (FSDP2's order; once again in backward), and two
AdamW steps equal the policy's eager reference. On 4 ranks, (2, 2): padded shards beside a
replicated axis (HSDP's order) and beside a cut of another dim (FSDP + TP), and a table tied to its
head padded. The assertions run in the parent.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.runtime.tools.launch import max_rel_diff
from tests.conftest import WideNet, eager_grads, wide_batch

pytestmark = pytest.mark.multiproc

WORLD = 3
STEPS = 3
LR = 1e-2
CLIP = 0.05  # below the gradients' norm, so that clipping scales every step
TOL = 1e-9  # float64 throughout: only summation order differs


class Job(NamedTuple):
    """A model, the mesh its padded plan runs on and its batches (``batch(seed)``)."""

    model: Callable[[], torch.nn.Module]
    mesh: tuple[int, ...]
    batch: Callable[[int], tuple[torch.Tensor, ...]]


WIDE = Job(WideNet, (WORLD,), wide_batch)


def _rows(module, rows: int) -> slice:
    """The rows of the global batch that ``module`` takes: its own under ``batch="per_rank"``."""
    size, rank = getattr(module, "data_parallel_size", 1), getattr(module, "data_parallel_rank", 0)
    return slice(rank * rows // size, (rank + 1) * rows // size)


def _local(module, batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``module``'s rows of ``batch``."""
    return tuple(t[_rows(module, len(batch[0]))] for t in batch)


def _train_step(module, optimizer, step: int, job: Job = WIDE) -> tuple[list[float], float]:
    """Two micro-batches (the first under ``no_sync()`` where the module has it), torch's
    ``clip_grad_norm_``, one AdamW step: (the micro-batch losses, the norm before clipping)."""
    optimizer.zero_grad()
    losses = []
    for micro in range(2):
        hold = getattr(module, "no_sync", None) if micro == 0 else None
        with hold() if hold is not None else torch.enable_grad():
            loss = module(*_local(module, job.batch(10 * step + micro)))
            loss.backward()
        losses.append(loss.item())
    norm = torch.nn.utils.clip_grad_norm_(list(module.parameters()), CLIP).item()
    optimizer.step()
    return losses, norm


def _loop(plan: autopar.Plan, reshard: bool, path: str, job: Job = WIDE) -> dict:
    torch.manual_seed(0)
    model = job.model().double()
    eager = copy.deepcopy(model)
    comm = autopar.CommOptions(reshard_after_forward=reshard)
    pm = autopar.compile(model, job.mesh, example_inputs=job.batch(0), plan=plan, comm=comm)
    optimizer, eager_optimizer = torch.optim.AdamW(pm.parameters(), lr=LR), torch.optim.AdamW(eager.parameters(), lr=LR)
    out: dict = {"pieces": {fqn: tuple(p.to_local().shape) for fqn, p in pm.named_parameters()}, "steps": []}
    buckets = getattr(pm.graph_module, "grad_buckets", None)
    out["scattered"] = sum(s.size >= 0 for b in getattr(buckets, "buckets", ()) if b.kind == "reduce_scatter" for s in b.slots)
    for step in range(STEPS):
        got, want = _train_step(pm, optimizer, step, job), _train_step(eager, eager_optimizer, step, job)
        # gradients after clipping, before the step: the sum of both micro-batches on every rank
        out["steps"].append((got, want))
    out["grad_rel"] = max_rel_diff(pm.full_grads(), eager_grads(eager))
    pm.eval()
    eager.eval()
    with torch.no_grad():
        out["eval"] = (pm(*_local(pm, job.batch(99))).item(), eager(*job.batch(99)).item())
    pm.train()
    eager.train()
    out["state_rel"] = max_rel_diff(pm.full_state_dict(), eager.state_dict())
    autopar.checkpoint.save(path, pm, optimizer)
    # resume into a model built on the meta device: every shard and AdamW state from the checkpoint
    with torch.device("meta"):
        meta = job.model().double()
    init = autopar.FromCheckpoint(path)
    resumed = autopar.compile(meta, job.mesh, example_inputs=job.batch(0), plan=plan, comm=comm, init=init)
    resumed_optimizer = torch.optim.AdamW(resumed.parameters(), lr=LR / 7)  # the checkpoint's lr must win
    autopar.checkpoint.load(path, resumed, resumed_optimizer)
    out["resumed_step"] = (_train_step(resumed, resumed_optimizer, STEPS, job), _train_step(eager, eager_optimizer, STEPS, job))
    out["resumed_state_rel"] = max_rel_diff(resumed.full_state_dict(), eager.state_dict())
    return out


def _refusal(plan: autopar.Plan, **kwargs) -> str:
    """The error compiling the padded plan with ``kwargs`` raises (it must raise)."""
    try:
        autopar.compile(WideNet().double(), (WORLD,), example_inputs=wide_batch(0), plan=plan, **kwargs)
    except autopar.errors.PlanError as error:
        return str(error)
    return "compiled"


# float64 masters cast to float32 at their use: the policy's order (cast the padded piece, gather
# the cast, reduce-scatter in float64) checked tightly; "bf16-mixed" where gloo's reductions allow
F32_OF_F64 = autopar.MixedPrecision(param_dtype="float32", master_dtype="float64", reduce_dtype="float64")
POLICIES = {"per_rank_bf16": ("bf16-mixed", torch.float32), "per_rank_f32": (F32_OF_F64, torch.float64)}
RESHARDS = {"per_rank_bf16": None, "per_rank_f32": True}  # True: the cast pieces gathered again in backward


def _policy_steps(plan: autopar.Plan, precision, dtype: torch.dtype, reshard: bool | None) -> dict:
    """Two AdamW steps under a policy that casts (the padded pieces cast, then gathered in its
    ``param_dtype``) against the policy's eager reference run as the data-parallel ranks run it:
    each step's loss and gradients, the parameters after, and the dtypes the gathers moved."""
    from tests.conftest import PolicyReference

    torch.manual_seed(0)
    model = WideNet().to(dtype)
    reference = PolicyReference(copy.deepcopy(model), precision)
    comm = autopar.CommOptions(reshard_after_forward=reshard)
    pm = autopar.compile(model, (WORLD,), example_inputs=wide_batch(0, dtype), plan=plan, comm=comm)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    reference_optimizer = torch.optim.AdamW(reference.module.parameters(), lr=LR)
    gathers = pm.graph_module.param_gathers
    out: dict = {"gathered": {key: str(gathers._dtypes.get(key)) for key, *_ in gathers.order}, "steps": []}
    slots = [s for b in pm.graph_module.grad_buckets.buckets if b.kind == "reduce_scatter" for s in b.slots]
    out["scattered"] = {slot.key: (slot.size, str(slot.dtype)) for slot in slots}
    for step in range(2):
        optimizer.zero_grad()
        batch = wide_batch(1 + step, dtype)
        loss = pm(*_local(pm, batch))
        loss.backward()
        want, _ = reference.data_parallel_backward(batch, WORLD)
        grads = {name: p.grad for name, p in reference.module.named_parameters()}
        out["steps"].append(((loss.item(), want.item()), max(max_rel_diff(pm.full_grads(), grads).values())))
        optimizer.step()
        reference_optimizer.step()
    out["state_rel"] = max(max_rel_diff(pm.full_state_dict(), reference.module.state_dict()).values())
    out["backward_gathers"] = gathers.num_backward_gathers
    return out


def _run(rank: int, world: int, path: str, plans: dict[str, str]) -> dict:
    plan = autopar.Plan.from_json(plans["whole"])
    out = {
        "per_rank": _loop(autopar.Plan.from_json(plans["per_rank"]), True, f"{path}_per_rank"),
        "whole": _loop(plan, False, f"{path}_whole"),
    }
    for name, (precision, dtype) in POLICIES.items():
        out[name] = _policy_steps(autopar.Plan.from_json(plans[name]), precision, dtype, RESHARDS[name])
    out["unscheduled"] = _refusal(plan, comm=autopar.CommOptions(enabled=False))
    out["inductor"] = _refusal(plan, compiler="inductor")
    return out


@pytest.fixture(scope="module")
def padded_plans() -> dict[str, autopar.Plan]:
    """The fsdp hand plan as it is (the whole batch on every rank: so small a model is cheapest
    unsplit), and with its batch split too (each rank its own rows, as FSDP2 runs)."""
    from autopar.cost.cluster import get_cluster
    from autopar.ir import spec as spec_module
    from autopar.ir.options import PlanOptions
    from autopar.solver.planners.data import with_data_layout
    from autopar.solver.planners.hand_plans import hand_specs
    from autopar.solver.planners.sharding import solve
    from autopar.solver.planners.split_batch import batch_pins
    from autopar.trace import trace

    allowed, spec_module.PADDED_PARAM_SHARDS = spec_module.PADDED_PARAM_SHARDS, True
    try:
        model, batch = WideNet().double(), wide_batch(0)
        whole = autopar.hand_plan("fsdp", model, (WORLD,), example_inputs=batch, cluster="cpu")
        data = autopar.DataOptions("per_rank")
        plans = {"whole": whole}
        for name, (precision, dtype) in {"per_rank": (None, torch.float64), **POLICIES}.items():
            options = PlanOptions.from_keywords(data=data, precision=precision)
            model, batch = WideNet().to(dtype), wide_batch(0, dtype)
            traced = trace(model, batch, None, options.precision)
            forced = {**hand_specs("fsdp", traced, (WORLD,)), **batch_pins(traced, (WORLD,))}
            split = solve(traced, (WORLD,), get_cluster("cpu"), options, forced=forced)
            plans[name] = with_data_layout(split, traced, data)
        return plans
    finally:
        spec_module.PADDED_PARAM_SHARDS = allowed


def _close(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=TOL, abs_tol=TOL)


def _assert_as_eager(run: dict, label: str) -> None:
    """One ``_loop``'s steps, gradients, eval, parameters and resumed step equal eager's."""
    for step, ((losses, norm), (eager_losses, eager_norm)) in enumerate(run["steps"]):
        assert all(map(_close, losses, eager_losses)), f"{label} step {step}: {losses} vs {eager_losses}"
        assert _close(norm, eager_norm) and norm > CLIP, f"{label} step {step}: norm {norm} vs {eager_norm}"
    assert max(run["grad_rel"].values()) < TOL, f"{label}: {run['grad_rel']}"
    assert _close(*run["eval"]), f"{label}: eval {run['eval']}"
    assert max(run["state_rel"].values()) < TOL, f"{label}: after {STEPS} steps {run['state_rel']}"
    (losses, norm), (eager_losses, eager_norm) = run["resumed_step"]
    assert all(map(_close, losses, eager_losses)) and _close(norm, eager_norm), f"{label}: resumed {run['resumed_step']}"
    assert max(run["resumed_state_rel"].values()) < TOL, f"{label}: resumed {run['resumed_state_rel']}"


def test_padded_shards_train_as_eager_save_and_resume(rank_pool, tmp_path, padded_plans) -> None:
    for plan in padded_plans.values():
        assert {fqn: [str(p) for p in spec] for fqn, spec in plan.params.items()} == {
            **{fqn: ["S(0)"] for fqn in ("up.weight", "up.bias", "down.weight", "down.bias")},
            "scale": ["R"],  # a buffer: never padded
        }
    assert padded_plans["per_rank"].data.size == WORLD
    for name in POLICIES:  # the policy's cast takes the padded piece and gives it: FSDP2's order
        casts = [n for n in padded_plans[name].nodes.values() if n.op == "aten._to_copy.default"]
        assert len(casts) == 4 and all([str(p) for p in n.outs[0]] == ["S(0)"] for n in casts), name
    plans = {batch: plan.to_json() for batch, plan in padded_plans.items()}
    results = rank_pool(WORLD).run(_run, str(tmp_path / "ckpt"), plans, timeout_s=600)
    rows = [(22, 22, 20), (1, 1, 0)]  # ceil(64 / 3) and ceil(2 / 3): torch.chunk's pieces
    for rank, result in enumerate(results):
        assert "communication schedule is off" in result.pop("unscheduled"), "plain collectives move equal pieces only"
        assert "traces its gathers unpadded" in result.pop("inductor")
        # bf16: the loss comes back in bf16 (one ulp is 2**-8 relative), the fp32 gradients and
        # masters as the reference's to fp32 rounding; f32 of f64 masters: float32 rounding
        for name, (loss_tol, tol, param_dtype) in {
            "per_rank_bf16": (2**-8, 1e-5, "torch.bfloat16"),
            "per_rank_f32": (1e-6, 1e-6, "torch.float32"),
        }.items():
            policy = result.pop(name)
            label = f"rank {rank} {name}"
            assert set(policy["gathered"].values()) == {param_dtype}, f"{label}: gathered {policy['gathered']}"
            # each gradient leaves by a padded reduce-scatter in the master dtype (the policy's reduce_dtype)
            master = "torch.float32" if name == "per_rank_bf16" else "torch.float64"
            assert sorted(policy["scattered"].values()) == [(2, master), (2, master), (64, master), (64, master)], label
            for step, (loss, grad_rel) in enumerate(policy["steps"]):
                assert math.isclose(*loss, rel_tol=loss_tol), f"{label} step {step}: loss {loss}"
                assert grad_rel < tol, f"{label} step {step}: gradients {grad_rel}"
            assert policy["state_rel"] < tol, f"{label}: parameters after 2 AdamW steps {policy['state_rel']}"
            assert (policy["backward_gathers"] > 0) == bool(RESHARDS[name]), f"{label}: {policy['backward_gathers']}"
        assert result["per_rank"].pop("scattered") == 4, "each gradient leaves by a padded reduce-scatter"
        assert result["whole"].pop("scattered") == 0, "whole gradients on every rank: each keeps its piece"
        for batch, run in result.items():
            label = f"rank {rank} batch={batch}"
            assert run["pieces"]["up.weight"] == (rows[0][rank], 64) and run["pieces"]["down.weight"] == (rows[1][rank], 64)
            assert run["pieces"]["down.bias"] == (rows[1][rank],), label
            _assert_as_eager(run, label)


# -- a padded axis beside another: tensor parallelism or replicas on the second axis -----------


class TallNet(torch.nn.Module):
    """63 rows (2 ranks hold 32 and 31) and a 3-row head (2 and 1): padded on either axis of a
    (2, 2) mesh; 64 columns, which the other axis cuts evenly."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 63)
        self.down = torch.nn.Linear(63, 3)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.down(torch.relu(self.up(x))), y)


def tall_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 64, generator=generator, dtype=torch.float64), torch.randint(0, 3, (8,), generator=generator)


TALL = Job(TallNet, (2, 2), tall_batch)


class TiedNet(torch.nn.Module):
    """A 63-row table tied to its head, as a language model ties its vocabulary: the graph reads
    the tensor through one placeholder and never the other (``passes.schedule``'s second tie)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(63, 64)
        self.head = torch.nn.Linear(64, 63, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        return torch.nn.functional.cross_entropy(self.head(torch.relu(self.embed(ids))).flatten(0, 1), labels.flatten())


def tied_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 63, (4, 8), generator=generator) for _ in range(2))


TIED = Job(TiedNet, (2, 2), tied_batch)
# "hsdp": padded on one axis, replicated on the other, each rank its own rows (a gradient reduce-
# scattered on the padded axis, its piece summed over the other: HSDP's order, for either axis);
# "tp": up.weight padded over the data-parallel axis and cut by columns on the other (torchtitan's
# FSDP + TP), rows split on axis 0 only; "whole": the same specs, the whole batch on every rank
R2 = (Replicate(), Replicate())
TALL_SPECS = {
    "hsdp": {"up.weight": (Shard(0), Replicate()), "up.bias": (Shard(0), Replicate())},
    "tp": {"up.weight": (Shard(0), Shard(1))},
    "whole": {"up.weight": (Shard(0), Shard(1))},
}
TALL_HEAD = {"down.weight": (Replicate(), Shard(0)), "down.bias": (Shard(0), Replicate())}


@pytest.fixture(scope="module")
def tall_plans() -> dict[str, autopar.Plan]:
    from autopar.cost.cluster import get_cluster
    from autopar.ir.options import PlanOptions
    from autopar.solver.planners.data import with_data_layout
    from autopar.solver.planners.sharding import solve
    from autopar.solver.planners.split_batch import batch_pins
    from autopar.trace import trace

    plans = {}
    for name, specs in TALL_SPECS.items():
        data = autopar.DataOptions("per_rank" if name != "whole" else "whole")
        options = PlanOptions.from_keywords(data=data)
        traced = trace(TallNet().double(), tall_batch(0), None, options.precision)
        names = {graph_input.fqn: graph_input.name for graph_input in traced.placeholders("param")}
        forced = {names[fqn]: spec for fqn, spec in {**specs, **TALL_HEAD}.items()}
        pins = batch_pins(traced, TALL.mesh) if name != "whole" else {}
        if name == "tp":  # the rows split on axis 0; the first linear free to sum its column pieces on axis 1
            pins = {node: (spec[0], Replicate()) for node, spec in pins.items() if node != "linear"}
        plans[name] = with_data_layout(
            solve(traced, TALL.mesh, get_cluster("cpu"), options, forced={**forced, **pins}), traced, data
        )
    traced = trace(TiedNet().double(), tied_batch(0))  # both placeholders of the tied table padded over axis 0
    forced = {graph_input.name: (Shard(0), Shard(1)) for graph_input in traced.placeholders("param")}
    plans["tied"] = solve(traced, TIED.mesh, get_cluster("cpu"), PlanOptions(), forced=forced)
    return plans


def _run_tall(rank: int, world: int, path: str, plans: dict[str, str]) -> dict:
    return {
        name: _loop(autopar.Plan.from_json(plan), True, f"{path}_{name}", TIED if name == "tied" else TALL)
        for name, plan in plans.items()
    }


def test_padded_beside_another_axis_trains_as_eager(rank_pool, tmp_path, tall_plans) -> None:
    assert tall_plans["hsdp"].data.axes == (0, 1) and tall_plans["tp"].data.axes == (0,)
    assert [str(p) for p in tall_plans["tp"].nodes["linear"].outs[0]] == ["S(0)", "P(sum)"]  # the column pieces summed
    plans = {name: plan.to_json() for name, plan in tall_plans.items()}
    results = rank_pool(4).run(_run_tall, str(tmp_path / "tall"), plans, timeout_s=600)
    for rank, result in enumerate(results):
        row, column = divmod(rank, 2)
        tied = result.pop("tied")
        assert tied["pieces"]["embed.weight"] == (32 if row == 0 else 31, 32), f"rank {rank} tied"
        _assert_as_eager(tied, f"rank {rank} tied")
        for name, run in result.items():
            label = f"rank {rank} {name}"
            up = (32 if row == 0 else 31, 64 if name == "hsdp" else 32)
            assert run["pieces"]["up.weight"] == up and run["pieces"]["down.weight"] == ((2, 1)[column], 63), label
            assert run["scattered"] == (0 if name == "whole" else 4 if name == "hsdp" else 2), label
            _assert_as_eager(run, label)
