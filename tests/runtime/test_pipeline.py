"""Pipeline parallelism: the stage splitter, the split pass, option errors, and real pipelined
runs on gloo against eager PyTorch.

The multi-process test is ONE 4-rank spawn that runs every pipelined configuration: 2 stages on
mesh (2, 2) with 2 and 4 microbatches (1F1B), and 4 stages on mesh (4, 1) with 2 microbatches
(GPipe, since there are fewer microbatches than stages), and a dropout model whose stage ranks must
draw alike; and where a stage's parameter collectives run (``passes.held``): DDP in the stages
(one all-reduce a parameter a step), FSDP with its gathered parameters held (one gather and one
reduce-scatter a parameter a step), the planner's own held plan, and FSDP under bf16-mixed against
DDP under it. Plans are made here, in the parent, and
handed to the ranks as JSON, so the ranks do not compete for the two cores while solving.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.cost.memory import param_state_bytes
from autopar.errors import InputError, ModelError, UsageError
from autopar.ir.pipeline import first_microbatch, stage_mesh_of
from autopar.ops import collectives
from autopar.passes.split import split_into_stages, stage_io, stage_wiring
from autopar.runtime.pipeline import _stage_view
from autopar.runtime.tools.launch import max_rel_diff
from autopar.solver.planners.stages import StageSettings, plan_stages
from autopar.trace import trace
from autopar.zoo.models import GPT, build_model, example_batch
from tests.conftest import eager_grads, step_against_eager

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_pipeline import fsdp_in_stages  # noqa: E402  (the layout the benchmark times)

# No biases and float64, as in test_parallel: AdamW's first step turns rounding noise in
# exactly-zero gradients into full-size steps of either sign.
GPT_CONFIG = {"n_layer": 4, "bias": False}
BATCH = 8
DTYPE = torch.float64
TOL = 1e-4


def _gpt() -> torch.nn.Module:
    return build_model("gpt", seed=0, **GPT_CONFIG).to(DTYPE)


class SkipMLP(torch.nn.Module):
    """Four layers whose loss also reads the first layer's output: on four stages, that value
    must pass through stages 1 and 2 to reach stage 3."""

    def __init__(self, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        first = torch.nn.functional.gelu(self.layers[0](x))
        h = first
        for layer in self.layers[1:]:
            h = torch.nn.functional.gelu(layer(h))
        return torch.nn.functional.mse_loss(h + first, y)


class DropMLP(torch.nn.Module):
    """Two residual blocks with dropout: at one row per microbatch, the plan keeps the dropout's
    output whole on both ranks of a stage, so they must draw the same mask."""

    def __init__(self, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.drop(torch.tanh(layer(x)))
        return torch.nn.functional.cross_entropy(self.head(x), y)


def _drop_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return torch.randn(2, 16, generator=generator, dtype=DTYPE), torch.randint(0, 4, (2,), generator=generator)


def _skip_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=generator, dtype=DTYPE), torch.randn(8, 16, generator=generator, dtype=DTYPE)


def _plan(mesh, stages, microbatches, memory_budget=None) -> autopar.Plan:
    return autopar.plan(
        _gpt(),
        mesh,
        example_inputs=example_batch("gpt", BATCH, seed=1),
        cluster="cpu",
        pipeline=stages,
        num_microbatches=microbatches,
        memory_budget=memory_budget,
    )


def _tight_budget() -> float:
    """90% of the replicated parameters' state: the stage plans on mesh (1, 2) must shard over
    the second axis (on the cpu preset, unconstrained plans of this small model replicate)."""
    return 0.9 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in _gpt().parameters())


@pytest.fixture(scope="module")
def four_stages() -> autopar.Plan:
    return _plan((4, 1), 4, 4)


# -- the splitter -------------------------------------------------------------------------------


def test_every_node_is_in_exactly_one_stage_in_graph_order(four_stages):
    stages = four_stages.pipeline
    names = [name for stage in stages.stages for name in stage.nodes]
    assert len(names) == len(set(names)), "a node is in two stages"
    model = _gpt()
    inputs, kwargs = first_microbatch(example_batch("gpt", BATCH, seed=1), None, 4)
    graph = trace(model, inputs, kwargs).gm.graph
    forward = [n.name for n in graph.nodes if n.op not in ("placeholder", "output")]
    assert names == forward, "stages must cover the forward graph, contiguously and in order"


def test_four_stages_cut_between_layers_and_balance(four_stages):
    stages = four_stages.pipeline
    assert stages.num_stages == 4 and stages.stage_mesh == (1, 1) and stages.num_microbatches == 4
    assert stages.schedule == "1F1B"
    assert [s.layers for s in stages.stages] == [(0, 1), (1, 2), (2, 3), (3, 4)], "one GPT block per stage"
    # Each stage after the first starts with its block's first LayerNorm: cuts fall between layers.
    assert all(s.nodes[0].startswith("layer_norm") for s in stages.stages[1:]), [s.nodes[0] for s in stages.stages]
    assert [s.ranks for s in stages.stages] == [(0,), (1,), (2,), (3,)]
    # One block per stage leaves nothing to balance (tests/solver/test_stages.py checks balancing); the
    # first stage also runs the embeddings and the last the head and loss.
    times = [s.time_s for s in stages.stages]
    assert times[1] == pytest.approx(times[2]), f"identical blocks, different times: {times}"
    assert stages.step_time_s == pytest.approx(sum(times) + 3 * max(times) + four_stages.predicted.grad_sync_s)
    assert 0 < stages.bubble_fraction < 1
    # the plan's step adds the slowest stage's AdamW step after the flush (cost.optimizer)
    assert four_stages.predicted.optimizer_s > 0
    assert four_stages.predicted.step_time_s == pytest.approx(stages.step_time_s + four_stages.predicted.optimizer_s)


def test_more_layers_than_stages_are_balanced_by_cost():
    plan = autopar.plan(
        build_model("gpt", seed=0, n_layer=6, bias=False),
        (2, 1),
        example_inputs=example_batch("gpt", 4, seed=1),
        cluster="cpu",
        pipeline=2,
        num_microbatches=2,
    )
    first, second = plan.pipeline.stages
    # The head (ln_f, lm_head, loss) is heavier than the embeddings, so the cut is at the middle
    # or one layer early, never late.
    assert first.layers[1] in (2, 3), [s.layers for s in plan.pipeline.stages]
    assert max(first.time_s, second.time_s) <= 1.4 * min(first.time_s, second.time_s)


def test_stages_on_a_two_axis_mesh_share_the_second_axis():
    plan = _plan((2, 2), 2, 2)
    stages = plan.pipeline
    assert stages.stage_mesh == (1, 2) and plan.spec_mesh == (1, 2) and plan.mesh_shape == (2, 2)
    assert [s.ranks for s in stages.stages] == [(0, 1), (2, 3)]
    assert all(len(spec) == 2 for spec in plan.params.values())


def test_pipelined_plan_json_round_trip(four_stages, tmp_path):
    path = tmp_path / "plan.json"
    four_stages.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded == four_stages and loaded.to_json() == four_stages.to_json()
    data = json.loads(four_stages.to_json())
    assert data["pipeline"]["schedule"] == "1F1B" and len(data["pipeline"]["stages"]) == 4
    assert {"index", "layers", "nodes", "ranks", "time_s", "memory_bytes"} <= set(data["pipeline"]["stages"][0])


def test_summary_shows_bubble_and_stage_times_and_memory(four_stages):
    text = four_stages.summary()
    assert "bubble" in text and "Pipeline" in text
    for stage in four_stages.pipeline.stages:
        assert f"{stage.time_s * 1e3:.3f}" in text


def test_split_pass_runs_the_same_graph():
    """On a stage mesh of one device the split graph needs no process group: its submodules, run
    one after another, must compute the unsplit graph's loss."""
    model = _gpt()
    inputs, kwargs = first_microbatch(example_batch("gpt", BATCH, seed=1), None, 4)
    traced = trace(model, inputs, kwargs)
    plan = plan_stages(traced, (4, 1), get_cluster("cpu"), StageSettings(num_stages=4, num_microbatches=4))
    split = split_into_stages(copy.deepcopy(traced.gm), _stage_view(plan), stages=plan.pipeline)
    named = dict(model.named_parameters(remove_duplicate=False))
    user = iter(inputs)
    values = [named[gi.fqn] if gi.kind == "param" else next(user) for gi in traced.inputs]
    (want,) = traced.gm(*values)
    (got,) = split(*values)
    assert torch.equal(got, want)
    for index in range(1, 4):
        received = [n for n in stage_io(split, index)[0] if not n.startswith("p_") and n not in ("idx", "targets")]
        assert len(received) == 1, f"stage {index} should read only the residual stream, reads {received}"


