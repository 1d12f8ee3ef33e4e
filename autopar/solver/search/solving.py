"""Solving a built ``ShardingILP``: backends, time limits, the LP fast path and the fallbacks.

The steps, each within what is left of ``time_limit_s``:

1. ``solver="auto"``: solve the LP relaxation (HiGHS) and round it (``rounding``). If the
   rounded plan's cost meets the LP bound, it is optimal: done, ``method="lp-rounding"``.
2. Solve the MILP with the chosen backend (``backends``): ``method="milp"``, status
   ``Optimal`` or ``Feasible (time limit)``.
3. If the MILP failed or found nothing in time: the best of the rounded LP solution and greedy
   plans (``method="lp-rounding"`` or ``"greedy"``), status ``Feasible (fallback)``.

Every solution carries ``bound_s``, the best lower bound known (the LP relaxation's or the MILP
solver's), and ``gap = (objective_s - bound_s) / objective_s``, which the plan reports.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING, NamedTuple

import pulp

from autopar.solver.problem.fits import fits
from autopar.solver.problem.ilp import Solution
from autopar.solver.search import backends, rounding
from autopar.solver.search.relaxation import Relaxation, objective_scale

if TYPE_CHECKING:
    from autopar.solver.problem.choices import ChoiceGraph
    from autopar.solver.problem.ilp import ShardingILP

log = logging.getLogger("autopar")

# Relative gap under which a rounded LP solution counts as optimal (float noise in the sums).
OPTIMAL_GAP = 1e-9
# Seconds-per-byte weights for greedy plans, as multiples of (step seconds / total bytes).
_GREEDY_WEIGHTS = (1.0, 10.0, 100.0, 1e4, 1e6)


# Rounds of the memory cutting-plane loop (each adds one memory[t] row and solves again).
MAX_MEMORY_ROUNDS = 20


def chosen_bytes(graph: ChoiceGraph, solution: Solution):
    """Node name -> bytes of its chosen strategy."""
    return graph.bytes_of(solution.choice)


class Peak(NamedTuple):
    """The top of a solution's liveness curve."""

    bytes: float  # per device
    time: int  # on the timeline (``Timeline.time_name`` names it)


def peak_memory(graph: ChoiceGraph, solution: Solution) -> Peak:
    """The peak of a solution's liveness curve."""
    return Peak(*graph.peak(solution.choice))


def solve_within_budget(ilp: ShardingILP, budget: float | None, time_limit_s: float, solver: str) -> tuple[Solution, bool]:
    """Solve, then add the memory row at the time where the liveness walk overshoots ``budget``
    and solve again, up to ``MAX_MEMORY_ROUNDS`` times (the ILP bounds memory only at a handful
    of times). Returns the solution and whether it fits ``budget`` (True with no budget, or no
    solution). ``time_limit_s`` bounds all the rounds together."""
    graph = ilp.graph
    deadline = time.perf_counter() + time_limit_s
    solution = solve_ilp(ilp, time_limit_s, solver)
    for _ in range(MAX_MEMORY_ROUNDS):
        if not solution.choice or budget is None:
            return solution, True
        peak_bytes, peak_time = peak_memory(graph, solution)
        if fits(peak_bytes, budget):
            return solution, True
        if time.perf_counter() >= deadline:
            break
        log.debug("memory overshoot %.0f > %.0f at %s: adding that time", peak_bytes, budget, graph.timeline.time_name(peak_time))
        ilp.add_memory_constraint_at(peak_time, budget)
        solution = solve_ilp(ilp, max(deadline - time.perf_counter(), 1.0), solver)
    return solution, not solution.choice or fits(peak_memory(graph, solution).bytes, budget)


