"""The leanest sharding without a MILP (autopar/solver/search/lean.py), and planning under a
budget that no sharding meets alone (``sharding._lean_start``): no LP with memory rows, no MILP."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autopar.cost.cluster import get_cluster
from autopar.ir.options import MemoryOptions, PlanOptions, SolveOptions
from autopar.solver import solve
from autopar.solver.planners import sharding
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search import budget as budget_search
from autopar.solver.search.lean import lean_choice, least_peak
from autopar.solver.search.solving import peak_memory, solve_ilp
from autopar.trace import trace
from tests.conftest import meta_llama_and_batch

MESH = (4,)


@pytest.fixture(scope="module")
def traced():
    model, batch = meta_llama_and_batch(2)
    return trace(model, batch)


@pytest.fixture(scope="module")
def graph(traced):
    return build_choice_graph(traced, MESH, get_cluster("h100-80g"))


def test_the_built_plan_is_as_lean_as_the_milps(graph):
    floor = least_peak(graph)
    unbounded = solve_ilp(ShardingILP(graph), 60)
    assert floor <= peak_memory(graph, unbounded).bytes
    lean = lean_choice(ShardingILP(graph), floor)
    assert lean is not None
    exact = sharding._leanest(graph, 60, "highs")
    assert exact.status == "Optimal"
    # The bound is a bound: the MILP's leanest cannot go under it, and the built plan meets it.
    assert floor <= peak_memory(graph, exact).bytes * (1 + 1e-9)
    assert graph.timeline.peak(graph.bytes_of(lean))[0] == pytest.approx(peak_memory(graph, exact).bytes, rel=1e-9)


def test_a_budget_no_sharding_meets_plans_without_the_memory_lp_or_the_milp(traced, graph, monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a budget under the least peak needs neither the LP with memory rows nor the MILP")

    monkeypatch.setattr(sharding, "_solve_budgeted", refused)
    monkeypatch.setattr(sharding, "_leanest", refused)
    budget = 0.9 * least_peak(graph)
    options = PlanOptions.from_keywords(memory_budget=budget, offload="auto")
    plan = solve(traced, MESH, get_cluster("h100-80g"), options)
    assert plan.memory is not None and plan.predicted.peak_memory_bytes <= budget
    assert plan.solver.method in ("leanest", "lagrangian")


@pytest.fixture(scope="module")
def gpt_oss():
    """The tiny Hugging Face GPT-OSS of issue 48 (``benchmarks/bench_plan_time.py``, built there),
    traced, and 60% of its parameter, gradient and AdamW bytes: no sharding fits that alone."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import bench_plan_time  # a script, found on the path set above

    model, args, kwargs, _ = bench_plan_time._gpt_oss(2)
    return trace(model, args, kwargs), 0.6 * bench_plan_time._state_bytes(model)


def test_the_front_stops_at_a_plan_that_loses_and_plans_alike(gpt_oss, monkeypatch):
    """The Lagrangian front ends at its first plan that is no faster before its memory decisions
    than the best plan so far with them (``sharding._front_stop``): fewer LPs, the same plan."""
    traced, budget = gpt_oss
    steps = []
    fits = budget_search._lagrangian_fits
    monkeypatch.setattr(budget_search, "_lagrangian_fits", lambda *args: steps.append(args[2]) or fits(*args))
    cluster, mesh = get_cluster("h100-80g"), (2, 2)
    options = PlanOptions.from_keywords(memory_budget=budget, offload="auto")
    stopped = solve(traced, mesh, cluster, options)
    stopped_steps = len(steps)
    steps.clear()
    monkeypatch.setattr(sharding, "_front_stop", lambda *args: None)  # the whole front
    whole = solve(traced, mesh, cluster, options)
    assert stopped.solver.method == "lagrangian" and stopped.predicted.peak_memory_bytes <= budget
    assert stopped_steps < len(steps)
    assert stopped.hash == whole.hash


def test_the_front_ends_where_later_plans_can_win_back_at_most_the_gap(gpt_oss, monkeypatch):
    """With ``budget_gap`` 0.05 the front ends once a later plan, no faster than the last and
    paying for memory decisions at least what the cheapest so far paid, could beat the best plan
    by 5% at most (``sharding._front_stop``): on this GPT-OSS at 55% of its state, one LP fewer
    than with a gap of 0, and the same plan. (At 60% no longer since the ILP prices communication
    as the runtime overlaps it, ``gather_overlap``: its front's plans are more than 5% apart.)"""
    traced, budget = gpt_oss
    budget *= 0.55 / 0.6
    steps = []
    fits = budget_search._lagrangian_fits
    monkeypatch.setattr(budget_search, "_lagrangian_fits", lambda *args: steps.append(args[2]) or fits(*args))
    cluster, mesh = get_cluster("h100-80g"), (2, 2)
    plans, counts = {}, {}
    for gap in (0.0, 0.05):
        steps.clear()
        options = PlanOptions(memory=MemoryOptions(budget=budget, offload="auto"), solve=SolveOptions(budget_gap=gap))
        plans[gap], counts[gap] = solve(traced, mesh, cluster, options), len(steps)
    assert counts[0.05] < counts[0.0]
    assert plans[0.05].hash == plans[0.0].hash
    assert plans[0.05].predicted.peak_memory_bytes <= budget
