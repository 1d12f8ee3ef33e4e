"""``SolveOptions.budget_gap``: where a memory budget binds, how close to the LP bound the fast
search's plan must be for the planner to keep it without the MILP's second opinion."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cli.main import _fraction
from autopar.cost.cluster import get_cluster
from autopar.cost.memory import param_state_bytes
from autopar.errors import ConfigError
from autopar.ir.options import MemoryOptions, PlanOptions, SolveOptions
from autopar.solver import solve
from autopar.solver.planners import sharding
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.search.lean import least_peak
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.conftest import meta_llama_and_batch


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


@pytest.fixture(scope="module")
def small_llama():
    model, batch = meta_llama_and_batch(4)
    return trace(model, batch)


# (mesh, cluster, budget as a multiple of the least peak): under 1 no sharding fits alone (the
# Lagrangian front, ``sharding._front_stop``), above it the shardings weighed with memory
# decisions (``sharding._with_memory_decisions``); at a gap of 0.2 each of these plans another way.
# (Not h100-80g's (8,) since the ILP prices communication as the runtime overlaps it,
# ``gather_overlap``: the shardings there are no longer within the gap of each other.)
GAP_CASES = [((2, 4), "h100-80g", 0.9), ((2, 4), "h100-80g", 1.3), ((2, 2), "cpu", 0.9), ((8,), "cpu", 1.6)]


@pytest.mark.parametrize("mesh, cluster_name, fraction", GAP_CASES)
def test_a_gap_gives_up_at_most_that_share_of_the_step_and_prices_fewer_memory_plans(
    small_llama, monkeypatch, mesh, cluster_name, fraction
):
    """A sharding whose step before checkpointing and offload is within ``budget_gap`` of the best
    plan so far is not given memory decisions, and the front ends there: the plan is at most
    1 / (1 - gap) times as slow as with a gap of 0, never over the budget, and fewer plans are
    weighed."""
    cluster = get_cluster(cluster_name)
    budget = fraction * least_peak(build_choice_graph(small_llama, mesh, cluster))
    calls = []
    real = sharding.plan_memory
    monkeypatch.setattr(sharding, "plan_memory", lambda *a, **k: calls.append(1) or real(*a, **k))
    plans, weighed = {}, {}
    for gap in (0.0, 0.05, 0.2):
        calls.clear()
        options = PlanOptions(memory=MemoryOptions(budget=budget, offload="auto"), solve=SolveOptions(budget_gap=gap))
        plans[gap], weighed[gap] = solve(small_llama, mesh, cluster, options), len(calls)
        assert plans[gap].predicted.peak_memory_bytes <= budget
    exact = plans[0.0].predicted.step_time_s
    for gap in (0.05, 0.2):
        assert plans[gap].predicted.step_time_s <= exact / (1 - gap) * (1 + 1e-9), f"budget_gap={gap}"
        assert weighed[gap] <= weighed[0.0]
    skipped = weighed[0.2] < weighed[0.0] or plans[0.2].hash != plans[0.0].hash
    assert skipped, "a gap of 0.2 skips a sharding in each case: the test weighs something"