def solve_ilp(ilp: ShardingILP, time_limit_s: float = 60.0, solver: str = "auto") -> Solution:
    solver = backends.check_solver(solver)
    start = time.perf_counter()
    deadline = start + time_limit_s

    def left() -> float:
        return max(deadline - time.perf_counter(), 1.0)

    bound = None
    incumbent: tuple[float, dict[str, int], str] | None = None
    if solver == "auto":
        bound, incumbent = _relax_and_round(ilp, left())
        if incumbent is not None and bound is not None and _gap(incumbent[0], bound) <= OPTIMAL_GAP:
            return solution_of(ilp, incumbent, "Optimal", backends.lp_backend(), bound, start)
    backend = backends.mip_backend(solver)
    status = _run(ilp, backends.make(backend, left(), mip=True))
    if ilp.problem.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        choice = {name: _chosen(ilp, name) for name in ilp.graph.order}
        objective = float(pulp.value(ilp.problem.objective) or 0.0)
        optimal = ilp.problem.sol_status == pulp.LpSolutionOptimal
        mip_bound = backends.mip_bound(ilp.problem, backend)
        scale = objective_scale(ilp.problem.objective)
        if mip_bound is not None:
            bound = mip_bound / scale if bound is None else max(bound, mip_bound / scale)
        elif bound is None:  # CBC reports no bound through PuLP: take the LP relaxation's
            bound = _relaxation_bound(ilp, left())
            if optimal and bound is not None:  # and what its optimal status proves (it ran with gapRel)
                bound = max(bound, objective * (1.0 - backends.MIP_REL_GAP))
        if not optimal and incumbent is not None and incumbent[0] < objective:
            return solution_of(ilp, incumbent, "Feasible (time limit)", backend, bound, start)
        label = "Optimal" if optimal else "Feasible (time limit)"
        return solution_of(ilp, (objective, choice, "milp"), label, backend, bound, start)
    if status == "Infeasible":
        return empty_solution(ilp, "Infeasible", backend, start)
    # The MILP failed or ran out of time with nothing: fall back.
    if bound is None and incumbent is None:
        bound, incumbent = _relax_and_round(ilp, left())
    if bound is None:  # the relaxation itself failed: the problem is infeasible
        return empty_solution(ilp, "Infeasible", backend, start)
    for candidate in _greedy_plans(ilp):
        if incumbent is None or candidate[0] < incumbent[0]:
            incumbent = candidate
    if incumbent is None:
        return empty_solution(ilp, f"{status} (no fallback plan fits)", backend, start)
    return solution_of(ilp, incumbent, "Feasible (fallback)", backend, bound, start)


def solve_relaxation(
    ilp: ShardingILP, time_limit_s: float, priced: list[tuple[str, float]] | None = None, edge_values: bool = True
) -> str:
    """Solve the LP relaxation of ``ilp.problem`` as it stands, and return the status's name.

    With HiGHS, one model is kept on the ILP from solve to solve (``solver.search.relaxation``): only
    what changed is passed, and the simplex starts from the last basis. With CBC (no
    ``highspy``), PuLP builds the model afresh. ``priced``: (row name, price) pairs whose terms join the objective
    for this solve only (a Lagrangian step, ``solver.search.budget``). ``edge_values=False``: with
    HiGHS, the edge and hub variables may keep their last values (``Relaxation.solve``)."""
    if backends.lp_backend() != "highs":
        ilp.generate_all()  # before the objective is read (``solver.problem.columns``)
        objective = ilp.problem.objective
        if priced:
            rows = ilp.rows_by_name()
            terms: dict = {}
            for name, price in priced:
                for var, coef in rows[name].items():
                    terms[var] = terms.get(var, 0.0) + price * coef
            _set_objective(ilp, objective + pulp.LpAffineExpression(terms))
        try:
            return _run(ilp, backends.make(backends.lp_backend(), time_limit_s, mip=False))
        finally:
            if priced:
                _set_objective(ilp, objective)
    if ilp.relaxation is None:
        ilp.relaxation = Relaxation(ilp)
    return ilp.relaxation.solve(time_limit_s, priced, edge_values)


def _set_objective(ilp: ShardingILP, objective) -> None:
    with warnings.catch_warnings():  # PuLP 3.x deprecates setting the objective this way
        warnings.simplefilter("ignore", DeprecationWarning)
        ilp.problem.setObjective(objective)


