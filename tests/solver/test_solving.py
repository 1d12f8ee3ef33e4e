"""The solve step: backends, the LP fast path, and the fallbacks, against the plain MILP.

A tiny LLaMA (the structure of the real ones: rotary tables fed to every layer, GQA, SwiGLU)
on a (2, 2) mesh, traced once on the meta device; each check is one solve of a few seconds.
Two blocks: the second is tied to the first, and CBC proves the untied reference optimal in
about 20 s (three blocks took it 55 s, for the same checks).
"""

from __future__ import annotations

import dataclasses

import pulp
import pytest

from autopar.cost.cluster import get_cluster
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search import backends, rounding, solving
from autopar.solver.search.solving import solve_ilp
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.conftest import meta_llama_and_batch


@pytest.fixture(scope="module")
def traced():
    model, batch = meta_llama_and_batch(2)
    return trace(model, batch)


@pytest.fixture(scope="module")
def graphs(traced):
    cluster = get_cluster("h100-80g")
    return {share: build_choice_graph(traced, (2, 2), cluster, share_layers=share) for share in (True, False)}


@pytest.fixture(scope="module")
def plain(graphs):
    """The reference: the untied MILP solved to optimality by CBC."""
    solution = solve_ilp(ShardingILP(graphs[False]), 120, "cbc")
    assert solution.status == "Optimal" and solution.method == "milp"
    return solution


def test_llama_layers_are_tied(graphs):
    tied = graphs[True]
    layer_two = [n for n in tied.order if n in tied.layer_template]
    assert len(layer_two) > 50, "the second LLaMA block should reuse the first one's choices"
    first = set(tied.layer_template.values())
    assert first and not first & set(layer_two), "each tied node stands for a node of the first block"


@pytest.mark.parametrize("solver", ["auto", "highs", "cbc"])
def test_every_solver_on_the_tied_graph_reaches_the_plain_optimum(graphs, plain, solver):
    solution = solve_ilp(ShardingILP(graphs[True]), 120, solver)
    assert solution.status == "Optimal"
    # A MILP stops within MIP_REL_GAP of the optimum; the LP fast path is exact.
    assert solution.objective_s == pytest.approx(plain.objective_s, rel=2 * backends.MIP_REL_GAP)
    assert solution.gap is not None and solution.gap <= backends.MIP_REL_GAP
    assert solution.bound_s <= solution.objective_s * (1 + 1e-9)
    if solver == "auto":
        assert solution.backend == "highs" and solution.method in ("lp-rounding", "milp")


def test_fallback_when_the_milp_finds_nothing(graphs, plain, monkeypatch):
    real_make = backends.make

    def no_milp(name, time_limit_s, *, mip=True):
        if mip:  # a MILP that gives up at once: no incumbent, as after a time limit
            return pulp.HiGHS(mip=True, msg=False, timeLimit=1e-6)
        return real_make(name, time_limit_s, mip=mip)

    monkeypatch.setattr(backends, "make", no_milp)
    ilp = ShardingILP(graphs[True])
    solution = solve_ilp(ilp, 30, "highs")
    assert solution.status == "Feasible (fallback)"
    assert solution.method in ("lp-rounding", "greedy")
    assert solution.choice and solution.bound_s is not None
    # The reported objective is the exact ILP objective of the returned choice, and the gap is
    # measured against a true lower bound.
    assert rounding.check(ilp, solution.choice) == pytest.approx(solution.objective_s, rel=1e-9)
    assert solution.bound_s <= plain.objective_s * (1 + 1e-9)
    assert plain.objective_s <= solution.objective_s * (1 + 1e-9)
    assert solution.gap == pytest.approx((solution.objective_s - solution.bound_s) / solution.objective_s)


def test_greedy_plans_are_feasible_and_never_beat_the_optimum(graphs, plain):
    ilp = ShardingILP(graphs[True])
    value, choice, method = next(solving._greedy_plans(ilp))
    assert method == "greedy"
    assert rounding.check(ilp, choice) == pytest.approx(value)
    assert value >= plain.objective_s * (1 - 1e-9)