def test_a_value_read_two_stages_on_passes_through_the_stages_between():
    model = SkipMLP().to(DTYPE)
    inputs, _ = first_microbatch(_skip_batch(), None, 2)
    traced = trace(model, inputs)
    plan = plan_stages(traced, (4, 1), get_cluster("cpu"), StageSettings(num_stages=4, num_microbatches=2))
    split = split_into_stages(copy.deepcopy(traced.gm), _stage_view(plan), stages=plan.pipeline)
    sent = stage_wiring(split, {gi.name for gi in traced.inputs}, "mse_loss", 4)
    first = sent[0][0]
    assert sent[0] == [first] and first.startswith("gelu")
    assert [len(s) for s in sent] == [1, 2, 2, 0] and all(first in s for s in sent[1:3]), sent


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh, kwargs, message",
    [
        ((3, 1), {"pipeline": 2}, r"pipeline=2 stages must divide mesh axis 0 \(3\)"),
        ((2, 1), {"pipeline": 2, "num_microbatches": 3}, r"num_microbatches=3 does not divide the batch of 8.*\[1, 2, 4, 8\]"),
        ((8, 1), {"pipeline": 8}, r"pipeline=8 stages, but the model has only 4 layers to split.*use at most 4 stages"),
        ((2, 1), {"num_microbatches": 2}, r"num_microbatches=2 cuts the batch for a pipeline, but pipeline is 'off'.*pipeline=N"),
        ((2, 1), {"pipeline": 0}, r"pipeline must be 'off', 'auto' or a positive number of stages, got 0"),
        ((2, 1), {"pipeline": 2, "offload": "auto"}, r"offload inside pipeline stages is not built yet"),
        ("auto", {"devices": 2, "offload": "auto"}, r"the mesh search plans sharding only; pass a mesh"),
    ],
    ids=[
        "stages_not_dividing_mesh",
        "microbatches_not_dividing_batch",
        "more_stages_than_layers",
        "microbatches_without_pipeline",
        "zero_stages",
        "offload_with_pipeline",
        "offload_with_mesh_search",
    ],
)
def test_bad_pipeline_options_name_cause_and_fix(mesh, kwargs, message):
    with pytest.raises(ValueError, match=message):
        autopar.plan(_gpt(), mesh, example_inputs=example_batch("gpt", BATCH, seed=1), cluster="cpu", **kwargs)