def _relax_and_round(ilp: ShardingILP, time_limit_s: float):
    """(LP bound or None, (objective, choice, "lp-rounding") or None)."""
    solve_relaxation(ilp, time_limit_s)
    if ilp.problem.status != pulp.LpStatusOptimal:
        return None, None
    bound = float(pulp.value(ilp.problem.objective) or 0.0)
    choice = rounding.round_relaxation(ilp)
    value = rounding.check(ilp, choice) if choice is not None else None
    return bound, (None if value is None else (value, choice, "lp-rounding"))


def _relaxation_bound(ilp: ShardingILP, time_limit_s: float) -> float | None:
    solve_relaxation(ilp, time_limit_s)
    return float(pulp.value(ilp.problem.objective) or 0.0) if ilp.problem.status == pulp.LpStatusOptimal else None


def _greedy_plans(ilp: ShardingILP):
    """A greedy plan, at rising memory weights until one meets every constraint."""
    choice = rounding.greedy(ilp, 0.0)
    if choice is None:
        return
    value = rounding.check(ilp, choice)
    if value is not None:
        yield value, choice, "greedy"
        return
    seconds = sum(ilp.graph.choices[n].priced[s].compute_s for n, s in choice.items())
    total_bytes = sum(ilp.graph.choices[n].priced[s].memory_bytes for n, s in choice.items())
    if not total_bytes:
        return
    for weight in _GREEDY_WEIGHTS:
        choice = rounding.greedy(ilp, weight * seconds / total_bytes)
        value = rounding.check(ilp, choice) if choice is not None else None
        if value is not None:
            yield value, choice, "greedy"
            return


def _run(ilp: ShardingILP, solver: pulp.LpSolver) -> str:
    """Solve with the objective scaled (``objective_scale``); values are read unscaled after."""
    ilp.generate_all()  # PuLP's solvers see every y (``solver.problem.columns``)
    objective = ilp.problem.objective
    scale = objective_scale(objective)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ilp.problem.setObjective(
            pulp.LpAffineExpression(
                {var: coef * scale for var, coef in objective.items()},
                constant=objective.constant * scale,
            )
        )
        try:
            ilp.problem.solve(solver)
        except pulp.PulpSolverError as error:
            return f"Solver error ({error})"
        finally:
            ilp.problem.setObjective(objective)
    return pulp.LpStatus[ilp.problem.status]


def _chosen(ilp: ShardingILP, name: str) -> int:
    values = [pulp.value(x) or 0.0 for x in ilp.x[name]]
    best = max(range(len(values)), key=lambda i: values[i])
    assert values[best] > 0.5, f"no strategy selected for {name}: {values}"
    return best


def _gap(objective: float, bound: float) -> float:
    if objective <= 0:
        return 0.0
    return max(0.0, (objective - bound) / objective)


def edge_specs(graph: ChoiceGraph, choice: dict[str, int]) -> dict[int, tuple]:
    """Edge index → (its producer's output spec, its consumer's input spec) under ``choice``."""
    specs = {}
    choices = graph.choices
    for e, edge in enumerate(graph.edges):
        producer = choices[edge.producer].strategies[choice[edge.producer]]
        consumer = choices[edge.consumer].strategies[choice[edge.consumer]]
        specs[e] = (producer.outs[edge.out_index], consumer.ins[edge.in_index])
    return specs


def solution_of(
    ilp: ShardingILP, incumbent: tuple[float, dict[str, int], str], status: str, backend: str, bound: float | None, start: float
) -> Solution:
    """The Solution of ``incumbent`` (objective, choice, method), timed from ``start``."""
    objective, choice, method = incumbent
    return Solution(
        choice,
        edge_specs(ilp.graph, choice),
        status,
        objective,
        time.perf_counter() - start,
        *ilp.size(),
        method=method,
        backend=backend,
        bound_s=bound,
        gap=None if bound is None else _gap(objective, bound),
    )


def empty_solution(ilp: ShardingILP, status: str, backend: str, start: float) -> Solution:
    """A Solution with no plan (infeasible, or nothing found in time), timed from ``start``."""
    return Solution({}, {}, status, float("inf"), time.perf_counter() - start, *ilp.size(), backend=backend)
