"""Parameters are DTensors, as FSDP2's are, or plain tensors where the plan replicates every
parameter, as DDP's are: torch's own training tools on the compiled module.

Real gloo ranks (the session's ``rank_pool``; ``torch.export`` cannot trace in several threads
of one process at once), one job per world size running every case. Each loop compares with eager
PyTorch step by step: torch's ``clip_grad_norm_`` and ``pm.clip_grad_norm_`` return eager's norm,
torch's optimizers step the parameters to eager's, and DCP's ``get_state_dict`` names and values
match eager's.
"""

from __future__ import annotations

import copy
import gc
import math
import re
import weakref

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.errors import ConfigError
from autopar.ops.params import add_grad, as_like, local_of
from autopar.runtime.tools.launch import max_rel_diff as rel_diffs
from autopar.zoo.models import build_model, example_batch

DTYPE = torch.float64  # gloo and the threaded backend reduce float64; AdamW's sign steps need it
TOL = 1e-9


def max_rel_diff(got: dict, want: dict) -> float:
    return max(rel_diffs(got, want).values())


def _batch(seed: int) -> tuple:
    return tuple(t.to(DTYPE) if t.is_floating_point() else t for t in example_batch("gpt", 8, seed=seed))


def _optimizer(name: str, params):
    return {
        "sgd": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2),
        "adamw_for_loop": lambda: torch.optim.AdamW(params, lr=1e-2, foreach=False),
        "adamw_foreach": lambda: torch.optim.AdamW(params, lr=1e-2, foreach=True),
        "adam": lambda: torch.optim.Adam(params, lr=1e-2, weight_decay=0.1),
    }[name]()


def _train(pm, eager, opt, opt_eager, clip) -> list[tuple[float, float]]:
    """Two steps of forward, backward, ``clip()`` and optimizer step on ``pm`` and on ``eager``
    (clipped by torch); the two norms of each step."""
    norms = []
    for step in range(2):
        batch = _batch(1 + step)
        opt.zero_grad()
        opt_eager.zero_grad()
        pm(*batch).backward()
        eager(*batch).backward()
        norms.append((float(clip()), float(torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.05))))
        opt.step()
        opt_eager.step()
    return norms


def _loop(rank: int, kind: str, mesh: tuple[int, ...], optimizer: str, own_clip: bool) -> dict:
    """Two steps of forward, backward, clip and optimizer step, compiled and eager side by side."""
    model = build_model("gpt", seed=0, bias=False).to(DTYPE)
    eager = copy.deepcopy(model)
    batch = _batch(1)
    plan = autopar.hand_plan(kind, model, mesh, example_inputs=batch, cluster="cpu")
    pm = autopar.compile(model, mesh, example_inputs=batch, plan=plan, cluster="cpu")
    opt, opt_eager = _optimizer(optimizer, pm.parameters()), _optimizer(optimizer, eager.parameters())
    clip = (lambda: pm.clip_grad_norm_(0.05)) if own_clip else (lambda: torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.05))
    norms = _train(pm, eager, opt, opt_eager, clip)
    params = dict(pm.named_parameters())
    return {
        "norms": norms,
        "state_rel": max_rel_diff(pm.full_state_dict(), eager.state_dict()),
        "names": sorted(params) == sorted(dict(eager.named_parameters())),
        "placements": all(_kind_is_the_plans(pm, name, p) for name, p in params.items())
        or {n: (type(p).__name__, getattr(p, "placements", None), pm.plan.params[n]) for n, p in params.items()},
        "grads": all(
            type(p.grad) is type(p.data) and getattr(p.grad, "placements", None) == getattr(p, "placements", None)
            for p in params.values()
        )
        or {n: (type(p.grad).__name__, getattr(p.grad, "placements", None)) for n, p in params.items()},
        "sharded": any(local_of(p).numel() < p.numel() for p in params.values()),
    }


def _kind_is_the_plans(pm, name: str, param: torch.Tensor) -> bool:
    """A DTensor on ``pm.device_mesh`` with the plan's placements, or a plain tensor where the plan
    replicates every parameter (as DDP's are)."""
    if all(p.is_replicate() for spec in pm.plan.params.values() for p in spec):
        return not isinstance(param, DTensor)
    return (
        isinstance(param, DTensor)
        and param.device_mesh == pm.device_mesh
        and tuple(param.placements) == tuple(pm.plan.params[name])
    )


