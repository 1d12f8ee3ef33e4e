"""``SolveOptions.budget_gap``: where a memory budget binds, how close to the LP bound the fast
search's plan must be for the planner to keep it without the MILP's second opinion."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cli.main import _fraction
from autopar.cost.memory import param_state_bytes
from autopar.errors import ConfigError
from autopar.ir.options import MemoryOptions, PlanOptions, SolveOptions
from autopar.solver.planners import sharding
from autopar.zoo.models import build_model, example_batch


def _budgeted(gap: float, monkeypatch) -> tuple[autopar.Plan, int]:
    """A GPT under 60% of its parameter state on (2, 2): the budget binds. Returns the plan and
    how many times the MILP ran."""
    torch.manual_seed(0)
    model, batch = build_model("gpt"), example_batch("gpt", 8)
    budget = 0.6 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())
    runs = []
    real = sharding.solve_within_budget
    monkeypatch.setattr(sharding, "solve_within_budget", lambda *a, **k: runs.append(1) or real(*a, **k))
    options = PlanOptions(memory=MemoryOptions(budget=budget), solve=SolveOptions(budget_gap=gap))
    plan = autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu", options=options)
    return plan, len(runs)


def test_a_gap_of_one_keeps_the_fast_plan_and_zero_asks_the_milp(monkeypatch):
    fast, never = _budgeted(1.0, monkeypatch)
    assert never == 0, "budget_gap=1: the fast search's plan stands, no MILP"
    exact, always = _budgeted(0.0, monkeypatch)
    assert always == 1, "budget_gap=0: the MILP gives its second opinion"
    assert exact.predicted.step_time_s <= fast.predicted.step_time_s * (1 + 1e-9), "the better of the two is kept"
    assert exact.predicted.peak_memory_bytes <= 0.6 * sum(
        param_state_bytes(p.shape, p.dtype, (), ()) for p in build_model("gpt").parameters()
    )


def test_a_gap_outside_zero_to_one_is_refused_by_the_options_and_the_cli():
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ConfigError, match="budget_gap must be a fraction from 0 to 1"):
            SolveOptions(budget_gap=bad)
    assert _fraction("0.2") == 0.2
    with pytest.raises(Exception, match="expected a fraction from 0 to 1"):
        _fraction("2")
