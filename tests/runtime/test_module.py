"""Real multi-rank runs on gloo: compiled models against eager PyTorch.

Each mesh gets ONE spawn (starting eight gloo ranks on two cores costs ~20 s), and every model
and check shares it. The ranks return numbers; the assertions run here, in the parent.
"""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

import autopar
from autopar.cost.memory import param_state_bytes
from autopar.runtime.tools.launch import max_rel_diff, run_distributed
from autopar.zoo.models import build_model, example_batch
from tests.conftest import collective_counts, eager_grads, step_against_eager

pytestmark = pytest.mark.multiproc

MODELS = ("mlp", "gpt", "cnn")
# No biases in the GPT: a key-projection bias has an exactly-zero gradient (softmax cancels it),
# so both runs hold only float noise there, which AdamW scales up into full-size steps in
# different directions. Bias paths are covered by the MLP, the CNN and the forced plans below.
CONFIGS = {"gpt": {"bias": False}}
CLUSTER = "cpu"  # the machine these ranks run on; on h100-80g prices these models stay replicated
BATCH = 16
# float64: AdamW's first step moves every element by ±lr by the sign of its gradient, so in
# float32 elements whose gradient is at rounding-noise level can flip and land 2·lr apart
# between two correct runs. A sharding bug is an O(1) error in any dtype. (gloo reduces float64.)
DTYPE = torch.float64


BUDGET_BATCH = 4  # small, so that parameters (not activations) dominate memory in budget runs


def _batch(name: str, seed: int, batch_size: int = BATCH) -> tuple:
    return tuple(t.to(DTYPE) if t.is_floating_point() else t for t in example_batch(name, batch_size=batch_size, seed=seed))


STEPS = 3
TOL = 1e-4


def _train_one(name: str, mesh: tuple[int, ...], memory_budget: float | None = None, batch_size: int = BATCH) -> dict:
    model = build_model(name, seed=0, **CONFIGS.get(name, {})).to(DTYPE)
    eager = copy.deepcopy(model)
    batch = _batch(name, seed=1, batch_size=batch_size)
    pm = autopar.compile(model, mesh, example_inputs=batch, memory_budget=memory_budget, cluster=CLUSTER)
    result = {
        **step_against_eager(pm, eager, batch),
        "collectives": collective_counts(pm),
        "params": {fqn: [str(p) for p in spec] for fqn, spec in pm.plan.params.items()},
        "local_param_bytes": pm.local_param_bytes(),
        "plan_hash": pm.plan.hash,
    }
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if step:
            batch = _batch(name, seed=1 + step, batch_size=batch_size)
            opt.zero_grad()
            opt_eager.zero_grad()
            loss = pm(*batch)
            loss.backward()
            want = eager(*batch)
            want.backward()
            losses.append((loss.item(), want.item()))
        opt.step()
        opt_eager.step()
    result["step_losses"] = losses
    result["state_rel"] = max_rel_diff(pm.full_state_dict(), eager.state_dict())
    return result


def _run_mesh(rank: int, world: int, mesh: tuple[int, ...], budgets: dict[str, float]) -> dict:
    torch.manual_seed(0)
    results = {name: _train_one(name, mesh) for name in MODELS}
    for name, budget in budgets.items():
        model = build_model(name, seed=0, **CONFIGS.get(name, {})).to(DTYPE)
        budgeted = _train_one(name, mesh, memory_budget=budget, batch_size=BUDGET_BATCH)
        budgeted["budget"] = budget
        budgeted["full_param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        results[f"{name}_budget"] = budgeted
    return results


def _tight_budgets(mesh: tuple[int, ...]) -> dict[str, float]:
    """90% of the replicated parameters' own bytes (with gradients and AdamW state): no plan
    that keeps every parameter whole fits, so the plan must shard parameters."""
    budgets = {}
    for name in ("mlp", "gpt"):
        model = build_model(name, seed=0, **CONFIGS.get(name, {})).to(DTYPE)
        budgets[name] = 0.9 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())
    return budgets


