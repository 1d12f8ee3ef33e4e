"""The LP relaxation of a ``ShardingILP`` as one HiGHS model, kept from one solve to the next.

A budgeted solve (``solver.budget``) solves the same LP many times with small changes: memory
rows added, their bounds lifted for a Lagrangian step, the objective priced with memory, a few
strategies fixed while diving. PuLP's HiGHS interface builds a fresh model for every solve,
column by column (about as long as the solve itself) and starts the simplex from nothing.
``Relaxation`` builds the model once, in bulk, from the PuLP problem, which stays the model of
record: before each solve it compares the problem with what HiGHS holds and passes only what
changed (new rows, row and column bounds, objective coefficients), so the simplex starts from the
last basis (dual simplex after a row or a bound is added, primal after the objective changes).

The first solve is the one PuLP would run: the same columns in the same order (PuLP's, by name),
the same rows, bounds, scaled objective and options, so the unbounded plan is unchanged. Rows'
coefficients are taken as fixed once a row is in the model (no caller changes them; a row whose
bounds change is updated). A new column (a variable no row had before) rebuilds the model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pulp

from autopar.solver import backends

if TYPE_CHECKING:
    from autopar.solver.ilp import ShardingILP


def objective_scale(objective: pulp.LpAffineExpression) -> float:
    """A power of ten that brings the largest objective coefficient near 1e3.

    Step times are seconds, and the prices of small ops are 1e-9 s or less: below the solvers'
    absolute tolerances (1e-6 to 1e-9), which then stop early or call a worse plan optimal.
    Memory objectives (``_infeasible``) are bytes, far above them."""
    largest = max((abs(coef) for coef in objective.values()), default=0.0)
    return 10.0 ** round(math.log10(1e3 / largest)) if largest > 0 else 1.0


class Relaxation:
    """The HiGHS model of ``ilp.problem``'s LP relaxation (module docstring)."""

    def __init__(self, ilp: "ShardingILP"):
        self.ilp = ilp
        self._build()

    def _build(self) -> None:
        import highspy  # an optional dependency (``backends.highs_available``)

        problem = self.ilp.problem
        self.inf = highspy.kHighsInf
        with backends.solver_output():  # the constructor prints HiGHS's banner
            self.highs = highspy.Highs()
            self.highs.setOptionValue("output_flag", backends.solver_log_enabled())
        # As ``backends.make`` configures PuLP's HiGHS (the gaps matter to MILPs only).
        self.highs.setOptionValue("mip_rel_gap", backends.MIP_REL_GAP)
        self.highs.setOptionValue("mip_abs_gap", 0.0)
        self.highs.setOptionValue("random_seed", 1)
        self.columns: list[pulp.LpVariable] = list(problem.variables())
        self.column_of = {var: i for i, var in enumerate(self.columns)}
        self.costs = np.zeros(len(self.columns))
        self.col_lower, self.col_upper = self._column_bounds()
        with backends.solver_output():
            self.highs.addCols(len(self.columns), self.costs, self.col_lower, self.col_upper, 0,
                               np.zeros(1, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
        self.rows: list[pulp.LpConstraint] = []
        self.row_names: list[str] = []
        self.row_lower = np.zeros(0)
        self.row_upper = np.zeros(0)
        self._add_new_rows()

    def _column_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        inf = self.inf
        lower = np.fromiter((-inf if v.lowBound is None else v.lowBound for v in self.columns), float, len(self.columns))
        upper = np.fromiter((inf if v.upBound is None else v.upBound for v in self.columns), float, len(self.columns))
        return lower, upper

    def _row_bounds(self, rows) -> tuple[np.ndarray, np.ndarray]:
        inf = self.inf
        lower = np.fromiter((-inf if (b := r.getLb()) is None else b for r in rows), float, len(rows))
        upper = np.fromiter((inf if (b := r.getUb()) is None else b for r in rows), float, len(rows))
        return lower, upper

    def _add_new_rows(self) -> bool:
        """Add the problem's rows HiGHS does not hold yet. False when one has a new variable."""
        constraints = self.ilp.problem._constraints  # as PuLP's own backends read it (the mapping warns)
        if len(constraints) == len(self.rows):
            return True
        names = list(constraints)[len(self.rows):]
        new = [constraints[name] for name in names]
        starts, indices, values = [], [], []
        for row in new:
            starts.append(len(indices))
            for var, coef in row.items():
                if coef != 0:
                    column = self.column_of.get(var)
                    if column is None:
                        return False
                    indices.append(column)
                    values.append(coef)
        lower, upper = self._row_bounds(new)
        with backends.solver_output():
            self.highs.addRows(len(new), lower, upper, len(indices), np.array(starts, dtype=np.int32),
                               np.array(indices, dtype=np.int32), np.array(values, dtype=float))
        self.rows += new
        self.row_names += names
        self.row_lower = np.concatenate([self.row_lower, lower])
        self.row_upper = np.concatenate([self.row_upper, upper])
        return True

    def _sync(self) -> float:
        """Pass HiGHS what changed in the problem since the last solve; the objective's scale."""
        problem = self.ilp.problem
        if list(problem._constraints)[:len(self.rows)] != self.row_names or not self._add_new_rows() or any(
                var not in self.column_of for var in problem.objective):
            self._build()  # a row removed, or a variable no row had: start over
        lower, upper = self._row_bounds(self.rows)
        changed = np.flatnonzero((lower != self.row_lower) | (upper != self.row_upper))
        if changed.size:
            self.highs.changeRowsBounds(changed.size, changed.astype(np.int32), lower[changed], upper[changed])
            self.row_lower, self.row_upper = lower, upper
        lower, upper = self._column_bounds()
        changed = np.flatnonzero((lower != self.col_lower) | (upper != self.col_upper))
        if changed.size:
            self.highs.changeColsBounds(changed.size, changed.astype(np.int32), lower[changed], upper[changed])
            self.col_lower, self.col_upper = lower, upper
        scale = objective_scale(problem.objective)
        costs = np.zeros(len(self.columns))
        for var, coef in problem.objective.items():
            costs[self.column_of[var]] = coef * scale
        changed = np.flatnonzero(costs != self.costs)
        if changed.size:
            self.highs.changeColsCost(changed.size, changed.astype(np.int32), costs[changed])
            self.costs = costs
        return scale

    def solve(self, time_limit_s: float, cold: bool = False) -> str:
        """Solve the LP as the problem stands; set its variables' values, its rows' duals
        (``pi``, of the scaled objective, as PuLP's HiGHS sets them) and its status, as
        ``problem.solve`` would. Returns the status's name. ``cold``: start from no basis, as
        a fresh model does (where the LP has several optima, a warm start may end at another
        one, whose rounding differs)."""
        problem = self.ilp.problem
        self._sync()
        if cold:
            self.highs.clearSolver()
        self.highs.setOptionValue("time_limit", float(time_limit_s))
        with backends.solver_output():
            self.highs.run()
        status, sol_status = _status(self.highs.getModelStatus(), self.highs.getObjectiveValue())
        solution = self.highs.getSolution()
        for var, value in zip(self.columns, solution.col_value):
            var.varValue = value
        for row, dual in zip(self.rows, solution.row_dual):
            row.pi = dual
        problem.assignStatus(status, sol_status)
        return pulp.LpStatus[status]


def _status(model_status, objective: float) -> tuple[int, int]:
    """(PuLP status, PuLP solution status) of a HiGHS model status, as PuLP's HiGHS reads it
    (a stopped solve counts as "Optimal" with an integer-feasible solution, unless it has none)."""
    import highspy  # an optional dependency (``backends.highs_available``)

    status = highspy.HighsModelStatus
    if model_status == status.kOptimal:
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
    if model_status in (status.kInfeasible, status.kUnboundedOrInfeasible):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    if model_status == status.kUnbounded:
        return pulp.LpStatusUnbounded, pulp.LpSolutionUnbounded
    stopped = (status.kTimeLimit, status.kIterationLimit)
    if model_status in stopped + (status.kObjectiveBound, status.kObjectiveTarget, status.kInterrupt):
        if model_status in stopped and objective == float("inf"):
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
    return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
