r"""Fast solves under a binding memory budget: Lagrangian relaxation of the memory rows.

With no memory rows the sharding LP is tight (``ilp.py``): one LP solve and a rounding give the
optimum. The memory rows ``memory[t]: M_t · x ≤ B`` break that, and branch and bound on them can
take minutes. Instead:

1. Solve the LP relaxation *with* the memory rows (at the checkpoint times and the unbounded
   plan's peak). Its value is a lower bound on the budgeted optimum, and its row duals
   ``λ_t ≥ 0`` are the prices of a byte at each time t.
2. Round that LP's solution; keep it if its whole liveness curve fits (a *candidate*).
3. Lagrangian step: drop the rows and minimise ``time + Σ_t λ_t · M_t · x``. Without rows the LP
   is tight again, so rounding gives an integer plan that minimises time plus priced memory. If
   its curve does not fit, the prices rise (× ``_GROWTH``, and the time of its new peak joins
   the priced rows) until it fits; then a few bisection steps between the last price that did
   not fit and the first that did recover time, unless the best plan is within ``_CLOSE`` (2%)
   of the bound already.
4. If the best candidate is still more than ``MILP_GAP`` from the bound, dive (``_dive``): fix
   the strategy the LP with memory rows weighs most among those it splits, solve again, round,
   until the LP splits nothing. Repeated layers share variables, so a Lagrangian plan switches
   a strategy in every layer at once and can land far under the budget; the dive stays close
   to the LP.
5. The fastest candidate wins. ``gap = (time − bound) / time`` is reported with it.

Every step is an LP solve of one HiGHS model kept from solve to solve (``solver.search.relaxation``: a
few tenths of a second for the LLaMA-70B ILP, whose size does not grow with depth); the MILP
runs only when the caller allows it and the gap stays above ``MILP_GAP``.
"""

from __future__ import annotations

import logging
import time as _time
from collections.abc import Callable

import pulp

from autopar.solver.problem.fits import fits
from autopar.solver.problem.ilp import MEMORY_UNIT, ShardingILP, Solution
from autopar.solver.search import backends, rounding
from autopar.solver.search.relaxation import lp_scale
from autopar.solver.search.solving import MAX_MEMORY_ROUNDS, empty_solution, solution_of, solve_relaxation

log = logging.getLogger("autopar")

# Price multiplier per round while a Lagrangian plan does not fit, rounds at most, and
# bisection steps once one fits: three put the price within 4^(1/8) = 1.19x of where the plan
# stops fitting. (Six found no faster plan on the eight budgeted LLaMAs of the benchmarks, HF
# and zoo, 8 to 80 layers, and each step is an LP solve, a rounding and a liveness walk.)
_GROWTH = 4.0
_MAX_GROWTH_ROUNDS = 12
_BISECTIONS = 3
# A strategy's LP value strictly between this and 1 - this splits its node (``_dive``).
_SPLIT = 1e-6
# Bisection stops once the best plan is this close to the LP bound: a lower price can win back
# less than that, and the plans are compared by their predicted step in the end, which the ILP
# objective tracks less closely (on HF LLaMA-2-70B at 48 layers the bisection's plans were 0.5%
# better by the objective and 1.2% worse by the step than the first that fitted, 1.4% from the
# bound). Each step is an LP solve, a rounding and a liveness walk.
_CLOSE = 0.02
# A gap below this is good enough: the MILP is not run. (On LLaMA-70B (128, 8) the Lagrangian
# plan was 0.8% from the MILP's optimum with a 1% gap to the LP bound; at 3.4% the MILP found
# nothing better within 60 s.)
MILP_GAP = 0.05
# Where no plan fits alone, the Lagrangian front stops at a plan this close to the least peak
# (``trace_front``).
_FLOOR_CLOSE = 0.01
# ... and its prices rise by ``_GROWTH`` squared while a plan has moved less than this share of
# the way from the fastest plan's peak to the least peak.
_SLOW_MOVE = 0.1