CASES = {  # world size -> (hand plan, mesh, optimizer, pm.clip_grad_norm_ rather than torch's)
    2: [("ddp", (2,), "sgd", False), ("fsdp", (2,), "adamw", False), ("fsdp", (2,), "adamw_for_loop", True)],
    4: [("megatron", (2, 2), "adam", False), ("megatron", (2, 2), "adamw", True), ("fsdp", (4,), "adamw_foreach", False)],
}


def _pipelined(rank: int, plan: autopar.Plan) -> dict:
    """Two steps on a pipelined plan (a rank holds one stage): ``pm.clip_grad_norm_`` reduces
    over the stages, and an SGD step after it matches eager's."""
    model = build_model("gpt", seed=0, bias=False).to(DTYPE)
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, plan.mesh_shape, example_inputs=_batch(1), plan=plan)
    opt, opt_eager = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    norms = _train(pm, eager, opt, opt_eager, lambda: pm.clip_grad_norm_(0.05))
    return {"norms": norms, "state_rel": max_rel_diff(pm.full_state_dict(), eager.state_dict())}


def _zero(rank: int) -> dict:
    """torch's ZeroRedundancyOptimizer (a DDP script's ZeRO-1) over a plan that replicates every
    parameter, against eager; over one that shards them, what its step raised, and whether a
    weight moved."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    out = {}
    for kind in ("ddp", "fsdp"):
        model = build_model("gpt", seed=0, bias=False).to(DTYPE)
        eager = copy.deepcopy(model)
        plan = autopar.hand_plan(kind, model, (2,), example_inputs=_batch(1), cluster="cpu")
        pm = autopar.compile(model, (2,), example_inputs=_batch(1), plan=plan)
        opt = ZeroRedundancyOptimizer(pm.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
        opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
        before = pm.full_state_dict()
        try:
            _train(pm, eager, opt, opt_eager, lambda: pm.clip_grad_norm_(0.05))
            out[kind] = max_rel_diff(pm.full_state_dict(), eager.state_dict())
        except ConfigError as error:
            out[kind] = (str(error), max_rel_diff(pm.full_state_dict(), before))
    return out


def _prewrap_resume(rank: int) -> float:
    """How far from eager's four steps an FSDP run is that trains two steps, saves its optimizer's
    state (DTensors), and resumes it into an optimizer built on a new model before its compile (a
    DDP script's resume), two more steps: the state is cut to the new module's shards at the first
    step, where it failed inside torch ("local_tensor ... got DTensor")."""
    import io

    model = build_model("gpt", seed=0, bias=False).to(DTYPE)
    eager = copy.deepcopy(model)
    plan = autopar.hand_plan("fsdp", model, (2,), example_inputs=_batch(1), cluster="cpu")
    pm = autopar.compile(model, (2,), example_inputs=_batch(1), plan=plan)
    opt, opt_eager = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    _train(pm, eager, opt, opt_eager, lambda: pm.clip_grad_norm_(0.05))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)  # each rank its own shards, as a script saves with torch.save
    resumed = build_model("gpt", seed=1, bias=False).to(DTYPE)
    resumed.load_state_dict(pm.full_state_dict())
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)  # before the wrap
    pm = autopar.compile(resumed, (2,), example_inputs=_batch(1), plan=plan)
    opt.load_state_dict(torch.load(io.BytesIO(saved.getvalue()), weights_only=False))
    _train(pm, eager, opt, opt_eager, lambda: pm.clip_grad_norm_(0.05))
    return max_rel_diff(pm.full_state_dict(), eager.state_dict())


def _all_cases(rank: int, world: int, pipelined: autopar.Plan) -> dict:
    out = {case: _loop(rank, *case) for case in CASES[world]}
    if world == 2:
        out["zero"] = _zero(rank)
        out["prewrap_resume"] = _prewrap_resume(rank)
        out["get_state_dict"] = _get_state_dict(rank)
        out["hooks"] = _hooks((2,))
    else:
        out["pipelined"] = _pipelined(rank, pipelined)
    return out


@pytest.fixture(scope="module")
def results(rank_pool):
    """Every case's per-rank results, by world size (one pool job each)."""
    model = build_model("gpt", seed=0, bias=False).to(DTYPE)
    pipelined = autopar.plan(model, (2, 2), example_inputs=_batch(1), cluster="cpu", pipeline=2, num_microbatches=2)
    return {world: rank_pool(world).run(_all_cases, pipelined, timeout_s=900) for world in CASES}


@pytest.mark.multiproc
@pytest.mark.parametrize("world, case", [(world, case) for world, cases in CASES.items() for case in cases])
def test_torch_clip_and_optimizers_match_eager(results, world, case) -> None:
    per_rank = [by_case[case] for by_case in results[world]]
    for result in per_rank:
        assert result["names"], "named_parameters() differ from eager's"
        assert result["placements"] is True, result["placements"]
        assert result["grads"] is True, result["grads"]
        for got, want in result["norms"]:
            assert got == pytest.approx(want, rel=1e-9), result["norms"]
        assert result["state_rel"] < TOL
    assert case[0] == "ddp" or per_rank[0]["sharded"]  # the plan shards something, so a part's norm would differ


@pytest.mark.multiproc
def test_zero_redundancy_optimizer_steps_replicated_parameters_and_refuses_shards(results) -> None:
    """Over DTensor parameters it stepped its own part on each rank, then failed in its broadcast
    with torch's NotImplementedError (c10d.broadcast_), the ranks' weights by then apart."""
    for by_case in results[2]:
        replicated, sharded = by_case["zero"]["ddp"], by_case["zero"]["fsdp"]
        assert replicated < TOL
        message, moved = sharded
        assert "ZeroRedundancyOptimizer" in message and "torch.optim.AdamW(pm.parameters()" in message, message
        assert moved == 0.0, "refused before it stepped"


def _get_state_dict(rank: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model = build_model("gpt", seed=0, bias=False).to(DTYPE)
    eager = copy.deepcopy(model)
    batch = _batch(1)
    plan = autopar.hand_plan("fsdp", model, (2,), example_inputs=batch, cluster="cpu")
    pm = autopar.compile(model, (2,), example_inputs=batch, plan=plan, cluster="cpu")
    opt, opt_eager = torch.optim.AdamW(pm.parameters(), lr=1e-2), torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for module, optimizer in ((pm, opt), (eager, opt_eager)):
        module(*batch).backward()
        optimizer.step()
    model_sd, optim_sd = get_state_dict(pm, opt)
    eager_model_sd, eager_optim_sd = get_state_dict(eager, opt_eager)
    whole = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model_sd.items()}
    moments = {k: v["exp_avg"].full_tensor() for k, v in optim_sd["state"].items()}
    want_moments = {k: v["exp_avg"] for k, v in eager_optim_sd["state"].items()}
    result = {
        "model_rel": max_rel_diff(whole, eager_model_sd),
        "moment_rel": max_rel_diff(moments, want_moments),
        "keys": sorted(optim_sd["state"]) == sorted(eager_optim_sd["state"]),
    }
    # Eager's state (whole tensors, eager's names) into the compiled module and optimizer, wiped
    # first; DCP fills the dicts it is given in place, so it gets copies.
    with torch.no_grad():
        for param in pm.parameters():
            param.zero_()
            opt.state[param]["exp_avg"].zero_()
    set_state_dict(
        pm,
        opt,
        model_state_dict=copy.deepcopy(eager_model_sd),
        optim_state_dict=copy.deepcopy(eager_optim_sd),
        options=StateDictOptions(full_state_dict=True),
    )
    loaded = opt.state_dict()["state"]
    result["after_set"] = max_rel_diff(
        {str(k): v["exp_avg"].full_tensor() for k, v in loaded.items()},
        {str(k): v["exp_avg"] for k, v in opt_eager.state_dict()["state"].items()},
    )
    result["params_after_set"] = max_rel_diff(pm.full_state_dict(), eager.state_dict())
    return result


@pytest.mark.multiproc
def test_a_sharded_optimizer_state_resumes_into_an_optimizer_built_before_the_wrap(results) -> None:
    for rank, out in enumerate(results[2]):
        assert out["prewrap_resume"] < TOL, f"rank {rank}: {out['prewrap_resume']:.2e} off eager's weights"


@pytest.mark.multiproc
def test_own_clip_matches_eager_on_a_pipelined_module(results) -> None:
    for by_case in results[4]:
        result = by_case["pipelined"]
        for got, want in result["norms"]:
            assert got == pytest.approx(want, rel=1e-9), result["norms"]
        assert result["state_rel"] < TOL


@pytest.mark.multiproc
def test_dcp_get_state_dict_matches_eager(results) -> None:
    for by_case in results[2]:
        result = by_case["get_state_dict"]
        assert result["keys"]
        assert result["model_rel"] < TOL and result["moment_rel"] < TOL
        assert result["after_set"] < TOL and result["params_after_set"] < TOL


def test_add_grad_sets_then_accumulates_into_the_local_shard() -> None:
    plain = torch.nn.Parameter(torch.zeros(4))
    add_grad(plain, torch.ones(4, dtype=torch.float64))  # a reduce dtype lands in the parameter's
    add_grad(plain, torch.ones(4))
    assert plain.grad.dtype == torch.float32 and plain.grad.tolist() == [2.0] * 4
    assert local_of(plain) is plain and as_like(plain.grad, plain) is plain.grad


def _strided_round_trip(rank: int) -> float:
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.ir.spec import SS, shard_tensor
    from autopar.runtime.checkpoint import to_dtensor

    mesh = DeviceMesh.from_group(torch.distributed.group.WORLD, "cpu")
    full = torch.arange(8 * 12, dtype=torch.float64).reshape(8, 12)
    spec = (SS(1, 3),)  # a fused [q|k|v] weight cut per block, as the Megatron rules cut it
    param = torch.nn.Parameter(to_dtensor(shard_tensor(full, spec, (rank,), (2,)), spec, (8, 12), mesh))
    norm = torch.nn.utils.get_total_norm([param])
    return float((param.full_tensor() - full).abs().max()), float(norm), float(full.norm())


def test_a_strided_shard_parameter_is_the_whole_tensor_to_torch() -> None:
    from autopar.runtime.tools.numerics import run_ranks_in_threads

    for error, norm, want in run_ranks_in_threads(2, _strided_round_trip):
        assert error == 0 and norm == pytest.approx(want, rel=1e-12)


def test_casting_or_moving_a_compiled_module_is_refused_and_a_no_op_is_not(world_of_one):
    """``pm.double()`` after compile would cast shards the plan, its buffers and its gathers were
    made for; such calls are refused with the fix, while calls that change nothing pass."""
    model = build_model("mlp", seed=0, d_in=8, d_hidden=16, d_out=4)
    batch = example_batch("mlp", batch_size=4, seed=1, d_in=8, d_hidden=16, d_out=4)
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu")
    assert pm.to("cpu") is pm and pm.float() is pm and pm.to(torch.float32) is pm
    for cast in (pm.double, pm.half, lambda: pm.to(torch.bfloat16)):
        with pytest.raises(TypeError, match=r"before autopar.compile.*precision="):
            cast()
    assert all(p.dtype == torch.float32 for p in pm.parameters())
    pm(*batch).backward()  # still runs as compiled


def _mlp_module(plan_kind: str, dtype: torch.dtype = torch.float32, mesh: tuple[int, ...] = (1,)) -> tuple:
    """(an MLP, its compiled module under hand plan ``plan_kind`` on ``mesh``, two batches):
    "fsdp" on two ranks shards every parameter (DTensors); any plan on one rank replicates them
    (plain tensors)."""
    model = build_model("mlp", seed=0, d_in=8, d_hidden=16, d_out=4).to(dtype)
    eager = copy.deepcopy(model)
    batches = [
        tuple(t.to(dtype) for t in example_batch("mlp", batch_size=4, seed=s, d_in=8, d_hidden=16, d_out=4)) for s in (1, 2)
    ]
    plan = autopar.hand_plan(plan_kind, model, mesh, example_inputs=batches[0], cluster="cpu")
    pm = autopar.compile(model, mesh, example_inputs=batches[0], cluster="cpu", plan=plan)
    assert all(isinstance(p, DTensor) == (math.prod(mesh) > 1 and plan_kind == "fsdp") for p in pm.parameters())
    return eager, pm, batches


def _hooks(mesh: tuple[int, ...]) -> dict:
    """Tensor hooks and gradient accumulation on the parameters of an "fsdp" plan on ``mesh``:
    DTensors on two ranks, plain tensors on one."""
    out = {}
    _, pm, (batch, _) = _mlp_module("fsdp", mesh=mesh)
    handle = next(iter(pm.parameters())).register_hook(lambda grad: grad * 3)
    try:
        pm(*batch)
        out["hook"] = "ran"
    except RuntimeError as error:
        out["hook"] = str(error)
    handle.remove()
    eager, pm, (batch, _) = _mlp_module("fsdp", mesh=mesh)
    for module in (pm, eager):
        if not isinstance(next(iter(pm.parameters())), DTensor):  # a hook that runs changes both gradients alike
            next(iter(module.parameters())).register_hook(lambda grad: grad * 3)
        module(*batch).backward()
    out["hook_grad_rel"] = max_rel_diff(pm.full_grads(), {n: p.grad for n, p in eager.named_parameters()})
    eager, pm, batches = _mlp_module("fsdp", DTYPE, mesh)
    seen: list[torch.Tensor] = []
    first = next(iter(pm.parameters()))
    whole = (lambda t: t.full_tensor()) if isinstance(first, DTensor) else (lambda t: t)
    first.register_post_accumulate_grad_hook(lambda p: seen.append(whole(p.grad).clone()))
    for batch in batches:
        pm(*batch).backward()
        eager(*batch).backward()
    out["grad_kind"] = type(first.grad) is type(first.data) and getattr(first.grad, "placements", None) == getattr(
        first, "placements", None
    )
    out["hook_calls"] = len(seen) == 2 and torch.equal(seen[1], whole(first.grad)) and not torch.equal(seen[0], seen[1])
    out["accumulated_rel"] = max_rel_diff(pm.full_grads(), {n: p.grad for n, p in eager.named_parameters()})
    return out


def _check_hooks(result: dict, sharded: bool) -> None:
    if sharded:  # the graph computes a DTensor's gradient on its local shard: the hook would not run
        assert re.search(r"before autopar.compile.*register_post_accumulate_grad_hook", result["hook"]), result["hook"]
    else:  # the graph reads the plain parameter itself: its hook runs, as in eager
        assert result["hook"] == "ran"
    assert result["hook_grad_rel"] < 1e-6
    assert result["grad_kind"] and result["hook_calls"]
    assert result["accumulated_rel"] < TOL


def test_tensor_hooks_and_gradient_accumulation_on_plain_parameters(world_of_one):
    """On one rank every parameter is replicated, so plain: ``p.register_hook`` runs as in eager,
    each backward's gradient lands in ``.grad`` (the first as the leaf's own tensor, later ones
    added into it), post-accumulate-grad hooks run once per backward with that backward's sum,
    and two backwards equal eager's."""
    _check_hooks(_hooks((1,)), sharded=False)


@pytest.mark.multiproc
def test_tensor_hooks_and_gradient_accumulation_on_dtensor_parameters(results):
    """On two ranks under "fsdp": ``p.register_hook`` on a DTensor parameter would never run (the
    gradient is computed on the local shard), so the next call says so and names what works; the
    ``.grad`` is a DTensor with the parameter's placements, accumulated and hooked as eager's."""
    for by_case in results[2]:
        _check_hooks(by_case["hooks"], sharded=True)


def test_an_optimizer_over_the_original_models_parameters_is_rebound(world_of_one):
    """``opt = SGD(model.parameters())`` built before ``pm = autopar.compile(model, ...)`` (a DDP
    script's order) steps the compiled module's parameters from its first step, state included,
    as DDP trains the model's own; once ``pm`` is gone the step is refused with the fix; the same
    model trained eagerly beside ``pm`` (its parameters have gradients) steps its own."""
    model = build_model("mlp", seed=0, d_in=8, d_hidden=16, d_out=4)
    batch = example_batch("mlp", batch_size=4, seed=1, d_in=8, d_hidden=16, d_out=4)
    early = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu")
    for _ in range(2):
        pm(*batch).backward()
        early.step()
        early.zero_grad()
        reference(*batch).backward()
        reference_opt.step()
        reference_opt.zero_grad()
    assert all(any(p is q for q in pm.parameters()) for group in early.param_groups for p in group["params"])
    assert max(rel_diffs(pm.full_state_dict(), reference.state_dict()).values()) < 1e-6
    stale_model = build_model("mlp", seed=0, d_in=8, d_hidden=16, d_out=4)
    stale = torch.optim.SGD(stale_model.parameters(), lr=0.1)
    gone = autopar.compile(stale_model, (1,), example_inputs=batch, cluster="cpu")
    del gone
    gc.collect()
    with pytest.raises(RuntimeError, match=r"torch\.optim\.SGD\(pm\.parameters\(\)"):
        stale.step()
    stale_model(*batch).backward()  # the model as an eager reference: it has its own gradients
    before = [p.detach().clone() for p in stale_model.parameters()]
    stale.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, stale_model.parameters()))


@pytest.mark.parametrize("compiler", [None, "inductor"])
def test_the_models_weights_are_freed_once_the_caller_drops_it(world_of_one, compiler, monkeypatch):
    """The compiled module holds its own copy of the weights. Tracing leaves reference cycles
    that reach the model, and a model that existed before the trace sits in the collector's oldest
    generation afterwards: without a collection at the end of compile, ``del model`` kept a whole
    copy of the weights (on a GPU, device memory) alive until Python's next full collection.
    Compile collects for weights on an accelerator or above a size, here lowered to this GPT's."""
    monkeypatch.setattr("autopar.runtime.build.FREE_AFTER_TRACE_BYTES", 1)
    model = build_model("gpt", seed=0)
    batch = example_batch("gpt", 4, seed=1)
    weight = weakref.ref(model.lm_head.weight)
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler=compiler)
    del model
    assert weight() is None
    pm(*batch).backward()  # the module runs on its own copy
