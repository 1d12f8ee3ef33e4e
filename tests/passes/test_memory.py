"""Checkpointed segments at run time (autopar/passes/memory.py): a "selective" segment trains as
eager does, and keeps from forward to backward what the plan says it keeps: less than no
checkpointing, more than whole-layer checkpointing, as much as the planner priced."""

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
POLICIES = (False, "selective", "full")


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

    def alive_bytes(self) -> int:
        gc.collect()
        alive = {}
        for ref in self.storages:
            storage = ref()
            if storage is not None:
                alive[storage.data_ptr()] = storage.nbytes()
        return sum(alive.values())


def _kept_for_backward(pm, batch) -> int:
    """Bytes that forward made and that are still alive when backward starts."""
    mode = _Allocated()
    with mode:
        loss = pm(*batch)
    kept = mode.alive_bytes()
    loss.backward()
    return kept


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
    for policy in ("selective", "full"):
        segments = plans[policy].memory.checkpoint
        assert len(segments) == 2 and {s.policy for s in segments} == {policy}
    # A selective checkpoint saves less and recomputes less than a full one, per layer.
    for selective, full in zip(plans["selective"].memory.checkpoint, plans["full"].memory.checkpoint):
        assert 0 < selective.saved_bytes < full.saved_bytes and 0 < selective.cost_s < full.cost_s


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


def test_selective_checkpointing_trains_as_eager(world_of_one, model_and_plans):
    model, batch, plans = model_and_plans
    pm = autopar.compile(copy.deepcopy(model), (1,), example_inputs=batch, plan=plans["selective"])
    segments = [m for m in pm.graph_module.modules() if isinstance(m, memory_pass.Checkpointed)]
    assert len(segments) == 2 and all(m.policy == "selective" for m in segments)
    worst = _train(pm, copy.deepcopy(model), batch)
    assert all(diff < TOL for diff in worst.values()), worst


def _measure(model, batch, plan) -> int:
    return _kept_for_backward(autopar.compile(copy.deepcopy(model), (1,), example_inputs=batch, plan=plan), batch)


@pytest.fixture(scope="module")
def measured(world_of_one, model_and_plans) -> dict:
    model, batch, plans = model_and_plans
    return {policy: _measure(model, batch, plans[policy]) for policy in POLICIES}


def _check_kept_bytes(measured: dict, plans: dict) -> None:
    """Selective keeps less than no checkpointing and more than full, and each saves what the
    plan priced (within 20%: the planner prices the traced graph, torch runs the kernels)."""
    for policy in ("selective", "full"):
        saved, predicted = measured[False] - measured[policy], _predicted_saving(plans[policy])
        assert saved == pytest.approx(predicted, rel=0.2), (policy, measured, predicted)
    gap = _predicted_saving(plans["full"]) - _predicted_saving(plans["selective"])
    assert measured["full"] + gap / 2 < measured["selective"] < measured[False] - _predicted_saving(plans["selective"]) / 2


def test_selective_checkpointing_keeps_what_the_plan_says(model_and_plans, measured):
    _check_kept_bytes(measured, model_and_plans[2])


@pytest.mark.parametrize("mutant", ["recomputes nothing", "recomputes everything"])
def test_a_runtime_that_drops_the_selective_policy_fails(model_and_plans, measured, monkeypatch, mutant):
    model, batch, plans = model_and_plans
    policy = torch.utils.checkpoint.CheckpointPolicy
    chosen = policy.MUST_SAVE if mutant == "recomputes nothing" else policy.PREFER_RECOMPUTE
    monkeypatch.setattr(memory_pass, "_selective_policy", lambda ctx, op, *args, **kwargs: chosen)
    mutated = {**measured, "selective": _measure(model, batch, plans["selective"])}
    with pytest.raises(AssertionError):
        _check_kept_bytes(mutated, plans)
