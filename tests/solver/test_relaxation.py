"""The LP relaxation kept as one HiGHS model (``solver.search.relaxation``) and the dive that uses it
(``solver.search.budget._dive``), against fresh solves.

The tiny LLaMA of ``test_solving`` on a (2, 2) mesh, layers tied, at a budget between its leanest
and its fastest plan, so that the memory rows bind.
"""

from __future__ import annotations

import pulp
import pytest

from autopar.cost.cluster import get_cluster
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.fits import fits
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search import backends, budget, rounding, solving
from autopar.solver.search.relaxation import Relaxation
from autopar.trace import trace
from tests.conftest import meta_llama_and_batch

pytestmark = pytest.mark.skipif(not backends.highs_available(), reason="the kept model is HiGHS's")
highspy = pytest.importorskip("highspy") if backends.highs_available() else None


@pytest.fixture(scope="module")
def graph():
    model, batch = meta_llama_and_batch(3)
    return build_choice_graph(trace(model, batch), (2, 2), get_cluster("h100-80g"))


@pytest.fixture(scope="module")
def unbounded(graph):
    return solving.solve_ilp(ShardingILP(graph), 60)


@pytest.fixture(scope="module")
def tight(graph, unbounded):
    """A budget 30% of the way from the leanest plan's peak to the fastest plan's."""
    lean = graph.timeline.peak(graph.bytes_bound(largest=False))[0]
    return lean + 0.3 * (solving.peak_memory(graph, unbounded).bytes - lean)


def _fresh(ilp: ShardingILP) -> tuple[str, float | None, dict]:
    """The same LP solved by PuLP's HiGHS, which builds the model from nothing."""
    status = solving._run(ilp, backends.make("highs", 60, mip=False))
    value = pulp.value(ilp.problem.objective) if status == "Optimal" else None
    return status, value, {var.name: var.varValue for var in ilp.problem.variables()}


def _kept(ilp: ShardingILP) -> tuple[str, float | None]:
    status = solving.solve_relaxation(ilp, 60)
    return status, pulp.value(ilp.problem.objective) if status == "Optimal" else None


def _model(relaxation: Relaxation) -> dict:
    """What HiGHS holds: costs, bounds, and the matrix as {(row, column): value} (HiGHS keeps it
    by rows or by columns, depending on what it did last)."""
    lp = relaxation.highs.getLp()
    matrix = lp.a_matrix_
    by_rows = matrix.format_ == highspy.MatrixFormat.kRowwise
    start, index, value = list(matrix.start_), list(matrix.index_), list(matrix.value_)  # each read copies
    entries = {}
    for outer in range(len(start) - 1):
        for k in range(start[outer], start[outer + 1]):
            entries[(outer, index[k]) if by_rows else (index[k], outer)] = value[k]
    return {
        "cost": list(lp.col_cost_),
        "col_lower": list(lp.col_lower_),
        "col_upper": list(lp.col_upper_),
        "row_lower": list(lp.row_lower_),
        "row_upper": list(lp.row_upper_),
        "matrix": entries,
    }