def _check_first_step(rank: int, label: str, result: dict) -> None:
    got, want = result["loss"]
    assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {label}: loss {got} vs eager {want}"
    worst = max(result["grad_rel"], key=result["grad_rel"].get)
    assert result["grad_rel"][worst] < TOL, f"rank {rank} {label}: gradient of {worst} off by {result['grad_rel'][worst]:.2e}"


def _check(results_by_rank: list[dict]) -> None:
    first = results_by_rank[0]
    for rank, results in enumerate(results_by_rank):
        for name, result in results.items():
            _check_first_step(rank, name, result)
            for step, (got, want) in enumerate(result["step_losses"], start=2):
                assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {name}: step {step} loss {got} vs {want}"
            worst = max(result["state_rel"], key=result["state_rel"].get)
            assert result["state_rel"][worst] < TOL, (
                f"rank {rank} {name}: after {STEPS} AdamW steps {worst} off by {result['state_rel'][worst]:.2e}"
            )
            assert result["plan_hash"] == first[name]["plan_hash"], f"rank {rank} {name}: plan differs from rank 0"


def _check_budget(results_by_rank: list[dict]) -> None:
    for rank, results in enumerate(results_by_rank):
        for name in ("mlp_budget", "gpt_budget"):
            budgeted = results[name]
            assert budgeted["local_param_bytes"] < budgeted["budget"], (
                f"rank {rank} {name}: holds {budgeted['local_param_bytes']} parameter bytes, budget {budgeted['budget']:.0f}"
            )
            assert budgeted["local_param_bytes"] < budgeted["full_param_bytes"], f"{name}: tight budget but nothing sharded"
            sharded = [fqn for fqn, spec in budgeted["params"].items() if any(p.startswith("S") for p in spec)]
            assert sharded, f"{name}: no parameter sharded under a tight budget: {budgeted['params']}"


@pytest.mark.parametrize("mesh", [(2, 2), (2, 4)], ids=["mesh2x2", "mesh2x4"])
def test_models_match_eager(rank_pool, mesh: tuple[int, ...]) -> None:
    world = math.prod(mesh)
    if world == 4:  # the session's four ranks; the eight of (2, 4) are spawned for this test alone
        results = rank_pool(world).run(_run_mesh, mesh, _tight_budgets(mesh), timeout_s=600)
    else:
        results = run_distributed(_run_mesh, world, mesh, _tight_budgets(mesh), timeout_s=600)
    _check(results)
    _check_budget(results)
    # Every model family must have run sharded at least once (the toy MLP is cheapest
    # replicated when memory is free, so its sharded run is the budgeted one).
    for name in ("gpt", "cnn", "mlp_budget", "gpt_budget"):
        assert results[0][name]["collectives"], f"{name}: the plan should shard something on the cpu preset"


# Forced plans: each puts a replicated activation into a split computation somewhere, where the
# activation's gradient is a partial sum that only an allreduce_grad node makes whole.
FORCED = {
    "column_then_column": {"linear": ["S(1)"], "linear_1": ["S(1)"]},
    "column_then_row": {"linear": ["S(1)"], "linear_1": ["P"]},
    "replicated_then_column": {"linear": ["R"], "linear_1": ["S(1)"]},
    "batch_then_row": {"linear": ["S(0)"], "gelu": ["S(1)"], "linear_1": ["P"]},
}


VOCAB = 4096