def solve_under_budget(
    ilp: ShardingILP,
    budget: float,
    time_limit_s: float,
    unbounded: Solution | None = None,
    visited: list[dict[str, int]] | None = None,
) -> Solution:
    """Solve ``ilp`` (built with its budget) by the steps of the module docstring.

    ``unbounded`` is the solution without memory rows, when the caller has one: its peak time
    joins the rows. Returns a Solution with ``method="lagrangian"`` or ``"lp-rounding"``, or an
    empty one (status "Infeasible") when no candidate fits. ``visited`` collects every rounded
    plan tried, fitting or not, from the fastest to the leanest: points of the time-memory
    front that checkpointing can bring under the budget (``solver.solve`` tries them)."""
    start = _time.perf_counter()
    deadline = start + time_limit_s
    graph = ilp.graph
    if unbounded is not None and unbounded.choice:
        ilp.add_memory_constraint_at(graph.peak(unbounded.choice)[1], budget)
    backend = backends.lp_backend()
    # 1. The LP with memory rows: a bound, and the prices of memory. From the unbounded LP's
    # basis (the rows are new; dual simplex): where the LP has several optima, one near the
    # fastest plan. From no basis it landed elsewhere on the same face: the same bound, and on
    # HF LLaMA-2-70B (48 layers; 16 layers at 30 GiB) final plans 3% and 8% slower by their
    # predicted step (equal on six other budgeted LLaMAs). And it cost as long as the first LP.
    solve_relaxation(ilp, _left(deadline))
    relaxed_fits = ilp.problem.status == pulp.LpStatusOptimal
    if not relaxed_fits and visited is None:
        return empty_solution(ilp, "Infeasible", backend, start)
    bound = float(pulp.value(ilp.problem.objective) or 0.0) if relaxed_fits else None
    scale = lp_scale(ilp)  # the scale of the LP's duals, held y included (``solver.problem.columns``)
    prices = {t: abs(_dual(ilp, t)) / scale if relaxed_fits else 0.0 for t in ilp.memory_times}
    consider = _Candidates(ilp, budget, prices, visited)
    # 2. Round the LP itself. (Where even the LP does not fit, only the Lagrangian plans are
    # collected, for the caller to add checkpointing to.)
    if relaxed_fits:
        consider(rounding.round_relaxation(ilp), "lp-rounding")
    # 3. Lagrangian plans at rising, then bisected, prices.
    if not any(consider.prices.values()):  # the rows were slack in the LP: price at the time/memory ratio
        best = consider.best
        reference = best[0] if best else bound if bound else (unbounded.objective_s if unbounded else 1.0)
        consider.prices = dict.fromkeys(consider.prices, reference / (budget / MEMORY_UNIT) / max(len(consider.prices), 1))
    _lagrangian_search(ilp, consider, relaxed_fits, bound, deadline)
    if not relaxed_fits:  # even the LP relaxation does not fit: no MILP will (``solve`` skips it)
        return empty_solution(ilp, "Infeasible", backend, start)
    # 4. Still far from the bound: dive.
    if consider.best is None or rounding_gap(consider.best[0], bound) > MILP_GAP:
        _dive(ilp, consider, deadline)
    best = consider.best
    if best is None:
        return empty_solution(ilp, "Infeasible (no rounded plan fits)", backend, start)
    status = "Optimal" if rounding_gap(best[0], bound) <= 1e-9 else "Feasible (lagrangian)"
    log.info(
        "autopar: budgeted solve: %s, %s, %.6f s (bound %.6f), gap %.2f%% in %.2f s",
        status,
        best[2],
        best[0],
        bound,
        100 * rounding_gap(best[0], bound),
        _time.perf_counter() - start,
    )
    return solution_of(ilp, best, status, backend, bound, start)


