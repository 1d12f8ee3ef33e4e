"""The LP relaxation of a ``ShardingILP`` as one HiGHS model, kept from one solve to the next.

A budgeted solve (``solver.search.budget``) solves the same LP many times with small changes: memory
rows added, their bounds lifted for a Lagrangian step, the objective priced with memory, a few
strategies fixed while diving. PuLP's HiGHS interface builds a fresh model for every solve,
column by column (about as long as the solve itself) and starts the simplex from nothing.
``Relaxation`` builds the model once, in bulk, from the PuLP problem, which stays the model of
record: before each solve it compares the problem with what HiGHS holds and passes only what
changed (new rows, row and column bounds, objective coefficients), so the simplex starts from the
last basis (dual simplex after a row or a bound is added, primal after the objective changes).

Finding what changed costs no more than a pass over each list at C speed: the kept model
remembers the bounds of every PuLP variable but the edge variables (which stay [0, 1], as a held
y's column does), every row's constant and sense, and the objective's variables (by identity) and
coefficients as Python lists, and compares them with the problem's; only a list that differs is
converted and passed on, and only its changed entries.

The first solve is the one PuLP would run: the same columns in the same order (PuLP's, by name),
the same rows, bounds, scaled objective and options, so the unbounded plan is unchanged. Rows'
coefficients are taken as fixed once a row is in the model (no caller changes them; a row whose
bounds change is updated). A new column (a variable no row had before) rebuilds the model.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import weakref
from operator import attrgetter, is_
from typing import TYPE_CHECKING

import numpy as np
import pulp

from autopar.solver.search import backends

if TYPE_CHECKING:
    from autopar.solver.problem.ilp import ShardingILP

log = logging.getLogger("autopar")


def objective_scale(objective: pulp.LpAffineExpression) -> float:
    """A power of ten that brings the largest objective coefficient near 1e3.

    Step times are seconds, and the prices of small ops are 1e-9 s or less: below the solvers'
    absolute tolerances (1e-6 to 1e-9), which then stop early or call a worse plan optimal.
    Memory objectives (``_infeasible``) are bytes, far above them."""
    return _scale_for(max((abs(coef) for coef in objective.values()), default=0.0))


def _scale_for(largest: float) -> float:
    return 10.0 ** round(math.log10(1e3 / largest)) if largest > 0 else 1.0


_LOW, _UP, _CONSTANT, _SENSE = (attrgetter(name) for name in ("lowBound", "upBound", "constant", "sense"))
# Names of the ILP's edge variables (y, ``ShardingILP.add_edge_constraints``; generated y too) and
# hub variables (h): built in [0, 1], and no caller moves their bounds.
_EDGE_PREFIXES = ("y_", "h_")


class Relaxation:
    """The HiGHS model of ``ilp.problem``'s LP relaxation (module docstring)."""

    def __init__(self, ilp: ShardingILP):
        # By a weak reference: the ILP keeps its relaxation (``ilp.relaxation``), and a cycle
        # between them would leave the whole problem (10^5 PuLP objects on a 3-axis mesh) to the
        # garbage collector's full passes, which planning holds off (``solver.planners.quiet_gc``): memory
        # grew from plan to plan in one process.
        self._ilp = weakref.ref(ilp)
        self._build()

    @property
    def ilp(self) -> ShardingILP:
        ilp = self._ilp()
        if ilp is None:
            raise AssertionError("Relaxation: its ILP is gone (a relaxation lives on its ILP); this is a bug in autopar")
        return ilp

    def _build(self) -> None:
        import highspy  # an optional dependency (``backends.highs_available``)

        self.inf = highspy.kHighsInf
        with backends.solver_output():  # the constructor prints HiGHS's banner
            self.highs = highspy.Highs()
            self.highs.setOptionValue("output_flag", backends.solver_log_enabled())
        # As ``backends.make`` configures PuLP's HiGHS (the gaps matter to MILPs only).
        self.highs.setOptionValue("mip_rel_gap", backends.MIP_REL_GAP)
        self.highs.setOptionValue("mip_abs_gap", 0.0)
        self.highs.setOptionValue("random_seed", 1)
        for option, value in backends.LP_OPTIONS.items():  # as PuLP's HiGHS gets them for an LP
            self.highs.setOptionValue(option, value)
        # The PuLP variables (``problem.variables()``, kept) and their columns, in column order;
        # the held y's columns have no variable (``_HELD``) and never change bounds.
        self.variables = list(self.ilp.variables())
        self.columns, self.variable_columns = self._held_in_order(self.variables)
        self._index: np.ndarray | None = None  # ``_variable_index``
        # By identity: pulp variables compare into constraints, not booleans.
        self.column_of = dict(zip(map(id, self.variables), self.variable_columns))
        self.costs = np.zeros(len(self.columns))
        lower, upper = np.full(len(self.columns), float(_Held.lowBound)), np.full(len(self.columns), float(_Held.upBound))
        lower[self.variable_columns] = self._bounds(list(map(_LOW, self.variables)), -self.inf)
        upper[self.variable_columns] = self._bounds(list(map(_UP, self.variables)), self.inf)
        # The variables whose bounds ``_sync_column_bounds`` compares, and their columns: all but
        # the edge and hub variables (``_EDGE_PREFIXES``), which stay [0, 1] (the dive and
        # ``rounding`` fix strategies, x). On a tiny GPT-OSS 4,700 of 114,000: reading every
        # variable's bounds before each Lagrangian step cost a sixth of the step.
        watched = [i for i, var in enumerate(self.variables) if not var.name.startswith(_EDGE_PREFIXES)]
        self.watched = [self.variables[i] for i in watched]
        self.watched_columns = np.array(self.variable_columns, dtype=np.int32)[watched]
        self.lows, self.ups = list(map(_LOW, self.watched)), list(map(_UP, self.watched))
        with backends.solver_output():
            self.highs.addCols(
                len(self.columns),
                self.costs,
                lower,
                upper,
                0,
                np.zeros(1, dtype=np.int32),
                np.zeros(0, dtype=np.int32),
                np.zeros(0),
            )
        # The objective HiGHS holds: its variables and their coefficients, in the expression's
        # order, and the scale it was passed at.
        self.objective_vars: list[pulp.LpVariable] = []
        self.objective_coefs: list[float] = []
        self.scale = 1.0
        # That objective unscaled, a cost per column (``_hold_objective``), and its own scale:
        # what HiGHS holds while ``priced`` is False, and what a Lagrangian step adds to.
        self.base_costs, self.base_scale = np.zeros(len(self.columns)), 1.0
        self.priced = False  # HiGHS holds the objective plus a Lagrangian step's prices (``_price``)
        self.rows: list[pulp.LpConstraint] = []
        self.table, self.table_columns = None, []  # ``_add_new_rows``: the ILP's row table, its columns' numbers here
        self._table_index: np.ndarray | None = None  # ``_table_column_index``
        self.row_terms: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # ``_row_terms``
        self.row_names: list[str] = []
        self.row_constants: list[float] = []
        self.row_senses: list[int] = []
        self.generated = len(self.ilp.generated)  # the ILP's generated y this model knows as such
        self.perturbed = False  # ``_run``: the model has stalled once and runs with cost perturbation
        self._add_new_rows()

    def _held_in_order(self, variables: list[pulp.LpVariable]) -> tuple[list, list[int]]:
        """(the columns, the column of each of ``variables``): ``variables`` (by name) with a
        column for each y the ILP holds (``solver.problem.columns``, ``_HELD``) where its name
        (``HeldColumns.name``) puts it: PuLP's order had every y been a variable, so the LP is
        the one HiGHS was given then, column for column (a tie between optima breaks alike).
        Sets ``held_column``, each held y's column (-1: taken)."""
        held = self.ilp.held
        left = held.left()
        self.held_column = np.full(len(held.taken), -1, dtype=np.int64)
        if not left.size:
            return list(variables), list(range(len(variables)))
        held_columns, variable_columns = held.merged_order([var.name for var in variables], left)
        self.held_column[left] = held_columns
        columns: list = [_HELD] * (len(variables) + len(left))
        variable_columns = variable_columns.tolist()
        for var, column in zip(variables, variable_columns):
            columns[column] = var
        return columns, variable_columns

    def _with_held(self, rows: np.ndarray, indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, ...]:
        """The entries (row, column, value) in row order, with each held y's two (``_held_in_order``)."""
        held = self.ilp.held
        left = np.flatnonzero(self.held_column >= 0)
        if not left.size:
            return rows, indices, values
        rows = np.concatenate([rows, held.out_row[left], held.in_row[left]])
        columns = np.tile(self.held_column[left], 2).astype(np.int32)
        order = np.argsort(rows, kind="stable")
        return rows[order], np.concatenate([indices, columns])[order], np.concatenate([values, np.ones(columns.size)])[order]

    def _held_costs(self) -> tuple[np.ndarray, np.ndarray]:
        """(columns, objective coefficients) of the y the ILP still holds."""
        held = self.ilp.held
        kept = ~held.taken
        return self.held_column[kept], held.cost[kept]

    def _add_new_columns(self) -> None:
        """The held y the ILP made PuLP variables since (``ShardingILP.generate``): their columns
        are theirs now."""
        for var, k in self.ilp.generated[self.generated :]:
            column = int(self.held_column[k])
            if column < 0:
                raise AssertionError("Relaxation: a generated y has no column; this is a bug in autopar")
            self.columns[column] = var
            self.column_of[id(var)] = column
            # Its column's bounds, as HiGHS holds them (``_sync_column_bounds`` passes any other).
            self.variables.append(var)
            self.variable_columns.append(column)
        self.generated = len(self.ilp.generated)

    @staticmethod
    def _bounds(values: list, infinite: float) -> np.ndarray:
        """A bound per entry, None meaning ``infinite``."""
        return np.fromiter((infinite if value is None else value for value in values), float, len(values))

    def _row_bounds(self, rows) -> tuple[np.ndarray, np.ndarray]:
        inf = self.inf
        lower = np.fromiter((-inf if (b := r.getLb()) is None else b for r in rows), float, len(rows))
        upper = np.fromiter((inf if (b := r.getUb()) is None else b for r in rows), float, len(rows))
        return lower, upper

    def _add_new_rows(self) -> bool:
        """Add the problem's rows HiGHS does not hold yet, their terms read from the ILP's
        ``row_table`` (``rounding.check`` reads the same table). False when one has a variable
        HiGHS does not hold."""
        constraints = self.ilp.rows_by_name()
        if len(constraints) == len(self.rows):
            return True
        table = self.ilp.row_table()
        if table is not self.table:
            self.table, self.table_columns, self._table_index = table, [], None
        while len(self.table_columns) < len(table.columns):  # the table's columns as HiGHS numbers them
            column = self.column_of.get(id(table.columns[len(self.table_columns)]))
            if column is None:
                return False
            self.table_columns.append(column)
        first = len(self.rows)
        new = table.rows[first:]
        entries = table.entries(first)
        values = table.entry_coefs[entries]
        kept = values != 0
        rows = table.entry_rows[entries][kept] - first
        indices = self._table_column_index()[table.entry_columns[entries][kept]].astype(np.int32)
        values = values[kept]
        if first == 0:  # the y the ILP holds sit in the edge rows too, coefficient 1
            rows, indices, values = self._with_held(rows, indices, values)
        starts = np.searchsorted(rows, np.arange(len(new))).astype(np.int32)  # each row's first entry
        lower, upper = self._row_bounds(new)
        with backends.solver_output():
            self.highs.addRows(len(new), lower, upper, len(indices), starts, indices, values)
        self.rows += new
        self.row_names += list(constraints)[first:]
        self.row_constants += map(_CONSTANT, new)
        self.row_senses += map(_SENSE, new)
        return True

    def _table_column_index(self) -> np.ndarray:
        """``table_columns`` as an array, kept while it has as many entries (it only grows, or
        starts again with a new table): converting a list of 10^5 took a millisecond or more for
        each row a Lagrangian step first priced (``_row_terms``)."""
        index = self._table_index
        if index is None or len(index) != len(self.table_columns):
            index = self._table_index = np.array(self.table_columns, dtype=np.int64)
        return index

    def _sync(self, priced: bool = False) -> float:
        """Pass HiGHS what changed in the problem since the last solve (rows, then bounds, then
        the objective, as they were always passed); the objective's scale. ``priced``: a
        Lagrangian step's prices follow (``_price``), which replace the objective's costs: they
        are read, not passed (on a tiny GPT-OSS, passing them twice per step cost 20% of it)."""
        constraints = self.ilp.rows_by_name()
        self._add_new_columns()
        objective = self._read_objective()
        if (
            len(constraints) < len(self.rows)
            or list(itertools.islice(constraints, len(self.rows))) != self.row_names
            or not self._add_new_rows()
            or objective is None
        ):
            self._build()  # a row removed, or a variable no row had: start over
            objective = self._read_objective()
        self._sync_row_bounds()
        self._sync_column_bounds()
        if objective:
            self._hold_objective(*objective)
        if not priced and (objective or self.priced):
            self._pass_costs(self.base_costs * self.base_scale)
            self.scale, self.priced = self.base_scale, False
        return self.scale

    def _sync_row_bounds(self) -> None:
        """A row's bounds follow from its sense and constant (its coefficients are fixed)."""
        constants, senses = list(map(_CONSTANT, self.rows)), list(map(_SENSE, self.rows))
        if constants == self.row_constants and senses == self.row_senses:
            return
        changed = _changed(constants, self.row_constants, senses, self.row_senses)
        lower, upper = self._row_bounds([self.rows[i] for i in changed])
        self.highs.changeRowsBounds(len(changed), np.array(changed, dtype=np.int32), lower, upper)
        self.row_constants, self.row_senses = constants, senses

    def _sync_column_bounds(self) -> None:
        lows, ups = list(map(_LOW, self.watched)), list(map(_UP, self.watched))
        if lows == self.lows and ups == self.ups:
            return
        changed = _changed(lows, self.lows, ups, self.ups)
        lower = self._bounds([lows[i] for i in changed], -self.inf)
        upper = self._bounds([ups[i] for i in changed], self.inf)
        columns = self.watched_columns[changed]
        self.highs.changeColsBounds(len(changed), columns, lower, upper)
        self.lows, self.ups = lows, ups

    def _read_objective(self) -> tuple | None:
        """(variables, coefficients, columns) of the problem's objective; () when it is the one
        HiGHS holds, None when it has a variable HiGHS does not hold. Its variables are compared
        by identity (pulp variables compare into constraints): a third of the time of taking
        their ids, as this did before every Lagrangian step."""
        objective = self.ilp.problem.objective
        coefs, held = list(objective.values()), self.objective_vars
        if len(coefs) == len(held) and all(map(is_, objective, held)) and coefs == self.objective_coefs:
            return ()
        columns = list(map(self.column_of.get, map(id, objective)))
        return None if None in columns else (list(objective), coefs, columns)

    def _hold_objective(self, variables: list, coefs: list[float], columns: list[int]) -> None:
        """Take the problem's objective as the one HiGHS holds: its costs per column, unscaled
        (``base_costs``), and their scale (``objective_scale``), which ``_sync`` passes."""
        values = np.array(coefs, dtype=float)
        held_columns, held_costs = self._held_costs()
        self.base_scale = _scale_for(_largest(values, held_costs))
        costs = np.zeros(len(self.columns))
        costs[held_columns] = held_costs
        costs[np.array(columns, dtype=np.int64)] = values
        self.base_costs = costs
        self.objective_vars, self.objective_coefs = variables, coefs

    def _pass_costs(self, costs: np.ndarray) -> None:
        changed = np.flatnonzero(costs != self.costs)
        if changed.size:
            self.highs.changeColsCost(changed.size, changed.astype(np.int32), costs[changed])
            self.costs = costs

    def _price(self, priced: list[tuple[str, float]]) -> None:
        """Pass HiGHS the problem's objective plus price · terms of each named row: what PuLP's
        ``objective + Σ price · row`` would hold, coefficient for coefficient (each variable's
        prices added in ``priced``'s order, then its objective coefficient), scaled as
        ``_sync`` scales. Building that expression in PuLP, once per Lagrangian
        step, took as long as the warm solve. The next ``_sync`` passes the objective back."""
        penalty = np.zeros(len(self.columns))
        for name, price in priced:
            columns, coefs = self._row_terms(name)
            penalty[columns] += price * coefs
        costs = self.base_costs + penalty
        scale = _scale_for(float(np.abs(costs).max()) if len(costs) else 0.0)
        self._pass_costs(costs * scale)
        self.scale, self.priced = scale, True

    def _row_terms(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(columns, coefficients) of a row HiGHS holds, in the row's order, from the row table
        its rows were added from (``_add_new_rows``); kept (coefficients are fixed)."""
        terms = self.row_terms.get(name)
        if terms is None:
            row = self.row_names.index(name)
            entries = self.table.entries(row, row + 1)
            columns = self._table_column_index()[self.table.entry_columns[entries]]
            terms = self.row_terms[name] = (columns, self.table.entry_coefs[entries])
        return terms

    def solve(self, time_limit_s: float, priced: list[tuple[str, float]] | None = None, edge_values: bool = True) -> str:
        """Solve the LP as the problem stands, from the last basis; set its variables' values,
        its rows' duals (``pi``, of the scaled objective, as PuLP's HiGHS sets them) and its
        status, as ``problem.solve`` would. Returns the status's name. ``priced``: (row name,
        price) pairs whose terms are added to the objective for this solve only (``_price``).
        ``edge_values=False``: the edge and hub variables (``_EDGE_PREFIXES``, all but a few
        thousand of 10^5 on a tiny GPT-OSS) keep their last values, for a caller that reads the
        others alone (a Lagrangian step rounds the x: setting every value took a tenth of its
        time beside the simplex)."""
        problem, ilp = self.ilp.problem, self.ilp
        if problem.objective is not ilp.time_objective:
            ilp.generate_all()  # the held y are priced in the time objective only
        self._sync(priced=bool(priced))
        if priced:
            self._price(priced)
        self._run(time_limit_s)
        status, sol_status = _status(self.highs.getModelStatus(), self.highs.getObjectiveValue())
        solution = self.highs.getSolution()
        values = np.asarray(solution.col_value)
        if len(values) == len(self.columns):  # none when the solve found nothing
            variables, index = (self.variables, self._variable_index()) if edge_values else (self.watched, self.watched_columns)
            for var, value in zip(variables, values[index].tolist()):
                var.varValue = value
        if len(ilp.held) and len(values) == len(self.columns):
            # The held y the solution uses become PuLP variables, at their values: the problem
            # of record then holds every y that is not 0 (``solver.problem.columns``).
            kept = np.flatnonzero(~ilp.held.taken)
            held_values = values[self.held_column[kept]]
            used = held_values != 0
            ilp.generate(kept[used], held_values[used])
            self._add_new_columns()
        for row, dual in zip(self.rows, solution.row_dual):
            row.pi = dual
        problem.assignStatus(status, sol_status)
        return pulp.LpStatus[status]

    def _variable_index(self) -> np.ndarray:
        """``variable_columns`` as an array, kept while it has as many entries (it only grows):
        each solve reads its variables' values by it, and a list of 10^5 is converted anew each time."""
        index = self._index
        if index is None or len(index) != len(self.variable_columns):
            index = self._index = np.array(self.variable_columns, dtype=np.int64)
        return index

    def _run(self, time_limit_s: float) -> None:
        """Run the simplex from the last basis. Without cost perturbation (``backends.LP_OPTIONS``)
        a degenerate LP could stall: past ``backends.stall_iterations`` it goes on from where it
        stopped with the perturbation, for this model's later solves too, within the time left."""
        import highspy  # an optional dependency (``backends.highs_available``)

        start = time.perf_counter()
        self.highs.setOptionValue("time_limit", float(time_limit_s))
        if not self.perturbed:
            self.highs.setOptionValue("simplex_iteration_limit", backends.stall_iterations(len(self.rows)))
        with backends.solver_output():
            self.highs.run()
        if self.perturbed or self.highs.getModelStatus() != highspy.HighsModelStatus.kIterationLimit:
            return
        self.perturbed = True
        iterations = self.highs.getInfo().simplex_iteration_count
        log.info("autopar: the LP relaxation stalled after %d iterations; going on with cost perturbation", iterations)
        for option, value in backends.PERTURBED.items():
            self.highs.setOptionValue(option, value)
        self.highs.setOptionValue("simplex_iteration_limit", highspy.kHighsIInf)
        self.highs.setOptionValue("time_limit", max(float(time_limit_s) - (time.perf_counter() - start), 1e-3))
        with backends.solver_output():
            self.highs.run()


class _Held:
    """What a held y's column shows of a variable (``Relaxation._held_in_order``): the bounds of a
    y, which never change while it is held; no value (the solve sets the variables' alone)."""

    lowBound, upBound, varValue = 0, 1, None


_HELD = _Held()


def _largest(*arrays: np.ndarray) -> float:
    """The largest magnitude in any of ``arrays`` (0.0 for none)."""
    return max((float(np.abs(a).max()) for a in arrays if len(a)), default=0.0)


def lp_scale(ilp: ShardingILP) -> float:
    """``objective_scale`` of the ILP's objective with the y it holds in it: the scale of the
    LP whose duals the caller reads (``Relaxation``)."""
    held_costs = ilp.held.cost[~ilp.held.taken]
    return _scale_for(_largest(np.fromiter(ilp.problem.objective.values(), float), held_costs))


def _changed(a: list, was_a: list, b: list, was_b: list) -> list[int]:
    """The positions where ``a`` or ``b`` differs from what it was (lists of equal lengths)."""
    return [i for i, (x, was_x, y, was_y) in enumerate(zip(a, was_a, b, was_b)) if x != was_x or y != was_y]


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
