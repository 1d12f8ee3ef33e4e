"""Checkpointed segments at run time (autopar/passes/memory.py): a "selective" or "selective-op"
(torchtitan's op-level policy) segment trains as eager does, and keeps from forward to backward
what the plan says it keeps: less than no checkpointing, more than whole-layer checkpointing
("selective-op" less than "selective"), as much as the planner priced."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.passes import memory as memory_pass
from autopar.zoo.models import build_model, example_batch

TOL = 1e-9  # float64
POLICIES = (False, "selective", "selective-op", "full")
SELECTIVE = ("selective", "selective-op")
# The checkpointing policies, from the one that frees least to the one that frees most.
CHECKPOINTED = ("selective", "selective-op", "full")


class _Allocated(TorchDispatchMode):
    """Every storage an op makes while the mode is on, by weak reference: the ones still alive
    after forward are what it keeps for backward (autograd's saved tensors, the inputs that a
    checkpoint keeps, and the outputs that a selective checkpoint caches for its recompute).
    torch's saved-tensor hooks see none of the last two: inside a checkpoint, its own hooks
    replace the caller's."""

    def __init__(self):
        super().__init__()
        self.storages: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in torch.utils._pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.storages.append(weakref.ref(leaf.untyped_storage()))
        return out

    def alive_bytes(self, exclude: set[int]) -> int:
        gc.collect()
        alive = {}
        for ref in self.storages:
            storage = ref()
            if storage is not None and storage.data_ptr() not in exclude:
                alive[storage.data_ptr()] = storage.nbytes()
        return sum(alive.values())


def _kept_for_backward(pm, batch) -> tuple[int, int]:
    """(bytes that forward made and that are still alive when backward starts, bytes of the
    tensors autograd's saved-tensor hooks saw saved), neither counting parameters or inputs."""
    exclude = {t.untyped_storage().data_ptr() for t in batch}
    exclude |= {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in pm.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    mode = _Allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), mode:
        loss = pm(*batch)
    kept = mode.alive_bytes(exclude)
    loss.backward()
    return kept, sum(saved.values())


@pytest.fixture(scope="module", params=["gpt", "llama"])
def model_and_plans(request):
    model = build_model(request.param, seed=0, n_layer=2).double()
    batch = example_batch(request.param, 4, seed=1)
    plans = {
        policy: autopar.plan(model, (1,), example_inputs=batch, cluster="cpu", checkpointing=policy, memory_budget=float("inf"))
        for policy in POLICIES
    }
    return model, batch, plans


def _predicted_saving(plan) -> float:
    return sum(segment.saved_bytes for segment in plan.memory.checkpoint) if plan.memory else 0.0


def test_a_policy_checkpoints_every_layer_whatever_the_budget(model_and_plans):
    _, _, plans = model_and_plans
    assert plans[False].memory is None
    for policy in CHECKPOINTED:
        segments = plans[policy].memory.checkpoint
        assert len(segments) == 2 and {s.policy for s in segments} == {policy}
    # Per layer, selective saves and recomputes less than selective-op (which recomputes every
    # second matmul too), which saves and recomputes less than full.
    for layers in zip(*(plans[policy].memory.checkpoint for policy in CHECKPOINTED)):
        assert 0 < layers[0].saved_bytes < layers[1].saved_bytes < layers[2].saved_bytes, layers
        assert 0 < layers[0].cost_s < layers[1].cost_s < layers[2].cost_s, layers


def _train(pm, eager, batch, steps=3) -> dict:
    opt, eager_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, eager))
    worst = {"loss": 0.0, "grad": 0.0, "weights": 0.0}
    for _ in range(steps):
        loss, want = pm(*batch), eager(*batch)
        loss.backward()
        want.backward()
        worst["loss"] = max(worst["loss"], abs(loss.item() - want.item()))
        grads = pm.full_grads()
        worst["grad"] = max(worst["grad"], max((grads[n] - p.grad).abs().max().item() for n, p in eager.named_parameters()))
        for o in (opt, eager_opt):
            o.step()
            o.zero_grad()
    got = pm.full_state_dict()
    worst["weights"] = max((got[k] - v).abs().max().item() for k, v in eager.state_dict().items())
    return worst


@pytest.mark.parametrize("policy", SELECTIVE)
def test_selective_checkpointing_trains_as_eager(world_of_one, model_and_plans, policy):
    model, batch, plans = model_and_plans
    pm = autopar.compile(copy.deepcopy(model), (1,), example_inputs=batch, plan=plans[policy])
    segments = [m for m in pm.graph_module.modules() if isinstance(m, memory_pass.Checkpointed)]
    assert len(segments) == 2 and all(m.policy == policy for m in segments)
    worst = _train(pm, copy.deepcopy(model), batch)
    assert all(diff < TOL for diff in worst.values()), worst


def _measure(model, batch, plan) -> tuple[int, int]:
    return _kept_for_backward(autopar.compile(copy.deepcopy(model), (1,), example_inputs=batch, plan=plan), batch)


