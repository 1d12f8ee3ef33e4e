"""A node's strategies with their prices: one record per strategy (``PricedStrategy``), held in
order by a ``PriceTable``.

A strategy and what it costs travel as one value, so that whatever cuts, follows, reorders or
reprices a node's strategies (``pruning``'s cuts, a forced spec, ``choices._mark_followers``,
``solver.planners.stage_costs.per_step_graph``) moves the prices with them: there are no
parallel lists to keep in step. Readers that work on a whole column at once (the ILP's
objective and memory rows, the runner-ups' numpy arrays) read a column view of the table,
computed from the records once per table.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from autopar.rules.registry import Strategy

# A parameter-gradient reduction a strategy runs: (input index, mesh axis, seconds as priced in
# ``compute_s`` per use, seconds as the runtime's bucketed reduction of that parameter).
ParamSync = tuple[int, int, float, float]


@dataclass(frozen=True, slots=True)
class PricedStrategy:
    """One strategy of a node and its prices (``solver.problem.op_prices`` computes them)."""

    strategy: Strategy
    # Seconds of the op under this strategy: roofline compute, its inputs' gradient all-reduces
    # (parameters' per use: the ILP merges those, see ``param_syncs``) and its kernel's collectives.
    compute_s: float = 0.0
    # Local bytes of the node's outputs (a parameter's: its shard). The liveness walk
    # (``ChoiceGraph.timeline``) says when, and in what kinds, they are alive.
    memory_bytes: float = 0.0
    # Bytes each device sends in the gradient all-reduces and the kernel's collectives.
    grad_sync_bytes: float = 0.0
    # Seconds of the gradient all-reduces of the parameters the op reads (within ``compute_s``;
    # the runtime buckets them, see ``solver.pricing.comm_schedule``), and of the op's backward
    # compute, which can hide them.
    param_sync_s: float = 0.0
    backward_s: float = 0.0
    # The parameter reductions this strategy runs, one per (input, axis); the ILP merges them
    # per parameter (``ilp.ShardingILP.add_param_sync_variables``).
    param_syncs: tuple[ParamSync, ...] = ()


class PriceTable(tuple[PricedStrategy, ...]):
    """A node's priced strategies, in order: the one source of every per-strategy number.

    A tuple, so that it cannot change once built: a cut, a follower's strategies or other
    prices make a new table (``keep``, ``repriced``). Identical ops and the nodes of repeated
    layers share one table (``choices._op_choice``), and caches elsewhere key on the identity
    of a table or of its ``strategies`` view. The column views are computed once per table."""

    @functools.cached_property
    def strategies(self) -> tuple[Strategy, ...]:
        return tuple(priced.strategy for priced in self)

    @functools.cached_property
    def compute_s(self) -> tuple[float, ...]:
        return tuple(priced.compute_s for priced in self)

    @functools.cached_property
    def memory_bytes(self) -> tuple[float, ...]:
        return tuple(priced.memory_bytes for priced in self)

    def keep(self, indices: Iterable[int]) -> PriceTable:
        """The records at ``indices``, in that order."""
        return PriceTable(self[i] for i in indices)

    def repriced(self, compute_s: Sequence[float]) -> PriceTable:
        """The same strategies at other ``compute_s``, one per record, in order."""
        table = PriceTable(dataclasses.replace(priced, compute_s=c) for priced, c in zip(self, compute_s, strict=True))
        # The very same strategies: share the view, so that caches keyed on its identity (the
        # edges' spec lists, the ILP's spec groups) treat both tables' strategies as one list.
        table.__dict__["strategies"] = self.strategies
        return table


__all__ = ["ParamSync", "PricedStrategy", "PriceTable"]