def _run_forced(rank: int, world: int) -> dict:
    from autopar.cost.cluster import get_cluster
    from autopar.ir.spec import parse_spec
    from autopar.solver import solve
    from autopar.trace import trace

    results = {}
    for label, forced in FORCED.items():
        model = build_model("mlp_block", seed=0)
        eager = copy.deepcopy(model)
        batch = example_batch("mlp_block", batch_size=8, seed=1)
        plan = solve(trace(model, batch), (world,), get_cluster("cpu"), forced={k: parse_spec(v) for k, v in forced.items()})
        pm = autopar.compile(model, (world,), example_inputs=batch, plan=plan)
        results[label] = {**step_against_eager(pm, eager, batch), "collectives": collective_counts(pm)}
    # A large vocabulary: the planner splits the tied embedding/LM-head table by vocab and takes
    # the loss on vocab-split logits (the vocab-parallel cross-entropy kernel).
    model = build_model("gpt", seed=0, bias=False, vocab_size=VOCAB)
    eager = copy.deepcopy(model)
    batch = example_batch("gpt", batch_size=4, seed=1, vocab_size=VOCAB)
    pm_vocab = autopar.compile(model, (world,), example_inputs=batch, cluster="cpu")
    results["vocab_parallel"] = {
        **step_against_eager(pm_vocab, eager, batch),
        "kernels": sorted({d.kernel for d in pm_vocab.plan.nodes.values() if d.kernel}),
    }
    # Hand plans compile and run like any plan: real baselines.
    # Megatron on a GPT 256 wide: there its activations are all-reduced. On the default 64-wide
    # one the planner gathers the few weights instead (their gradients reduced once each, in a
    # bucket, cost less than the activations' all-reduces), which tests nothing of Megatron's.
    for kind, width in (("megatron", {"n_embd": 256}), ("fsdp", {})):
        model = build_model("gpt", seed=0, bias=False, **width)
        eager = copy.deepcopy(model)
        batch = example_batch("gpt", batch_size=4, seed=1, **width)
        plan = autopar.hand_plan(kind, model, (world,), example_inputs=batch, cluster="cpu")
        hand = autopar.compile(model, (world,), example_inputs=batch, plan=plan)
        results[f"hand_{kind}"] = {**step_against_eager(hand, eager, batch), "collectives": collective_counts(hand)}

    results.update(_reshard_runs(world))

    from torch.distributed.distributed_c10d import _resolve_process_group

    from autopar.runtime.module import world_timeout

    group = _resolve_process_group(pm._groups[0])
    results["timeouts"] = (world_timeout(), group._get_backend(torch.device("cpu")).options._timeout)
    try:
        pm(*example_batch("mlp_block", batch_size=16, seed=1))  # larger than planned (smaller is re-planned)
        results["wrong_shape"] = "ran"
    except ValueError as error:
        results["wrong_shape"] = str(error)
    return results


def _layer_segments(plan, traced) -> tuple:
    """One checkpoint segment per transformer block: its first and last op, in graph order."""
    from autopar.ir.memory import CheckpointSegment
    from autopar.solver.problem.choices import layer_key

    spans: dict = {}
    for node in traced.gm.graph.nodes:
        key = layer_key(node, None) if node.op == "call_function" else None
        if key is not None:
            spans.setdefault(key, []).append(node.name)
    return tuple(
        CheckpointSegment(f"{path}.{index}", names[0], names[-1], 0.0, 0.0) for (path, index), names in sorted(spans.items())
    )