@pytest.fixture(scope="module")
def measured_with_hooks(world_of_one, model_and_plans) -> dict:
    model, batch, plans = model_and_plans
    return {policy: _measure(model, batch, plans[policy]) for policy in POLICIES}


@pytest.fixture(scope="module")
def measured(measured_with_hooks) -> dict:
    return {policy: kept for policy, (kept, _) in measured_with_hooks.items()}


def test_the_count_is_what_saved_tensor_hooks_see_where_they_see_it(measured_with_hooks):
    """Without checkpoints every tensor kept for backward goes through autograd's saved-tensor
    hooks, and the storages alive after forward are those (and the loss); inside a checkpoint
    the hooks see nothing (its own replace them), which is why the count is of storages."""
    kept, hooked = measured_with_hooks[False]
    assert hooked > 0 and 0 <= kept - hooked <= 64, (kept, hooked)


def _check_kept_bytes(measured: dict, plans: dict) -> None:
    """Each policy keeps less than no checkpointing and more than the next in ``CHECKPOINTED``
    (by at least half the gap the plan priced), and saves what the plan priced (within 20%: the
    planner prices the traced graph, torch runs the kernels)."""
    for policy in CHECKPOINTED:
        saved, predicted = measured[False] - measured[policy], _predicted_saving(plans[policy])
        assert saved == pytest.approx(predicted, rel=0.2), (policy, measured, predicted)
    for less, more in zip(CHECKPOINTED, CHECKPOINTED[1:]):
        gap = _predicted_saving(plans[more]) - _predicted_saving(plans[less])
        assert measured[more] + gap / 2 < measured[less], (less, more, measured, gap)
    for policy in SELECTIVE:
        assert measured[policy] < measured[False] - _predicted_saving(plans[policy]) / 2, (policy, measured)


def test_selective_checkpointing_keeps_what_the_plan_says(model_and_plans, measured):
    _check_kept_bytes(measured, model_and_plans[2])


@pytest.mark.parametrize("mutant", ["recomputes nothing", "recomputes everything"])
def test_a_runtime_that_drops_the_selective_policy_fails(model_and_plans, measured, monkeypatch, mutant):
    model, batch, plans = model_and_plans
    policy = torch.utils.checkpoint.CheckpointPolicy
    chosen = policy.MUST_SAVE if mutant == "recomputes nothing" else policy.PREFER_RECOMPUTE
    monkeypatch.setattr(memory_pass, "_selective_policy", lambda ctx, op, *args, **kwargs: chosen)
    mutated = {**measured, "selective": _measure(model, batch, plans["selective"])[0]}
    with pytest.raises(AssertionError):
        _check_kept_bytes(mutated, plans)


def test_a_selective_op_runtime_that_keeps_every_matmul_fails(model_and_plans, measured, monkeypatch):
    """torchtitan's policy without its count (every matmul kept, as "selective" keeps them)
    keeps more than the plan priced, and the check says so."""
    model, batch, plans = model_and_plans
    monkeypatch.setattr(
        memory_pass._SelectiveOpPolicy, "__call__", lambda self, ctx, op, *a, **k: memory_pass._selective_policy(ctx, op)
    )
    mutated = {**measured, "selective-op": _measure(model, batch, plans["selective-op"])[0]}
    with pytest.raises(AssertionError):
        _check_kept_bytes(mutated, plans)


def _two_rank_run(rank: int, world_size: int, plan_paths: list[str]) -> list[dict]:
    model = build_model("gpt", seed=0, n_layer=2).double()
    batch = example_batch("gpt", 4, seed=1)
    out = []
    for path in plan_paths:
        pm = autopar.compile(copy.deepcopy(model), (2,), example_inputs=batch, plan=path)
        out.append(_train(pm, copy.deepcopy(model), batch, steps=2))
    return out


@pytest.mark.multiproc
def test_selective_checkpointing_with_collectives_inside_on_two_ranks(rank_pool, tmp_path):
    """FSDP's all-gathers and Megatron's all-reduces inside selective segments: the recompute
    runs them again on every rank, and the numbers stay eager's."""
    model = build_model("gpt", seed=0, n_layer=2).double()
    batch = example_batch("gpt", 4, seed=1)
    paths = []
    for kind, policy in (("fsdp", "selective"), ("megatron", "selective"), ("fsdp", "selective-op")):
        plan = autopar.hand_plan(kind, model, (2,), example_inputs=batch, cluster="cpu", checkpointing=policy)
        assert {s.policy for s in plan.memory.checkpoint} == {policy}
        plan.save(tmp_path / f"{kind}-{policy}.json")
        paths.append(str(tmp_path / f"{kind}-{policy}.json"))
    for results in rank_pool(2).run(_two_rank_run, paths, timeout_s=300):
        for worst in results:
            assert all(diff < TOL for diff in worst.values()), worst