def test_the_kept_model_follows_every_change_of_the_problem(graph, unbounded, tight):
    """Rows added, a row's bound lifted, the objective priced with memory (and a coefficient of it
    changed in place), strategies fixed and freed again: after each, the kept model holds what a
    model built afresh from the problem holds (it passes only what changed), and its LP optimum
    equals PuLP's fresh model's."""
    ilp = ShardingILP(graph)
    steps = []

    def both(what: str) -> None:
        kept = _kept(ilp)
        rebuilt = Relaxation(ilp)
        rebuilt._sync()
        assert _model(ilp.relaxation) == _model(rebuilt), what
        fresh = _fresh(ilp)[:2]
        steps.append(what)
        assert kept[0] == fresh[0], what
        if kept[1] is not None:
            assert kept[1] == pytest.approx(fresh[1], rel=1e-7, abs=1e-12), what

    both("no budget")
    first = ilp.relaxation
    ilp.add_memory_constraint(tight)
    ilp.add_memory_constraint_at(solving.peak_memory(graph, unbounded).time, tight)
    both("memory rows")
    assert ilp.relaxation is first, "rows are added to the model, not rebuilt"
    names = [ilp.memory_constraint_name(t) for t in sorted(ilp.memory_times)]
    objective = ilp.problem.objective
    penalty = pulp.LpAffineExpression({var: 1e-3 * coef for name in names for var, coef in ilp.problem.constraints[name].items()})
    saved = {name: ilp.problem.constraints[name].constant for name in names}
    for name in names:
        ilp.problem.constraints[name].constant = -1e30
    solving._set_objective(ilp, objective + penalty)
    both("rows priced, not enforced")
    priced = ilp.problem.objective
    var, coef = next(iter(priced.items()))
    priced[var] = 3 * coef  # the same expression, one coefficient changed
    both("a coefficient changed in place")
    priced[var] = coef
    for name in names:
        ilp.problem.constraints[name].constant = saved[name]
    solving._set_objective(ilp, objective)
    both("rows enforced again")
    enforced = _fresh(ilp)[1]
    for name in rounding.deciding_nodes(graph):  # a fixing that moves the optimum
        bounds = [(var.lowBound, var.upBound) for var in ilp.x[name]]
        least = min(range(len(bounds)), key=lambda s: ilp.x[name][s].varValue)
        for s, var in enumerate(ilp.x[name]):
            var.lowBound = var.upBound = 1.0 if s == least else 0.0
        if _fresh(ilp)[1] is not None and _fresh(ilp)[1] > enforced * (1 + 1e-6):
            break
        for var, (low, up) in zip(ilp.x[name], bounds):
            var.lowBound, var.upBound = low, up
    else:
        pytest.fail("no single fixing moves the LP optimum")
    both("a strategy fixed")
    for var, (low, up) in zip(ilp.x[name], bounds):
        var.lowBound, var.upBound = low, up
    both("freed")
    assert ilp.relaxation is first
    assert len(steps) == 7


def _priced_pair(graph, unbounded, tight) -> tuple[ShardingILP, ShardingILP, list, list[str], dict]:
    """Two kept models of the same budgeted ILP, solved once: (fast, slow, the costs HiGHS held
    then, the memory rows' names, their constants), with those rows priced, not enforced (their
    constants out of reach) until the caller puts the constants back."""
    ilps = [ShardingILP(graph, tight) for _ in range(2)]
    for ilp in ilps:
        ilp.add_memory_constraint_at(solving.peak_memory(graph, unbounded).time, tight)
        assert solving.solve_relaxation(ilp, 60) == "Optimal"
    plain = _model(ilps[0].relaxation)["cost"]
    names = [ilps[0].memory_constraint_name(t) for t in sorted(ilps[0].memory_times)]
    saved = {name: ilps[0].problem.constraints[name].constant for name in names}
    for ilp in ilps:
        for name in names:
            ilp.problem.constraints[name].constant = -1e30
    return ilps[0], ilps[1], plain, names, saved


def _price_in_pulp(ilp: ShardingILP, priced: list[tuple[str, float]]) -> None:
    """Set ``ilp``'s objective to objective + Σ price · row, built in PuLP."""
    terms: dict = {}
    for name, price in priced:
        for var, coef in ilp.problem.constraints[name].items():
            terms[var] = terms.get(var, 0.0) + price * coef
    solving._set_objective(ilp, ilp.problem.objective + pulp.LpAffineExpression(terms))


def test_a_priced_solve_is_the_solve_of_the_priced_expression(graph, unbounded, tight):
    """``solve_relaxation(priced=...)``, a Lagrangian step, against the same step with the
    objective + Σ price · row built in PuLP, from the same kept model: HiGHS holds the same costs
    bit for bit, so the solve ends at the same LP solution, value for value; the next plain
    solve holds the problem's own objective again."""
    fast, slow, plain, names, saved = _priced_pair(graph, unbounded, tight)
    assert len(names) > 1, "prices add up over several rows"
    priced = [(name, 1e-3 * (i + 1)) for i, name in enumerate(names)]
    assert solving.solve_relaxation(fast, 60, priced=priced) == "Optimal"
    _price_in_pulp(slow, priced)
    assert solving.solve_relaxation(slow, 60) == "Optimal"
    assert _model(fast.relaxation)["cost"] == _model(slow.relaxation)["cost"] != plain
    assert [var.varValue for var in fast.relaxation.columns] == [var.varValue for var in slow.relaxation.columns]
    assert fast.problem.objective is not slow.problem.objective, "the problem's own objective is untouched"
    for name in names:
        fast.problem.constraints[name].constant = saved[name]
    assert solving.solve_relaxation(fast, 60) == "Optimal"
    assert _model(fast.relaxation)["cost"] == plain