def trace_front(
    ilp: ShardingILP,
    budget: float,
    time_limit_s: float,
    unbounded: Solution,
    visited: list[dict[str, int]],
    floor: float,
    stop: Callable[[dict[str, int]], bool] | None = None,
) -> None:
    """Step 3 alone, where no sharding fits the budget by itself (``lean.least_peak`` is over it,
    so the LP with memory rows of step 1 is infeasible: it only took a long simplex to say so).
    The Lagrangian plans at prices from the time/memory ratio, rising, as ``solve_under_budget``
    prices them when its LP does not fit, go to ``visited``: the plans on the way from the
    fastest to the leanest, which the caller brings under the budget with checkpointing and
    offload. ``ilp`` holds its memory rows (``add_memory_constraint``) and ``unbounded``'s solve;
    ``floor`` is the least peak of any plan (``lean.least_peak``). ``stop``, called with each new
    plan, ends the front where it says True: where later plans, no faster, could beat one already
    found with its memory decisions by ``budget_gap`` at most (``planners.sharding._front_stop``)."""
    deadline = _time.perf_counter() + time_limit_s
    graph = ilp.graph
    ilp.add_memory_constraint_at(graph.peak(unbounded.choice)[1], budget)
    consider = _Candidates(ilp, budget, {}, visited)
    price = unbounded.objective_s / (budget / MEMORY_UNIT) / max(len(ilp.memory_times), 1)
    consider.prices = dict.fromkeys(ilp.memory_times, price)
    # No plan fits, so the prices only rise (no bisection); a plan within ``_FLOOR_CLOSE`` of
    # ``floor`` ends the front: the leanest plan is a candidate of the caller's already, and the
    # next prices only creep towards it (tiny GPT-OSS: 0.7%, 0.2%, 0.04% over it, 0.2 s each).
    # A price under which the plan stays near the fastest one's peak rises twice as fast: the
    # rounds that matter lie between the two ends.
    top = graph.peak(unbounded.choice)[0]
    factor = 1.0
    for _ in range(_MAX_GROWTH_ROUNDS // 2):
        if _time.perf_counter() > deadline:
            break
        seen = len(visited)
        _lagrangian_fits(ilp, consider.prices, factor, consider, _left(deadline))
        if stop is not None and len(visited) > seen and stop(visited[-1]):
            break
        peak = graph.peak(visited[-1])[0] if visited else top
        if peak <= floor * (1 + _FLOOR_CLOSE):
            break
        factor *= _GROWTH**2 if top - peak < _SLOW_MOVE * (top - floor) else _GROWTH


def _left(deadline: float) -> float:
    """Seconds left before ``deadline``, at least one."""
    return max(deadline - _time.perf_counter(), 1.0)


class _Candidates:
    """The rounded plans ``solve_under_budget`` considers. Calling it with a plan (strategy
    index by node) says whether the plan fits the budget and meets every row; one over the
    budget adds the memory row at its peak (priced 0 in ``prices``). ``best``: the fastest
    plan that fits, as (objective, choice, method)."""

    def __init__(self, ilp: ShardingILP, budget: float, prices: dict[int, float], visited: list[dict[str, int]] | None):
        self.ilp, self.budget, self.prices, self.visited = ilp, budget, prices, visited
        self.best: tuple[float, dict[str, int], str] | None = None
        # Each plan considered, by its strategies in graph order: whether it fitted. Several prices
        # (and dive steps) round to one plan; its walk, its check and its row are the same again.
        self.seen: dict[tuple[int, ...], bool] = {}

    def __call__(self, choice: dict[str, int] | None, method: str) -> bool:
        if choice is None:
            return False
        graph = self.ilp.graph
        key = tuple(choice[name] for name in graph.order)
        if key in self.seen:
            return self.seen[key]
        if self.visited is not None:
            self.visited.append(choice)
        peak, at = graph.peak(choice)
        if not fits(peak, self.budget):
            self.ilp.add_memory_constraint_at(at, self.budget)
            self.prices.setdefault(at, 0.0)
            self.seen[key] = False
            return False
        value = rounding.check(self.ilp, choice)
        self.seen[key] = value is not None
        if value is None:
            return False
        if self.best is None or value < self.best[0]:
            self.best = (value, choice, method)
        return True


def _lagrangian_search(ilp: ShardingILP, consider: _Candidates, relaxed_fits: bool, bound: float | None, deadline: float) -> None:
    """Step 3: Lagrangian plans at prices ``consider.prices`` times a factor that rises until a
    plan fits, then is bisected towards the least that fits (while the best plan is not close
    to ``bound``)."""
    low, high = 0.0, None
    factor = 1.0
    for _ in range(_MAX_GROWTH_ROUNDS if relaxed_fits else _MAX_GROWTH_ROUNDS // 2):
        if _time.perf_counter() > deadline:
            break
        if _lagrangian_fits(ilp, consider.prices, factor, consider, _left(deadline)):
            high = factor
            break
        low, factor = factor, factor * _GROWTH
    if high is None:
        return
    for _ in range(_BISECTIONS):
        if _time.perf_counter() > deadline or low <= 0 and high <= 1.0:
            break
        if relaxed_fits and consider.best is not None and rounding_gap(consider.best[0], bound) <= _CLOSE:
            break  # close enough to the bound
        middle = (low * high) ** 0.5 if low > 0 else high / _GROWTH
        if _lagrangian_fits(ilp, consider.prices, middle, consider, _left(deadline)):
            high = middle
        else:
            low = middle


def rounding_gap(objective: float, bound: float) -> float:
    return 0.0 if objective <= 0 else max(0.0, (objective - bound) / objective)


def _lagrangian_fits(ilp, prices, factor, consider, limit) -> bool:
    names = {t: ilp.memory_constraint_name(t) for t in prices}
    rows = {t: ilp.rows_by_name()[name] for t, name in names.items()}
    saved = {t: rows[t].constant for t in rows}
    try:
        for row in rows.values():  # the rows are priced, not enforced
            row.constant = -1e30
        # Only the x are rounded; ``consider`` (``rounding.check``) sets every variable it reads.
        priced = [(names[t], factor * price) for t, price in prices.items() if price > 0]
        solve_relaxation(ilp, limit, priced=priced, edge_values=False)
        if ilp.problem.status != pulp.LpStatusOptimal:
            return False
        choice = rounding.round_relaxation(ilp)
    finally:
        for t, row in rows.items():
            row.constant = saved[t]
    return consider(choice, "lagrangian")


def _dive(ilp: ShardingILP, consider, deadline: float) -> None:
    """LP diving: fix the strategy that the LP with memory rows weighs most among those it
    splits, solve it again and round, until the LP splits none (its plan is then the best under
    those fixings), no longer has a solution, or time is up. Each rounded plan goes to
    ``consider``, which adds a memory row where one overshoots.

    Why: repeated layers share their variables, so a Lagrangian plan switches a strategy in
    every layer at once, and the prices jump from a plan over the budget to one far under it
    (the zoo Llama at 48 layers: 76.5 GiB, then 18 GiB at 10% more time). The LP sits between
    the two; fixing its most decided choice first keeps the plan close to it, and each solve
    starts from the last basis (``solver.search.relaxation``)."""
    deciding = rounding.deciding_nodes(ilp.graph)
    fixed: list = []
    try:
        for _ in range(len(deciding) + MAX_MEMORY_ROUNDS):
            if _time.perf_counter() > deadline:
                break
            if solve_relaxation(ilp, max(deadline - _time.perf_counter(), 1.0)) != "Optimal":
                break  # the fixings leave no plan within the rows
            rows = len(ilp.memory_times)
            fits = consider(rounding.round_relaxation(ilp), "lp-diving")
            split = [
                (value, -i, s)
                for i, name in enumerate(deciding)
                for s, var in enumerate(ilp.x[name])
                if _SPLIT < (value := var.varValue or 0.0) < 1 - _SPLIT
            ]
            if not split:
                if fits or len(ilp.memory_times) == rows:
                    break  # the LP chose one plan: the best under these fixings
                continue  # its plan overshot where no row stood: solve again with that row
            _, index, chosen = max(split)
            for s, var in enumerate(ilp.x[deciding[-index]]):
                fixed.append((var, var.lowBound, var.upBound))
                var.lowBound = var.upBound = 1.0 if s == chosen else 0.0
    finally:
        for var, low, up in reversed(fixed):
            var.lowBound, var.upBound = low, up


def _dual(ilp: ShardingILP, t: int) -> float:
    pi = ilp.rows_by_name()[ilp.memory_constraint_name(t)].pi
    return float(pi or 0.0)