def test_rows_hold_agrees_with_pulp_row_by_row(graphs, plain):
    """``ShardingILP.rows_hold`` (numpy) says what PuLP's ``LpConstraint.valid`` says of every row:
    for a plan that fits, for one that breaks a pick row, and for memory rows at a budget that the
    plan breaks and one it meets, added after a first check (the table grows)."""
    import warnings

    from autopar.solver.search.solving import peak_memory

    def pulp_says(ilp):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            rows = list(ilp.problem.constraints.values())
        return all(row.valid(rounding._TOLERANCE * max(1.0, abs(row.constant))) for row in rows)

    graph = graphs[True]
    ilp = ShardingILP(graph)
    choice = solve_ilp(ShardingILP(graph), 60).choice
    assert rounding.check(ilp, choice) is not None
    assert ilp.rows_hold(rounding._TOLERANCE) and pulp_says(ilp)
    name = rounding.deciding_nodes(graph)[0]
    ilp.x[name][choice[name]].varValue = 0.0  # the node picks no strategy now
    assert not ilp.rows_hold(rounding._TOLERANCE) and not pulp_says(ilp)
    peak = peak_memory(graph, plain).bytes
    for budget, holds in ((0.5 * peak, False), (2 * peak, True)):
        budgeted = ShardingILP(graph)
        assert rounding.check(budgeted, choice) is not None  # the table is built without memory rows
        budgeted.add_memory_constraint(budget)
        assert (rounding.check(budgeted, choice) is not None) is holds
        assert budgeted.rows_hold(rounding._TOLERANCE) is holds and pulp_says(budgeted) is holds


def test_unknown_solver_is_refused(graphs):
    with pytest.raises(ValueError, match="unknown solver 'gurobi'"):
        solve_ilp(ShardingILP(graphs[True]), 10, "gurobi")


def test_budget_fast_path_fits_and_reports_its_gap_to_the_milp(graphs):
    """Under a binding budget the Lagrangian fast path (``solver.search.budget``) returns a plan that fits,
    no faster than the MILP's optimum, within the gap it reports to its bound."""
    from autopar.solver.search.budget import solve_under_budget
    from autopar.solver.search.solving import peak_memory

    graph = graphs[True]
    unbounded = solve_ilp(ShardingILP(graph), 60)
    lean = graph.timeline.peak(graph.bytes_bound(largest=False))[0]
    budget = lean + 0.3 * (peak_memory(graph, unbounded).bytes - lean)
    fast_ilp = ShardingILP(graph, budget)
    fast = solve_under_budget(fast_ilp, budget, 60, unbounded)
    exact, fits = solving.solve_within_budget(ShardingILP(graph, budget), budget, 120, "highs")
    assert fast.choice and fits and exact.choice
    assert peak_memory(graph, fast).bytes <= budget * (1 + 1e-9) < peak_memory(graph, unbounded).bytes
    assert fast.method in ("lagrangian", "lp-rounding", "lp-diving") and fast.gap is not None
    assert exact.objective_s <= fast.objective_s * (1 + 1e-9)
    assert fast.bound_s <= exact.objective_s * (1 + 1e-6), "the reported bound is a lower bound"


def test_the_leanest_sharding_is_found_by_highs(graphs):
    """Memory rows are in GiB: in bytes, HiGHS called the leanest sharding of HF LLaMA-3-8B infeasible."""
    from autopar.solver.planners.sharding import _leanest

    leanest = _leanest(graphs[True], 60, "highs")
    assert leanest.choice and leanest.status == "Optimal"


def test_predicted_step_is_the_plans_step_to_the_last_bit(traced, graphs):
    """``solve`` compares its memory candidates by ``predicted_step_s`` instead of building each
    plan: it must be the plan's own ``step_time_s``, exactly, or a candidate could win on rounding."""
    from autopar.solver import plan_from_solution, predicted_step_s

    cluster = get_cluster("h100-80g")
    graph = graphs[True]
    solution = solve_ilp(ShardingILP(graph), 60, "auto")
    plan = plan_from_solution(traced, graph, solution, cluster, None)
    assert plan.predicted.step_time_s > 0
    assert predicted_step_s(graph, solution, cluster) == plan.predicted.step_time_s