def test_a_priced_solve_without_edge_values_sets_the_same_x_and_leaves_the_edges(graph, unbounded, tight):
    """``edge_values=False`` (a Lagrangian step, ``budget._lagrangian_fits``): the same solve, so
    every watched variable (the x among them) gets the value a full solve gives it, and the edge
    and hub variables keep the ones they had."""
    fast, slow, _, names, saved = _priced_pair(graph, unbounded, tight)
    priced = [(name, 1e-3 * (i + 1)) for i, name in enumerate(names)]
    watched = {id(var) for var in fast.relaxation.watched}
    edges = [var for var in fast.relaxation.variables if id(var) not in watched]
    assert edges and all(var.name.startswith(("y_", "h_")) for var in edges)
    for var in edges:
        var.varValue = -1.0  # no value an LP solve gives
    assert solving.solve_relaxation(fast, 60, priced=priced, edge_values=False) == "Optimal"
    assert solving.solve_relaxation(slow, 60, priced=priced) == "Optimal"
    assert all(var.varValue == -1.0 for var in edges), "the edge variables keep their values"
    values = {var.name: var.varValue for var in slow.relaxation.watched}
    assert {var.name: var.varValue for var in fast.relaxation.watched} == values
    x = [var.name for name in rounding.deciding_nodes(graph) for var in fast.x[name]]
    assert x and set(x) <= set(values), "the x are watched"
    assert rounding.round_relaxation(fast) == rounding.round_relaxation(slow)
    for ilp in (fast, slow):
        for name in names:
            ilp.problem.constraints[name].constant = saved[name]


def test_lagrangian_steps_in_a_row_pass_each_steps_costs_once(graph, unbounded, tight):
    """Two Lagrangian steps back to back (``budget.trace_front``), the second at other prices: the
    second passes HiGHS its priced costs once (not the problem's objective first), and they are
    the costs of the objective + Σ price · row built in PuLP, so the solve ends at the same LP
    optimum (from another basis: maybe at another of its solutions); a plain solve after them
    holds the problem's own objective again."""
    fast, slow, plain, names, saved = _priced_pair(graph, unbounded, tight)
    first = [(name, 1e-3 * (i + 1)) for i, name in enumerate(names)]
    second = [(name, 4e-3 * (len(names) - i)) for i, name in enumerate(names)]
    assert solving.solve_relaxation(fast, 60, priced=first) == "Optimal"
    passed = []
    pass_costs = fast.relaxation._pass_costs
    fast.relaxation._pass_costs = lambda costs: passed.append(costs) or pass_costs(costs)
    assert solving.solve_relaxation(fast, 60, priced=second) == "Optimal"
    del fast.relaxation._pass_costs
    assert len(passed) == 1, "the second step's costs are passed once"
    _price_in_pulp(slow, second)
    assert solving.solve_relaxation(slow, 60) == "Optimal"
    assert _model(fast.relaxation)["cost"] == _model(slow.relaxation)["cost"] != plain
    optimum = slow.relaxation.highs.getObjectiveValue()
    assert fast.relaxation.highs.getObjectiveValue() == pytest.approx(optimum, rel=1e-9)
    for name in names:
        fast.problem.constraints[name].constant = saved[name]
    assert solving.solve_relaxation(fast, 60) == "Optimal"
    assert _model(fast.relaxation)["cost"] == plain


def test_the_first_solve_is_the_one_pulp_runs(graph):
    """Same columns, rows and options as PuLP's HiGHS: the same LP solution, value for value, so
    the unbounded plan (one LP and its rounding) does not move."""
    kept, fresh = ShardingILP(graph), ShardingILP(graph)
    assert _kept(kept)[0] == "Optimal"
    values = {var.name: var.varValue for var in kept.problem.variables()}
    assert _fresh(fresh)[2] == values
    assert rounding.round_relaxation(kept) == rounding.round_relaxation(fresh)