def test_stage_mesh():
    assert stage_mesh_of((4, 2), 2) == (2, 2)
    assert stage_mesh_of((4,), 4) == (1,)


# -- real pipelined runs on gloo --------------------------------------------------------------------

RUNS = {
    "2x2_m2": ((2, 2), 2, 2),
    "2x2_m4": ((2, 2), 2, 4),
    "4x1_m2": ((4, 1), 4, 2),
}


def _odd_mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """An MLP whose width (63) no mesh axis divides: only stages can split its memory."""
    torch.manual_seed(0)
    model = build_model("mlp", seed=0, d_in=63, d_hidden=63, d_out=63, depth=4).to(DTYPE)
    return model, (torch.randn(16, 63, dtype=DTYPE), torch.randn(16, 63, dtype=DTYPE))


def _mlp_plans() -> dict[str, str]:
    model, inputs = _odd_mlp()
    one = autopar.plan(model, (4,), example_inputs=inputs, cluster="cpu", pipeline=1, num_microbatches=2)
    budget = 0.8 * one.pipeline.stages[0].memory_bytes
    auto = autopar.plan(
        model, (4,), example_inputs=inputs, cluster="cpu", pipeline="auto", num_microbatches=2, memory_budget=budget
    )
    return {"one": one.to_json(), "auto": auto.to_json()}