def _reshard_runs(world: int) -> dict:
    """The fsdp hand plan under each ``CommOptions.reshard_after_forward``, with and without
    checkpointing every block: loss and gradients against eager, which gathered parameters are
    alive once forward returns, and the all-gathers of forward and of backward."""
    import dataclasses

    from autopar.ir.memory import MemoryPlan
    from autopar.ops import collectives
    from autopar.trace import trace

    model = build_model("gpt", seed=0, bias=False)
    eager = copy.deepcopy(model)
    batch = example_batch("gpt", batch_size=4, seed=1)
    want = eager(*batch)
    want.backward()
    plan = autopar.hand_plan("fsdp", model, (world,), example_inputs=batch, cluster="cpu")
    checkpointed = dataclasses.replace(
        plan, memory=MemoryPlan("cpu", True, checkpoint=_layer_segments(plan, trace(model, batch)))
    )
    launched: list[int] = []
    start_all_gather = collectives.start_all_gather
    collectives.start_all_gather = lambda out, x, name: launched.append(x.numel()) or start_all_gather(out, x, name)
    results = {}
    try:
        for label, chosen in (("", plan), ("_checkpointed", checkpointed)):
            # the planner's choice (gloo, memory to spare: every block kept) and a tuple of layers
            for reshard in (None, True, False) + (() if label else ("auto", ("", "transformer.h.1"))):
                pm = autopar.compile(
                    copy.deepcopy(model),
                    (world,),
                    example_inputs=batch,
                    plan=chosen,
                    comm=autopar.CommOptions(reshard_after_forward=reshard),
                )
                gathers = pm.graph_module.param_gathers
                launched.clear()
                loss = pm(*batch)
                alive, forward_gathers = gathers.live_gathered(), len(launched)
                loss.backward()
                results[f"reshard_{reshard}{label}"] = {
                    "kept_layers": chosen.kept_layers,
                    "loss": (loss.item(), want.item()),
                    "grad_rel": max_rel_diff(pm.full_grads(), eager_grads(eager)),
                    "groups": [list(keys) for keys in gathers.groups],
                    "resharded": [list(keys) for keys, flag in zip(gathers.groups, gathers.reshard) if flag],
                    "alive_after_forward": alive,
                    "forward_gathers": forward_gathers,
                    "backward_gathers": len(launched) - forward_gathers,
                    "checkpoints": sum(1 for name, _ in pm.graph_module.named_children() if name.startswith("checkpoint_")),
                    # reduce-scatter buckets: the gather groups of each, and the most inputs alive at once
                    "scatter_groups": [
                        sorted({slot.group for slot in bucket.slots})
                        for bucket in pm.graph_module.grad_buckets.buckets
                        if bucket.kind == "reduce_scatter"
                    ],
                    "max_scatter_inputs": pm.graph_module.grad_buckets.max_scatter_inputs,
                }
    finally:
        collectives.start_all_gather = start_all_gather
    return results


