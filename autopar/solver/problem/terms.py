"""The compute terms of the sharding ILP's objective, summed per variable with numpy.

The objective's first part is Σ over nodes (in graph order) and their strategies s of
w[n, s] · x[n, s], w = compute seconds less the per-use parameter reductions the bucketed ones
replace (``ShardingILP.set_objective``). Repeated layers share their x (``choices.repeated_layers``),
so one variable collects a term from every layer: 300,000 terms on 9,000 variables for
LLaMA-3-8B on (8, 2, 4). Summed one by one in Python (``ilp.weighted_sum``) that was a tenth of
the ILP's build. ``compute_coefficients`` adds each node's terms as one array instead, and gives
the very map the loop gives: the same keys in the same order (each variable's first nonzero
term), and each coefficient the same float (its terms added in the same order, a zero term
adding nothing).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pulp


def compute_coefficients(
    order: Sequence[str], compute_s: Mapping[str, list[float]], x: Mapping[str, list], refund: Mapping[str, list[float]]
) -> dict | None:
    """{variable: Σ w · coefficient} (and None: Σ w · constant, where some term has one) over the
    terms (w[n, s], x[n, s]) with w ≠ 0, w = compute_s[n][s] − refund[n][s] (0 where n has no
    refund); x[n, s] a variable or an affine expression of the variables in the lists of ``x``
    that hold variables alone. None when an expression has another variable (the caller sums
    the terms one by one then)."""
    table = _Table(x)
    if table.unknown:
        return None
    arrays: dict[int, np.ndarray] = {}  # by id of a compute_s column (identical ops share their tables)
    for name in order:
        costs = compute_s[name]
        weights = arrays.get(id(costs))
        if weights is None:
            weights = arrays[id(costs)] = np.array(costs, dtype=float)
        if name in refund:
            weights = weights - np.array(refund[name], dtype=float)
        table.add(x[name], weights)
    return table.coefficients()


class _Table:
    """One accumulator per variable of the lists in ``x`` that hold variables alone (shared lists
    once), and per expression list the (strategy, variable, coefficient) of its terms."""

    def __init__(self, x: Mapping[str, list]):
        self.base: dict[int, int] = {}  # a variable list's first slot, by its id
        self.variables: list[pulp.LpVariable] = []
        self.expressions: dict[int, tuple] = {}  # by id: (strategy, slot, coefficient) arrays, constants
        self.unknown = False
        lists = {id(values): values for values in x.values()}
        for key, values in lists.items():
            if all(type(value) is pulp.LpVariable for value in values):
                self.base[key] = len(self.variables)
                self.variables += values
        slot_of = {id(var): slot for slot, var in enumerate(self.variables)}
        for key, values in lists.items():
            if key not in self.base:
                self.expressions[key] = self._terms(values, slot_of)
        self.sums = np.zeros(len(self.variables))
        self.first = np.full(len(self.variables), -1, dtype=np.int64)  # when each was first met
        self.met = 0
        self.constant: float | None = None

    def _terms(self, values: list, slot_of: dict[int, int]) -> tuple:
        strategies, slots, coefs, constants = [], [], [], []
        for s, value in enumerate(values):
            for var, coef in value.items():
                slot = slot_of.get(id(var))
                if slot is None:
                    self.unknown = True
                    return ()
                strategies.append(s)
                slots.append(slot)
                coefs.append(coef)
            if value.constant:
                constants.append((s, value.constant))
        return (np.array(strategies, dtype=np.int64), np.array(slots, dtype=np.int64), np.array(coefs, dtype=float), constants)

    def add(self, values: list, weights: np.ndarray) -> None:
        base = self.base.get(id(values))
        if base is not None:
            slots = base + np.flatnonzero(weights)
            self.sums[base : base + len(weights)] += weights  # a zero weight adds nothing
        else:
            strategies, term_slots, coefs, constants = self.expressions[id(values)]
            picked = weights[strategies] != 0
            slots = term_slots[picked]
            np.add.at(self.sums, slots, weights[strategies[picked]] * coefs[picked])  # in order, slot by slot
            for s, constant in constants:
                if weights[s]:
                    self.constant = (self.constant or 0.0) + float(weights[s]) * constant
        new = slots[self.first[slots] < 0]
        if new.size:
            new = new[np.sort(np.unique(new, return_index=True)[1])]  # in the order first met
            self.first[new] = self.met + np.arange(new.size)
            self.met += new.size

    def coefficients(self) -> dict:
        met = np.flatnonzero(self.first >= 0)
        met = met[np.argsort(self.first[met])]
        coefs = dict(zip([self.variables[slot] for slot in met.tolist()], self.sums[met].tolist()))
        if self.constant is not None:
            coefs[None] = self.constant
        return coefs


__all__ = ["compute_coefficients"]