def test_under_auto_the_budgeted_milp_is_a_bounded_second_opinion(traced, monkeypatch, caplog):
    """Where the Lagrangian plan's gap stays above ``SolveOptions.budget_gap``, ``solve(solver="auto")`` runs the
    MILP too, but only for a share of the time planning has taken so far, tracing included (at least
    ``_MIN_MILP_S``), not ``time_limit_s``: a binding budget must not cost 60 s more than the unbounded
    plan."""
    import time

    import autopar.solver.planners.sharding as solver_module
    from autopar.ir.options import PlanOptions
    from autopar.solver import solve
    from autopar.solver.search.solving import peak_memory

    cluster = get_cluster("h100-80g")
    graph = build_choice_graph(traced, (2, 2), cluster)
    unbounded = solve_ilp(ShardingILP(graph), 60)
    lean = graph.timeline.peak(graph.bytes_bound(largest=False))[0]
    budget = lean + 0.3 * (peak_memory(graph, unbounded).bytes - lean)
    limits = []
    real = solver_module.solve_within_budget

    def spy(ilp, budget, time_limit_s, solver):
        limits.append((time_limit_s, time.perf_counter()))
        return real(ilp, budget, time_limit_s, solver)

    monkeypatch.setattr(solver_module, "solve_within_budget", spy)
    options = PlanOptions.from_keywords(memory_budget=budget, time_limit_s=600.0, checkpointing=False)
    # budget_gap 0: every Lagrangian gap is "too large", so the MILP gives its second opinion
    options = options.replace(solve=dataclasses.replace(options.solve, budget_gap=0.0))
    share, least = solver_module._MILP_SHARE, solver_module._MIN_MILP_S
    for trace_s in (0.0, 100.0):  # a model whose tracing took 100 s gives its MILP 30 s
        start = time.perf_counter()
        with caplog.at_level("INFO", logger="autopar"):
            plan = solve(dataclasses.replace(traced, trace_s=trace_s), (2, 2), cluster, options)
        assert "the MILP looks for a better one for up to" in caplog.text, "a long wait says what it waits for"
        caplog.clear()
        assert plan.predicted.peak_memory_bytes <= budget * (1 + 1e-9)
        assert len(limits) == 1, "the MILP ran as a second opinion"
        limit, called = limits.pop()
        assert share * (trace_s + 1e-3) <= limit <= max(least, share * (trace_s + called - start)) + 1e-6 < 600.0


def test_tracing_records_how_long_it_took():
    """What sizes the second opinion above, whether the model is exported whole or built from
    two small exports (``trace.repeat``)."""
    from autopar.trace.repeat import trace_repeated

    model, batch = build_model("mlp", seed=0), example_batch("mlp", 8)
    assert trace(model, batch).trace_s > 0.0
    model, batch = build_model("llama", seed=0, n_layer=6), example_batch("llama", 2)
    assert trace_repeated(model, batch).trace_s > 0.0  # built from exports of 2 and 3 layers


def test_a_plan_needing_a_resharding_into_partial_is_no_memory_candidate():
    """The Lagrangian plans on the way to a budget are kept before their rows are checked: one
    that takes an input as Partial from a producer that is not Partial is no plan at all (on 3+
    axes ``edge.price`` raised a KeyError for it in the 4-axis benchmark)."""
    from autopar.solver.planners.sharding import _fixed_solution

    model, batch = build_model("mlp", seed=0), example_batch("mlp", 8)
    graph = build_choice_graph(trace(model, batch), (2, 2), get_cluster("cpu"))
    ilp = ShardingILP(graph)
    solved = solve_ilp(ilp, 60, "highs")
    assert _fixed_solution(ilp, solved.choice, solved) is not None
    broken = None
    for edge in graph.edges:
        src = graph.choices[edge.producer].strategies[solved.choice[edge.producer]].outs[edge.out_index]
        for s, strategy in enumerate(graph.choices[edge.consumer].strategies):
            dst = strategy.ins[edge.in_index]
            if src != dst and (src, dst) not in edge.price:
                broken = {**solved.choice, edge.consumer: s}
                break
        if broken:
            break
    assert broken is not None, "the mlp on (2, 2) has a strategy whose input cannot be resharded to"
    assert _fixed_solution(ilp, broken, solved) is None