def _check_reshard(by_label: dict) -> None:
    """``reshard_after_forward``: True frees every gathered parameter after forward and gathers
    each group once more in backward; False keeps them all and gathers nothing in backward; None
    (FSDP2's default) keeps only the root's; a tuple keeps the layers it names; "auto" runs the
    layers the plan keeps (the hand plan on gloo with memory to spare: every one). Checkpointed
    blocks gather again in their recompute, whatever the option."""
    last = ("", "transformer.h.1")
    plain = {r: by_label.pop(f"reshard_{r}") for r in (None, True, False, "auto", last)}
    checkpointed = {r: by_label.pop(f"reshard_{r}_checkpointed") for r in (None, True, False)}
    groups = plain[False]["groups"]
    every = sorted(key for keys in groups for key in keys)
    root = sorted(key for keys in groups for key in keys if "_h_" not in key)
    assert root and len(root) < len(every), groups
    assert plain[True]["resharded"] == groups and plain[False]["resharded"] == []
    assert sorted(k for keys in plain[None]["resharded"] for k in keys) == sorted(set(every) - set(root))
    for reshard, result in plain.items():
        assert result["forward_gathers"] == len(groups), (reshard, result)
    assert plain[True]["alive_after_forward"] == [], "reshard_after_forward=True: nothing gathered outlives forward"
    assert plain[True]["backward_gathers"] == len(groups), "each group gathered once more in backward"
    # False keeps what backward needs: every gathered parameter an op saved (all but the
    # position table, which only an embedding reads)
    kept = plain[False]["alive_after_forward"]
    blocks = sorted(set(every) - set(root))
    assert set(blocks) < set(kept) and len(kept) == len(every) - 1, kept
    assert plain[False]["backward_gathers"] == 0
    assert plain[None]["alive_after_forward"] == sorted(set(kept) & set(root)), "the default keeps the root's only"
    assert plain[None]["backward_gathers"] == len(plain[None]["resharded"])
    # the planner kept every block: the run is False's
    assert plain["auto"]["kept_layers"] == ("", "transformer.h.0", "transformer.h.1"), plain["auto"]["kept_layers"]
    for key in ("resharded", "alive_after_forward", "backward_gathers"):
        assert plain["auto"][key] == plain[False][key], (key, plain["auto"][key], plain[False][key])
    first = sorted(key for key in every if "_h_0_" in key)
    assert first and sorted(k for keys in plain[last]["resharded"] for k in keys) == first, plain[last]
    assert plain[last]["alive_after_forward"] == sorted(set(kept) - set(first)), plain[last]
    assert 0 < plain[last]["backward_gathers"] == len(plain[last]["resharded"])
    for reshard, result in checkpointed.items():
        assert result["checkpoints"] == 2, result
        assert result["forward_gathers"] == len(groups), (reshard, result)
        assert result["backward_gathers"] > 0, "checkpointed blocks gather their parameters again in the recompute"
    assert checkpointed[True]["alive_after_forward"] == []
    # a block's gathers move into its checkpointed segment, so even False frees the blocks' parameters
    assert checkpointed[False]["alive_after_forward"] == sorted(set(kept) & set(root)), checkpointed[False]
    for label, runs in (("", plain), ("_checkpointed", checkpointed)):
        for reshard, result in runs.items():
            result.pop("kept_layers")
            # A reduce-scatter bucket stays inside one gather group, one per group at least, and the
            # next one's launch frees its input: at most two groups' whole gradients at once.
            scattered = result.pop("scatter_groups")
            assert scattered and all(len(groups_of_bucket) == 1 for groups_of_bucket in scattered), scattered
            assert len({g for (g,) in scattered}) > 2, scattered
            assert 1 <= result.pop("max_scatter_inputs") <= 2, result
            by_label[f"reshard_{reshard}{label}"] = result  # loss and gradients: checked like every run


def test_forced_plans_with_split_activations_match_eager() -> None:
    results = run_distributed(_run_forced, 2, timeout_s=300, pg_timeout_s=45)
    for rank, by_label in enumerate(results):
        _check_reshard(by_label)
        world, axis = by_label.pop("timeouts")
        message = by_label.pop("wrong_shape")
        assert "(16, 64)" in message and "(8, 64)" in message, f"a wrong input shape must be named: {message}"
        assert world.total_seconds() == 45 and axis == world, f"mesh groups must inherit the world timeout: {axis} vs {world}"
        for label, result in by_label.items():
            _check_first_step(rank, label, result)
    assert results[0]["replicated_then_column"]["collectives"].get("allreduce_grad"), "the gelu gradient must be all-reduced"
    assert results[0]["hand_megatron"]["collectives"].get("all_reduce"), "Megatron all-reduces activations"
    assert results[0]["hand_fsdp"]["collectives"].get("all_gather"), "FSDP gathers parameters"
    kernels = results[0]["vocab_parallel"]["kernels"]
    assert {"embedding_vocab_split", "cross_entropy_vocab_split"} <= set(kernels), kernels


def _infeasible_on_every_rank(rank: int, world: int) -> str:
    model = build_model("mlp", seed=0)
    try:
        autopar.compile(model, (world,), example_inputs=example_batch("mlp", 8), memory_budget=1000)
    except autopar.InfeasibleError as error:
        return str(error)
    return "compiled"


def test_planning_error_reaches_every_rank_without_waiting_for_a_timeout() -> None:
    start = time.monotonic()
    messages = run_distributed(_infeasible_on_every_rank, 2, timeout_s=300)
    assert all("leanest plan needs" in m for m in messages), messages
    assert time.monotonic() - start < 60, "ranks waited for the process-group timeout"