def test_a_stalled_solve_goes_on_with_cost_perturbation(graph, monkeypatch):
    """Past ``backends.stall_iterations`` the solve goes on from where it stopped, with the
    perturbation, to the optimum of an uncapped solve, and the model keeps the perturbation."""
    reference = ShardingILP(graph)
    assert _kept(reference)[0] == "Optimal" and not reference.relaxation.perturbed
    monkeypatch.setattr(backends, "stall_iterations", lambda num_rows: 5)
    capped = ShardingILP(graph)
    status, value = _kept(capped)
    assert status == "Optimal" and capped.relaxation.perturbed
    assert capped.relaxation.highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    assert value == pytest.approx(_kept(reference)[1], rel=1e-9)
    for option, setting in backends.PERTURBED.items():
        held = capped.relaxation.highs.getOptionValue(option)  # (status, value) in some highspy versions
        assert (held[-1] if isinstance(held, tuple) else held) == setting


def test_the_dive_finds_plans_that_fit_and_leaves_no_fixing_behind(graph, unbounded, tight):
    """Every plan the dive keeps fits the budget and meets every row; none beats the MILP's
    optimum; the strategies it fixed are free again after it."""
    ilp = ShardingILP(graph, tight)
    solving.solve_relaxation(ilp, 60)
    bound = pulp.value(ilp.problem.objective)
    bounds = {var.name: (var.lowBound, var.upBound) for var in ilp.problem.variables()}
    kept = []

    def consider(choice, method):
        peak, at = graph.timeline.peak(graph.bytes_of(choice))
        if not fits(peak, tight):
            ilp.add_memory_constraint_at(at, tight)
            return False
        value = rounding.check(ilp, choice)
        if value is not None:
            kept.append((value, choice))
        return value is not None

    budget._dive(ilp, consider, float("inf"))
    assert kept, "the dive ends at a plan that fits"
    assert {var.name: (var.lowBound, var.upBound) for var in ilp.problem.variables()} == bounds
    exact, fitting = solving.solve_within_budget(ShardingILP(graph, tight), tight, 120, "highs")
    assert fitting and exact.choice
    for value, choice in kept:
        assert fits(graph.timeline.peak(graph.bytes_of(choice))[0], tight)
        assert value >= exact.objective_s * (1 - 2 * backends.MIP_REL_GAP) >= bound * (1 - 1e-9)


def test_the_kept_variable_list_follows_new_rows_and_objectives(graph):
    """``ShardingILP.variables`` (``problem.variables()`` kept between rows): a row with a new
    variable, an objective with another, a peak-memory objective: each is seen at once."""
    ilp = ShardingILP(graph)

    def ids(variables) -> list[int]:
        return [id(var) for var in variables]

    assert ids(ilp.variables()) == ids(ilp.problem.variables())
    assert ilp.variables() is ilp.variables(), "kept while nothing changes"
    extra = pulp.LpVariable("extra_row_variable", lowBound=0)
    ilp.problem += extra <= 1, "extra_row"
    assert extra.name in {var.name for var in ilp.variables()}
    other = pulp.LpVariable("extra_objective_variable", lowBound=0)
    solving._set_objective(ilp, ilp.problem.objective + other)
    assert other.name in {var.name for var in ilp.variables()}
    assert ids(ilp.variables()) == ids(ilp.problem.variables())
    ilp.minimize_peak_memory(graph.timeline.checkpoints([graph.bytes_bound(largest=False)]))
    assert "peak_memory_bytes" in {var.name for var in ilp.variables()}
    assert ids(ilp.variables()) == ids(ilp.problem.variables())


def test_the_kept_model_watches_every_bound_but_the_edge_variables(graph, tight):
    """``_sync_column_bounds`` compares the bounds of all variables but the edge (and hub) ones,
    which no caller moves: every strategy's x, which the dive and ``rounding`` fix, is watched;
    after a budgeted solve (``solve_under_budget``) every unwatched variable is still [0, 1]."""
    ilp = ShardingILP(graph)
    solved = budget.solve_under_budget(ilp, tight, 60)
    assert solved.choice
    relaxation = ilp.relaxation
    watched = set(map(id, relaxation.watched))
    strategies = [x for xs in ilp.x.values() for x in xs if isinstance(x, pulp.LpVariable)]
    assert strategies and all(id(x) in watched for x in strategies)
    unwatched = [var for var in relaxation.variables if id(var) not in watched]
    assert unwatched, "the edge variables are the most numerous: none watched"
    assert all(var.name.startswith(("y_", "h_")) and (var.lowBound, var.upBound) == (0, 1) for var in unwatched)
