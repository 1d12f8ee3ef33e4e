"""Symbolic costs: plan.predict(batch=...) against a real re-plan at that batch size."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.errors import PlanError
from autopar.solver import solve
from autopar.solver.planners.hand_plans import param_specs
from autopar.solver.pricing.symbolic import price_plan, totals
from autopar.trace import trace
from autopar.zoo.models import GPT

KEYS = ("step_time_s", "comm_bytes", "peak_memory_bytes")


def _gpt():
    torch.manual_seed(0)
    return GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def _inputs(batch: int):
    idx = torch.zeros(batch, 16, dtype=torch.long)
    return idx, idx


def test_predict_matches_a_real_replan_at_another_batch(tmp_path):
    model = _gpt()
    cpu = get_cluster("cpu")
    # a tight budget makes the plan shard something, so that communication is not zero
    # (with checkpointing, allowed by default, it would recompute a layer instead)
    free = autopar.plan(model, (2, 2), example_inputs=_inputs(8), cluster=cpu)
    plan = autopar.plan(
        model,
        (2, 2),
        example_inputs=_inputs(8),
        cluster=cpu,
        symbolic_batch=True,
        memory_budget=0.8 * free.predicted.peak_memory_bytes,
        checkpointing=False,
    )
    assert plan.predicted.comm_bytes > 0
    # at its own batch, the symbolic form gives back the plan's numbers
    here = plan.predict(batch=8)
    for key in KEYS:
        assert here[key] == pytest.approx(getattr(plan.predicted, key), rel=1e-9)
    # the same choices, re-planned from a new trace at batch 32
    forced = {name: node.outs[0] for name, node in plan.nodes.items() if node.outs and node.source != "follow"}
    replanned = solve(trace(model, _inputs(32)), (2, 2), cpu, forced=forced)
    predicted = plan.predict(batch=32)
    for key in KEYS:
        assert predicted[key] == pytest.approx(getattr(replanned.predicted, key), rel=1e-6), key
    assert predicted["peak_memory_bytes"] > plan.predicted.peak_memory_bytes
    # the expressions survive a save and load
    plan.save(tmp_path / "plan.json")
    assert autopar.Plan.load(tmp_path / "plan.json").predict(batch=32) == predicted
    with pytest.raises(ValueError, match="positive integer"):
        plan.predict(batch=0)


def test_price_plan_reproduces_the_solver_and_predict_needs_symbolic_costs():
    model = _gpt()
    cpu = get_cluster("cpu")
    traced = trace(model, _inputs(8))
    plan = solve(traced, (2, 2), cpu)
    priced = totals(price_plan(traced, plan, cpu))
    for key in KEYS:
        assert priced[key] == pytest.approx(getattr(plan.predicted, key), rel=1e-9), key
    # FSDP: its gathered parameters and reduce-scatter buckets are in the peak it reproduces (its
    # scheduled communication's time and bytes come from ``predicted.grad_schedule``)
    fsdp = solve(traced, (4,), cpu, forced=param_specs("fsdp", traced, (4,)))
    assert fsdp.predicted.memory_at_peak_bytes["gathered"] > 0
    priced = totals(price_plan(traced, fsdp, cpu))
    assert priced["peak_memory_bytes"] == pytest.approx(fsdp.predicted.peak_memory_bytes, rel=1e-9)
    with pytest.raises(PlanError, match="symbolic_batch=True"):
        plan.predict(batch=16)
