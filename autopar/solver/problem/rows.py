"""The rows of a PuLP problem as PuLP's own backends read them, and as flat arrays (``RowTable``)
for numpy and HiGHS (``solver.search.relaxation``, ``rounding.check``)."""

from __future__ import annotations

import itertools

import numpy as np
import pulp


def rows_by_name(problem: pulp.LpProblem) -> dict[str, pulp.LpConstraint]:
    """``problem``'s rows by name, in the order they were added: the mapping PuLP's own
    backends read (``LpProblem.constraints`` warns under PuLP 3)."""
    return problem._constraints


class RowTable:
    """The terms of a problem's rows as flat arrays (row, column, coefficient), in row order,
    columns numbered by first appearance. Rows are only ever added, their coefficients fixed once
    added (as ``ShardingILP.variables`` takes them): a row added since the last ``read`` is all
    there is to read. Constants and senses are read afresh by ``hold`` (a Lagrangian step lifts
    the constants of the memory rows for its solve)."""

    def __init__(self, problem: pulp.LpProblem):
        self.problem = problem
        self.rows: list[pulp.LpConstraint] = []
        self.columns: list[pulp.LpVariable] = []
        self.column_of: dict[int, int] = {}  # by identity: pulp variables compare into constraints
        self.entry_rows = np.zeros(0, dtype=np.int64)
        self.entry_columns = np.zeros(0, dtype=np.int64)
        self.entry_coefs = np.zeros(0)

    def read(self) -> None:
        """Add the rows the problem has gained since the last call."""
        constraints = rows_by_name(self.problem)
        if len(constraints) == len(self.rows):
            return
        new = list(itertools.islice(constraints.values(), len(self.rows), None))
        # The entries in row order, flat; each distinct variable numbered once, by first appearance.
        variables = list(itertools.chain.from_iterable(row.keys() for row in new))
        size = len(variables)
        coefs = np.fromiter(itertools.chain.from_iterable(row.values() for row in new), float, size)
        ids = np.fromiter(map(id, variables), np.int64, size)
        unique, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        numbers = np.empty(len(unique), dtype=np.int64)
        column_of, get = self.column_of, self.column_of.get
        for u in np.argsort(first, kind="stable").tolist():
            key = int(unique[u])
            column = get(key)
            if column is None:
                column = column_of[key] = len(self.columns)
                self.columns.append(variables[first[u]])
            numbers[u] = column
        rows = np.repeat(np.arange(len(self.rows), len(self.rows) + len(new), dtype=np.int64), [len(row) for row in new])
        self.rows += new
        self.entry_rows = np.concatenate([self.entry_rows, rows])
        self.entry_columns = np.concatenate([self.entry_columns, numbers[inverse.reshape(-1)]])
        self.entry_coefs = np.concatenate([self.entry_coefs, coefs])

    def add_columns(self, columns: list[tuple[pulp.LpVariable, int, int]]) -> None:
        """Read new columns of rows already read, each (variable, row, row) with coefficient 1
        in both (``ShardingILP.generate``): last in each row, as PuLP appends them."""
        if not columns:
            return
        numbers = np.arange(len(self.columns), len(self.columns) + len(columns), dtype=np.int64)
        for var, _, _ in columns:
            self.column_of[id(var)] = len(self.columns)
            self.columns.append(var)
        rows = np.array([row for _, out, into in columns for row in (out, into)], dtype=np.int64)
        order = np.argsort(np.concatenate([self.entry_rows, rows]), kind="stable")
        self.entry_rows = np.concatenate([self.entry_rows, rows])[order]
        self.entry_columns = np.concatenate([self.entry_columns, np.repeat(numbers, 2)])[order]
        self.entry_coefs = np.concatenate([self.entry_coefs, np.ones(len(rows))])[order]

    def entries(self, first: int, last: int | None = None) -> slice:
        """The entries of rows ``first`` up to ``last`` (excluded; None: to the end)."""
        end = len(self.entry_rows) if last is None else int(np.searchsorted(self.entry_rows, last))
        return slice(int(np.searchsorted(self.entry_rows, first)), end)

    def hold(self, tolerance: float) -> bool:
        """``ShardingILP.rows_hold`` of the rows read so far."""
        values = np.fromiter((var.varValue for var in self.columns), float, len(self.columns))
        constants = np.fromiter((row.constant for row in self.rows), float, len(self.rows))
        senses = np.fromiter((row.sense for row in self.rows), float, len(self.rows))
        value = (
            np.bincount(self.entry_rows, weights=self.entry_coefs * values[self.entry_columns], minlength=len(self.rows))
            + constants
        )
        eps = tolerance * np.maximum(1.0, np.abs(constants))
        held = np.where(senses == pulp.LpConstraintEQ, np.abs(value) <= eps, value * senses >= -eps)
        return bool(held.all())


__all__ = ["RowTable", "rows_by_name"]