def _collectives(pm) -> int:
    """The collectives in the graphs of every stage (checkpointed segments' too) and in the
    parameters' held chains (``passes.held``)."""
    graphs = [m for m in pm.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    graphs += [chain for _, chain in pm._held_chains.chains.values()]
    return sum(1 for gm in graphs for n in gm.graph.nodes if getattr(n.target, "__module__", "") == "autopar.ops.collectives")


def _count_calls(pm, batch, functions: dict[str, tuple[type, str]]) -> dict[str, int]:
    """How many times one training call runs each autograd function's forward or backward
    (label → (class, "forward" or "backward"))."""
    counts = dict.fromkeys(functions, 0)
    originals = [(cls, method, getattr(cls, method)) for cls, method in functions.values()]
    for label, (cls, method, original) in zip(functions, originals):

        def counted(ctx, *args, _original=original, _label=label):
            counts[_label] += 1
            return _original(ctx, *args)

        setattr(cls, method, staticmethod(counted))
    try:
        pm(*batch)
    finally:
        for cls, method, original in originals:
            setattr(cls, method, staticmethod(original))
    return counts


@contextlib.contextmanager
def _held_starts():
    """The held sums' reductions started (``runtime.held_sync``): (kind, elements, whether the
    schedule was still running: before ``HeldReducer.finish``)."""
    from autopar.runtime.held_sync import HeldReducer

    started: list[tuple[str, int, bool]] = []
    finishing = []
    all_reduce, reduce_scatter, finish = collectives.start_all_reduce, collectives.start_reduce_scatter, HeldReducer.finish
    collectives.start_all_reduce = lambda x, group: (
        started.append(("all_reduce", x.numel(), not finishing)) or all_reduce(x, group)
    )
    collectives.start_reduce_scatter = lambda out, x, group: (
        started.append(("reduce_scatter", x.numel(), not finishing)) or reduce_scatter(out, x, group)
    )
    HeldReducer.finish = lambda self: finishing.append(True) or finish(self)
    try:
        yield started
    finally:
        collectives.start_all_reduce, collectives.start_reduce_scatter, HeldReducer.finish = all_reduce, reduce_scatter, finish


def _run_pipelines(
    rank: int,
    world: int,
    plans: dict[str, str],
    mlp_plans: dict[str, str],
    flat_text: str,
    drop_text: str,
    layouts: tuple[str, str, str],
    path: str,
) -> dict:
    torch.manual_seed(0)
    results = {}
    ddp_text, planned_text, mixed_text = layouts
    # Replicated on the stage mesh's second axis, 4 microbatches: the trainable parameters'
    # gradients are all-reduced once a step (their sums, in one bucket), not once a microbatch.
    model = _gpt()
    batch = example_batch("gpt", BATCH, seed=1)
    pm = autopar.compile(copy.deepcopy(model), (2, 2), example_inputs=batch, plan=autopar.Plan.from_json(ddp_text))
    with _held_starts() as started:
        counts = _count_calls(pm, batch, {"syncs": (collectives._AllReduceGrad, "backward")})
    results["syncs"] = {
        "per_microbatch": counts["syncs"],
        "buckets": [numel for kind, numel, _ in started if kind == "all_reduce"],
        "in_schedule": [during for _, _, during in started],
        "elements": sum(p.numel() for p in pm.parameters() if p.requires_grad),
        **step_against_eager(pm, model, batch),
    }
    # The same with FSDP on that axis, gathered parameters held: each is gathered once a step,
    # and its gradient reduce-scattered once (the sum of the microbatches'), where the graph would
    # gather in every microbatch.
    model = _gpt()
    pm = autopar.compile(
        copy.deepcopy(model), (2, 2), example_inputs=batch, plan=autopar.Plan.from_json(fsdp_in_stages(ddp_text, hold=True))
    )
    functions = {"gathers": (collectives._GatherParam, "forward"), "scatters": (collectives._GatherParam, "backward")}
    with _held_starts() as started:
        counts = _count_calls(pm, batch, functions)
    counts["scatters"] += sum(1 for kind, _, _ in started if kind == "reduce_scatter")
    results["held"] = {
        **counts,
        "in_schedule": [during for _, _, during in started],
        "sharded": sum(1 for fqn, _ in pm.named_parameters() if pm.plan.params[fqn][1].is_shard()),
        **step_against_eager(pm, model, batch),
    }
    # The planner's own plan that holds, with checkpointed layers that read the held parameters.
    model = _gpt()
    pm = autopar.compile(copy.deepcopy(model), (2, 2), example_inputs=batch, plan=autopar.Plan.from_json(planned_text))
    results["planned_held"] = step_against_eager(pm, model, batch)
    # bf16-mixed: FSDP in the stages gathers each master's bf16 cast and reduce-scatters its
    # gradient in fp32 (``collectives.gather_cast_param``), held or not: the same loss as the
    # stages that hold the parameters whole, and their gradients but for the order of the fp32
    # sums (those all-reduce the step's fp32 sum, not rounded to bf16 on the way).
    mixed = {}
    for label, text in (("ddp", mixed_text), *((f"fsdp_{h}", fsdp_in_stages(mixed_text, hold=h)) for h in (False, True))):
        pm = autopar.compile(_gpt().float(), (2, 2), example_inputs=batch, plan=autopar.Plan.from_json(text))
        loss = pm(*batch)
        loss.backward()
        mixed[label] = (loss.item(), pm.full_grads())
    results["mixed"] = {
        label: (mixed[label][0], mixed["ddp"][0], max(max_rel_diff(mixed[label][1], mixed["ddp"][1]).values()))
        for label in ("fsdp_False", "fsdp_True")
    }
    for label, text in plans.items():
        mesh = RUNS[label][0]
        model = _gpt()
        eager = copy.deepcopy(model)
        batch = example_batch("gpt", BATCH, seed=1)
        pm = autopar.compile(model, mesh, example_inputs=batch, plan=autopar.Plan.from_json(text))
        loss = pm(*batch)
        grads_before_backward = [p.grad for p in pm.parameters()]
        loss.backward()
        want = eager(*batch)
        want.backward()
        result = {
            "loss": (loss.item(), want.item()),
            "grad_rel": max_rel_diff(pm.full_grads(), eager_grads(eager)),
            "untouched_before_backward": all(g is None for g in grads_before_backward),
            "stage": pm.stage_index,
            "collectives": _collectives(pm),
        }
        try:
            loss.backward()
            result["second_backward"] = "ran"
        except RuntimeError as error:
            result["second_backward"] = str(error)
        # One AdamW step, then the next batch's loss and every parameter, against eager.
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
        opt.step()
        opt_eager.step()
        batch = example_batch("gpt", BATCH, seed=2)
        with torch.no_grad():
            result["no_grad_loss"] = (pm(*batch).item(), eager(*batch).item())
        result["state_rel"] = max_rel_diff(pm.full_state_dict(), eager.state_dict())
        results[label] = result
        if label == "4x1_m2":
            result["local_param_bytes"] = pm.local_param_bytes()
            result["full_param_bytes"] = sum(p.numel() * p.element_size() for p in eager.parameters())
            # pm is the model (runtime.model_view), as ParallelModule's: its attributes, methods and state
            try:
                _ = pm.nothing
                missing = "found"
            except AttributeError as error:
                missing = str(error)
            with torch.no_grad():
                called = pm.module(*batch).item()  # calling the model runs the pipeline (forward only here)
                pm.module.transformer.h[0].eval()  # one module's mode, which its graph does not hold: refused
                try:
                    pm(*batch)
                    moded = "ran"
                except UsageError as error:
                    moded = str(error)
                pm.train()
                moded = (moded, pm(*batch).item())
            result["view"] = {
                "class": type(pm.module).__name__,
                "is_model": isinstance(pm.module, GPT),
                "attributes": pm.config == eager.config
                and pm.block_size == eager.block_size
                and len(pm.transformer.h) == len(eager.transformer.h),
                "state_keys": list(pm.module.state_dict()) == list(eager.state_dict()),  # whole: every stage's
                "called": (called, result["no_grad_loss"][0]),
                "missing": missing,
                "moded": moded,
            }
    # A pipeline= that contradicts the plan's, and init= with a pipeline, are refused up front.
    plan = autopar.Plan.from_json(plans["2x2_m2"])
    errors = {}
    try:
        autopar.compile(
            _gpt(), (2, 2), example_inputs=example_batch("gpt", BATCH, seed=1), plan=plan, pipeline=2, num_microbatches=4
        )
        errors["contradicts"] = "compiled"
    except ValueError as error:
        errors["contradicts"] = str(error)
    results["errors"] = errors
    # Targets of -100 spread unevenly over the two microbatches: each microbatch's loss is weighted
    # by its count of targets, as eager's whole-batch mean counts them; none in a microbatch is refused.
    idx, targets = example_batch("gpt", BATCH, seed=3)
    targets[BATCH // 2 :, 4:] = -100
    model = _gpt()
    pm = autopar.compile(copy.deepcopy(model), (2, 2), example_inputs=(idx, targets), plan=plan)
    results["ignored"] = step_against_eager(pm, model, (idx, targets))
    targets[BATCH // 2 :] = -100
    try:
        pm(idx, targets)
        results["ignored"]["empty"] = "ran"
    except ValueError as error:
        results["ignored"]["empty"] = str(error)
    # One rank passing other data would pair one rank's inputs with another's labels: refused everywhere.
    try:
        pm(idx + (rank == 3), targets)
        results["ignored"]["mixed"] = "ran"
    except ValueError as error:
        results["ignored"]["mixed"] = str(error)
    # A meta-built GPT, seeded per stage: each stage holds its shards of init.apply's numbers.
    init = autopar.SeededInit(3, fn=GPT._init_weights)
    with torch.device("meta"):
        meta = _gpt()
    seeded = autopar.compile(meta, (2, 2), example_inputs=example_batch("gpt", BATCH, seed=1), plan=plan, init=init)
    want = init.apply(_gpt()).state_dict()
    results["seeded"] = {k: torch.equal(v, want[k]) for k, v in seeded.full_state_dict().items()}
    # Its DCP checkpoint (embedding and head tied, held by both stages) resumed under FSDP on (4,).
    batch, after = example_batch("gpt", BATCH, seed=1), example_batch("gpt", BATCH, seed=2)
    modules = {"pipeline": (seeded, torch.optim.AdamW(seeded.parameters(), lr=1e-2))}
    seeded(*batch).backward()
    modules["pipeline"][1].step()
    autopar.checkpoint.save(path, seeded, modules["pipeline"][1])
    flat = autopar.compile(_gpt(), (4,), example_inputs=batch, plan=autopar.Plan.from_json(flat_text))
    modules["flat"] = (flat, torch.optim.AdamW(flat.parameters(), lr=1.0))
    autopar.checkpoint.load(path, flat, modules["flat"][1])
    tied = {"loaded": max_rel_diff(flat.full_state_dict(), seeded.full_state_dict())}
    for label, (module, opt) in modules.items():  # one more step each: the optimizer state came along
        opt.zero_grad()
        tied[f"{label}_loss"] = module(*after)
        tied[f"{label}_loss"].backward()
        tied[f"{label}_loss"] = tied[f"{label}_loss"].item()
        opt.step()
    tied["stepped"] = max_rel_diff(flat.full_state_dict(), seeded.full_state_dict())
    results["tied"] = tied
    # Plans of the stage planner's own choosing: "auto" under a budget one stage cannot meet,
    # and one stage (M microbatches in turn) on a stage mesh of four ranks, where the loss is
    # all-reduced after the traced loss node.
    for label, text in mlp_plans.items():
        model, inputs = _odd_mlp()
        eager = copy.deepcopy(model)
        pm = autopar.compile(model, (4,), example_inputs=inputs, plan=autopar.Plan.from_json(text))
        results[f"mlp_{label}"] = {**step_against_eager(pm, eager, inputs), "stages": pm.plan.pipeline.num_stages}
    # A value that passes through two stages (SkipMLP), on four stages with GPipe.
    model = SkipMLP().to(DTYPE)
    eager = copy.deepcopy(model)
    batch = _skip_batch()
    pm = autopar.compile(model, (4, 1), example_inputs=batch, cluster="cpu", pipeline=4, num_microbatches=2)
    results["skip"] = step_against_eager(pm, eager, batch)
    # Gradients accumulate over calls, scaled by what flows into the loss, as in eager.
    (0.5 * pm(*batch)).backward()
    (0.5 * eager(*batch)).backward()
    results["skip"]["accumulated_rel"] = max_rel_diff(pm.full_grads(), eager_grads(eager))
    # Whole tensors load into the stages' shards.
    other = SkipMLP().to(DTYPE)
    torch.nn.init.normal_(other.layers[2].weight)
    pm.load_state_dict(other.state_dict())
    results["skip"]["loaded_rel"] = max_rel_diff(pm.full_state_dict(), other.state_dict())
    # Through the model passed to compile (a DDP script's pre-wrap name): a load reaches the stages'
    # shards too; a clip of its parameters, which no stage's parameter can stand for, is refused.
    torch.nn.init.normal_(other.layers[0].weight)
    model.load_state_dict(other.state_dict())
    results["skip"]["model_loaded_rel"] = max_rel_diff(pm.full_state_dict(), other.state_dict())
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        results["skip"]["model_clip"] = "ran"
    except UsageError as error:
        results["skip"]["model_clip"] = str(error)
    # A gradient of a gradient (the schedule's gradients have no graph), a copy (AveragedModel) and
    # LBFGS: each refused, where the penalty trained nothing, the copy failed on a process group and
    # LBFGS stepped on one stage's dot products.
    attempts = {
        "create_graph": lambda: torch.autograd.grad(pm(*batch), list(pm.parameters()), create_graph=True),
        "deepcopy": lambda: copy.deepcopy(pm.module),
        "lbfgs": lambda: torch.optim.LBFGS(pm.parameters()).step(lambda: pm(*batch)),  # dot products over one stage
    }
    for label, attempt in attempts.items():
        try:
            attempt()
            results["skip"][label] = "ran"
        except UsageError as error:
            results["skip"][label] = str(error)
    # Dropout on a tensor both ranks of a stage hold whole: their generators must be in step
    # (ranks of different stages may differ); a call whose are not is refused on every rank.
    drop = {}
    model = DropMLP().to(DTYPE)
    model.head.bias.requires_grad_(False)  # frozen at compile: unfrozen below
    pm = autopar.compile(model, (2, 2), example_inputs=_drop_batch(), plan=autopar.Plan.from_json(drop_text))
    torch.manual_seed(7 + pm.stage_index)
    drop["per_stage"] = pm(*_drop_batch()).item()
    torch.manual_seed(7 + rank)
    state = torch.get_rng_state()
    try:
        pm(*_drop_batch())
        drop["per_rank"] = "ran"
    except ValueError as error:
        drop["per_rank"] = str(error)
    drop["restored"] = torch.equal(state, torch.get_rng_state())
    # A parameter frozen at compile and trained now (one stage's): no stage graph computes its
    # gradient, so every rank refuses the call.
    pm.module.head.requires_grad_(True)
    torch.manual_seed(7 + pm.stage_index)
    try:
        pm(*_drop_batch())
        drop["unfrozen"] = "ran"
    except (ModelError, InputError) as error:  # the holders' own, the others' "ranks [..] refused"
        drop["unfrozen"] = str(error)
    results["drop"] = drop
    return results


@pytest.mark.multiproc
def test_pipelines_match_eager(rank_pool, tmp_path):
    plans = {
        label: _plan(mesh, stages, microbatches, _tight_budget() if mesh[1] > 1 else None).to_json()
        for label, (mesh, stages, microbatches) in RUNS.items()
    }
    flat = autopar.hand_plan("fsdp", _gpt(), (4,), example_inputs=example_batch("gpt", BATCH, seed=1), cluster="cpu")
    drop = autopar.plan(DropMLP().to(DTYPE), (2, 2), example_inputs=_drop_batch(), cluster="cpu", pipeline=2, num_microbatches=2)
    assert all(drop.nodes[n].outs[0][1].is_replicate() for n in ("dropout", "dropout_1")), "the test needs whole dropouts"
    ddp = _plan((2, 2), 2, 4)
    assert all(p.is_replicate() for spec in ddp.params.values() for p in spec), "the test needs replicated parameters"
    # under 55% of the state the planner shards, holds what it gathers, and recomputes layers
    held = _plan((2, 2), 2, 4, _tight_budget() * 0.55 / 0.9)
    assert held.pipeline.hold_gathered and held.memory.checkpoint, "the test needs a plan that holds and recomputes"
    mixed = autopar.plan(
        _gpt().float(),
        (2, 2),
        example_inputs=example_batch("gpt", BATCH, seed=1),
        cluster="cpu",
        pipeline=2,
        num_microbatches=4,
        precision="bf16-mixed",
    )
    assert all(p.is_replicate() for spec in mixed.params.values() for p in spec), "the test needs replicated parameters"
    results = rank_pool(4).run(
        _run_pipelines,
        plans,
        _mlp_plans(),
        flat.to_json(),
        drop.to_json(),
        (ddp.to_json(), held.to_json(), mixed.to_json()),
        str(tmp_path / "ckpt"),
        timeout_s=400,
    )
    # the ranks that hold the parameter name it; the others stop with them
    assert any("['head.bias'] were frozen" in by_label["drop"]["unfrozen"] for by_label in results), results
    for rank, by_label in enumerate(results):
        syncs = by_label.pop("syncs")
        # once a step: one bucket of summed gradients, and through autograd only the chains that
        # compute (the position table's lookup, whose output's gradient is summed): fewer than M = 4
        assert len(syncs["buckets"]) == 1 and 0 < syncs["buckets"][0] <= syncs["elements"], f"rank {rank}: {syncs}"
        # started in the stage's last backward, not after the schedule (``runtime.held_sync``)
        assert all(syncs["in_schedule"]) and all(held_in := by_label["held"]["in_schedule"]), f"rank {rank}: {held_in}"
        assert syncs["per_microbatch"] < 4, f"rank {rank}: {syncs['per_microbatch']} gradient all-reduces in a step"
        assert math.isclose(*syncs["loss"], rel_tol=TOL), f"rank {rank}: {syncs['loss']}"
        assert max(syncs["grad_rel"].values()) < TOL, f"rank {rank}: {syncs['grad_rel']}"
        for label, (loss, want, grad) in by_label.pop("mixed").items():
            assert loss == want and grad < 1e-6, f"rank {rank} bf16-mixed {label}: loss {loss} vs {want}, grads {grad:.2e}"
        planned = by_label.pop("planned_held")
        assert math.isclose(*planned["loss"], rel_tol=TOL), f"rank {rank}: {planned['loss']}"
        assert max(planned["grad_rel"].values()) < TOL, f"rank {rank}: {planned['grad_rel']}"
        held = by_label.pop("held")
        assert held["gathers"] == held["scatters"] == held["sharded"] > 0, f"rank {rank}: {held}"
        assert math.isclose(*held["loss"], rel_tol=TOL), f"rank {rank}: {held['loss']}"
        assert max(held["grad_rel"].values()) < TOL, f"rank {rank}: {held['grad_rel']}"
        drop = by_label.pop("drop")
        assert math.isfinite(drop["per_stage"]), drop
        assert "draw different random numbers" in drop["per_rank"] and "torch.manual_seed(seed)" in drop["per_rank"], drop
        assert drop["restored"], f"rank {rank}: a refused call left the random generator drawn from"
        unfrozen = "were frozen (requires_grad=False) when the model was compiled"
        assert unfrozen in drop["unfrozen"] or "refused this call" in drop["unfrozen"], drop
        mlp = {label: by_label.pop(f"mlp_{label}") for label in ("one", "auto")}
        assert mlp["one"]["stages"] == 1 and mlp["auto"]["stages"] >= 2, "the budget leaves one stage infeasible"
        for label, result in mlp.items():
            assert math.isclose(*result["loss"], rel_tol=TOL), f"rank {rank} mlp {label}: loss {result['loss']}"
            worst = max(result["grad_rel"], key=result["grad_rel"].get)
            assert result["grad_rel"][worst] < TOL, f"rank {rank} mlp {label}: {worst} off by {result['grad_rel'][worst]:.2e}"
        skip = by_label.pop("skip")
        errors = by_label.pop("errors")
        assert "contradicts the plan, which has 2 stages and 2 microbatches" in errors["contradicts"], errors
        ignored = by_label.pop("ignored")
        assert math.isclose(*ignored["loss"], rel_tol=TOL), f"rank {rank}: uneven -100 targets, loss {ignored['loss']}"
        worst = max(ignored["grad_rel"], key=ignored["grad_rel"].get)
        assert ignored["grad_rel"][worst] < TOL, (
            f"rank {rank}: uneven -100 targets, {worst} off by {ignored['grad_rel'][worst]:.2e}"
        )
        assert "microbatch 1 of this step holds no target" in ignored["empty"], ignored["empty"]
        assert "ranks 0 and 3 passed different batches" in ignored["mixed"] and "same whole batch" in ignored["mixed"], ignored
        seeded = by_label.pop("seeded")
        assert seeded and all(seeded.values()), f"rank {rank}: seeded stages differ from SeededInit.apply: {seeded}"
        tied = by_label.pop("tied")
        assert max(tied["loaded"].values()) == 0, f"rank {rank}: the pipeline's checkpoint loaded on (4,): {tied['loaded']}"
        assert math.isclose(tied["pipeline_loss"], tied["flat_loss"], rel_tol=TOL), tied
        assert max(tied["stepped"].values()) < TOL, f"rank {rank}: a step after resuming: {tied['stepped']}"
        assert math.isclose(*skip["loss"], rel_tol=TOL), f"rank {rank} skip: loss {skip['loss']}"
        worst = max(skip["grad_rel"], key=skip["grad_rel"].get)
        assert skip["grad_rel"][worst] < TOL, f"rank {rank} skip: gradient of {worst} off by {skip['grad_rel'][worst]:.2e}"
        assert max(skip["accumulated_rel"].values()) < TOL, f"rank {rank} skip: accumulated {skip['accumulated_rel']}"
        assert max(skip["loaded_rel"].values()) == 0, f"rank {rank} skip: load_state_dict {skip['loaded_rel']}"
        assert max(skip["model_loaded_rel"].values()) == 0, f"rank {rank} skip: the model's {skip['model_loaded_rel']}"
        assert "(a pipeline)" in skip["model_clip"] and "pm.clip_grad_norm_" in skip["model_clip"], skip["model_clip"]
        assert "create_graph=True" in skip["create_graph"] and "without pipeline=" in skip["create_graph"], skip
        assert "AveragedModel" in skip["deepcopy"] and "_foreach_lerp_" in skip["deepcopy"], skip["deepcopy"]
        assert "LBFGS" in skip["lbfgs"] and "without pipeline=" in skip["lbfgs"], skip["lbfgs"]
        held = by_label["4x1_m2"]
        view = held.pop("view")
        assert view["class"] == "DistributedGPT" and view["is_model"] and view["attributes"] and view["state_keys"], view
        assert view["called"][0] == view["called"][1], view
        assert "but this call is in train (with 'transformer.h.0' in eval mode) mode" in view["moded"][0], view
        assert view["moded"][1] == view["called"][0], view
        assert "'PipelineParallelModule' object has no attribute 'nothing', and neither has the model (GPT)" in view["missing"]
        assert held["local_param_bytes"] < 0.6 * held["full_param_bytes"], f"rank {rank} holds more than its stage: {held}"
        for label, result in by_label.items():
            got, want = result["loss"]
            assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {label}: loss {got} vs eager {want}"
            worst = max(result["grad_rel"], key=result["grad_rel"].get)
            assert result["grad_rel"][worst] < TOL, (
                f"rank {rank} {label}: gradient of {worst} off by {result['grad_rel'][worst]:.2e}"
            )
            assert result["untouched_before_backward"], f"rank {rank} {label}: .grad was set before loss.backward()"
            assert "second time" in result["second_backward"], f"rank {rank} {label}: {result['second_backward']}"
            got, want = result["no_grad_loss"]
            assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {label}: loss after AdamW {got} vs {want}"
            worst = max(result["state_rel"], key=result["state_rel"].get)
            assert result["state_rel"][worst] < TOL, (
                f"rank {rank} {label}: after AdamW {worst} off by {result['state_rel'][worst]:.2e}"
            )
    assert [r["4x1_m2"]["stage"] for r in results] == [0, 1, 2, 3]
    assert [r["2x2_m4"]["stage"] for r in results] == [0, 0, 1, 1]
    for label in ("2x2_m2", "2x2_m4"):
        assert all(r[label]["collectives"] for r in results), f"{label}: the stages should shard over mesh axis 1"


# -- the command line -----------------------------------------------------------------------------


def test_cli_plans_a_pipeline(capsys, tmp_path):
    from autopar.cli import main

    out = tmp_path / "pp.json"
    assert (
        main(
            [
                "plan",
                "gpt",
                "--mesh",
                "4x1",
                "--num-layers",
                "4",
                "--pipeline",
                "4",
                "--num-microbatches",
                "4",
                "--cluster",
                "cpu",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "Pipeline: 4 stages x 4 microbatches, schedule 1F1B" in text and "bubble" in text
    assert autopar.Plan.load(out).pipeline.num_stages == 4
    assert main(["show", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["pipeline"]
    assert shown["schedule"] == "1F1B" and [s["layers"] for s in shown["stages"]] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    assert main(["plan", "gpt", "--pipeline", "2", "--devices", "2", "--cluster", "cpu"]) != 0
    assert "--pipeline N and --mesh" in capsys.readouterr().err
    assert main(["check", str(out)]) != 0
    assert "does not check pipelined plans yet" in capsys.readouterr().err
    assert main(["explain", str(out), "lm_head.weight"]) != 0
    assert "pipelined plan" in capsys.readouterr().err
    # --pipeline auto: the planner chooses the stages.
    assert (
        main(
            [
                "plan",
                "gpt",
                "--mesh",
                "4x1",
                "--num-layers",
                "4",
                "--pipeline",
                "auto",
                "--num-microbatches",
                "4",
                "--cluster",
                "cpu",
            ]
        )
        == 0
    )
    assert "Pipeline:" in capsys.readouterr().out


def _two_axis_gathers(rank: int, world: int) -> list[str]:
    """A parameter gathered on both axes of mesh (2, 2), its gradient summed on the first: the
    pairs ``passes.held`` makes, and the held sync's direct path, against the graph as written."""
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.passes.held import _pair_gathers, direct_sync
    from autopar.runtime.held_sync import _scatter_steps

    mesh = init_device_mesh("cpu", (2, 2))
    first, second = mesh.get_group(0).group_name, mesh.get_group(1).group_name
    graph = torch.fx.Graph()
    param = graph.placeholder("p_w")
    gathered = graph.call_function(collectives.all_gather, (param, 1, first))
    gathered = graph.call_function(collectives.all_gather, (gathered, 0, second))
    graph.output(graph.call_function(collectives.allreduce_grad, (gathered, first)))
    written = torch.fx.GraphModule(torch.nn.Module(), graph)
    paired = torch.fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))
    _pair_gathers(paired.graph, frozenset({"p_w"}), set())
    paired.recompile()
    targets = [n.target for n in paired.graph.nodes if n.op == "call_function"]
    assert targets == [collectives.gather_param, collectives.all_gather], targets
    generator = torch.Generator().manual_seed(rank)
    shard, grad = torch.randn(3, 4, dtype=DTYPE, generator=generator), torch.randn(6, 8, dtype=DTYPE, generator=generator)
    grads = []
    for gm in (written, paired):
        leaf = shard.clone().requires_grad_()
        value = gm(leaf)
        value.backward(grad)
        grads.append(leaf.grad)
    sync = direct_sync(paired)
    assert sync is not None and sync.kind == "scatter", sync
    grads.append(_scatter_steps(grad, sync.steps))
    assert torch.allclose(grads[0], grads[1], atol=1e-12) and torch.allclose(grads[0], grads[2], atol=1e-12)
    assert torch.equal(value, written(shard))
    return [str(t) for t in targets]


@pytest.mark.multiproc
def test_a_parameter_gathered_on_two_axes_pairs_each_sum_and_syncs_directly(rank_pool):
    assert all(rank_pool(4).run(_two_axis_gathers, timeout_s=120))
