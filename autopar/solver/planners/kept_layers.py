"""Which layers keep their gathered parameters from forward to backward: FSDP2's
``reshard_after_forward=False`` per block, chosen for a solved plan under
``CommOptions(reshard_after_forward="auto")`` (the default).

A layer kept saves its all-gather in backward, and the copies around it, for the memory of its
whole parameters from its forward until its backward. Backward runs the last layers first, so
the later a layer, the shorter it holds them: the candidates are the root (which FSDP2 keeps)
and the last ``k`` layers. The peak grows with ``k``, so a bisection finds the most layers whose
plan fits the budget; they are kept where that makes the step faster than FSDP2's default, the
root's alone. A plan that checkpoints or offloads (the budget binds) keeps FSDP2's default.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol

from autopar.cost import liveness
from autopar.cost.cluster import ClusterSpec
from autopar.ir.gathers import param_layer, reshards
from autopar.ir.options import CommOptions
from autopar.solver.problem.choices import ChoiceGraph
from autopar.solver.problem.fits import fits
from autopar.solver.problem.gather_overlap import gather_overlap
from autopar.solver.problem.gathered import PREFIX, gathered_intervals
from autopar.solver.problem.ilp import Solution

log = logging.getLogger("autopar")

# A kept layer must make the step faster by at least this share to be worth its memory.
_LEAST_GAIN = 1e-6


class _Priced(Protocol):
    """A plan's priced step (``sharding._StepParts``)."""

    @property
    def step_s(self) -> float: ...


def resharded_layers(graph: ChoiceGraph, solution: Solution) -> list[str]:
    """The layers whose parameters ``solution`` gathers and FSDP2's default reshards after
    forward, in forward order."""
    rows, _ = graph.derived.get("gather_rows", ((), False))
    gathered = _gathered_params(graph, solution)
    layers: list[str] = []
    for row in sorted(rows, key=lambda row: min(i for i, _ in row.uses)):
        layer = param_layer(row.fqn)
        if row.param in gathered and reshards(layer, None) and layer not in layers:
            layers.append(layer)
    return layers


def given_kept(graph: ChoiceGraph, solution: Solution) -> tuple[str, ...] | None:
    """The layers that ``graph``'s schedule, as the caller gave it (``CommOptions.
    reshard_after_forward``), keeps gathered under ``solution``, for the plan to record: a tuple
    as given, False every layer's, True none (the root's resharded too); None for FSDP2's
    default and for "auto" (``choose_kept`` decides)."""
    value = graph.comm.reshard_after_forward
    if value is None or value == "auto":
        return None
    if isinstance(value, tuple):
        return value
    return () if value else ("", *resharded_layers(graph, solution))


def _gathered_params(graph: ChoiceGraph, solution: Solution) -> set[str]:
    """The parameters ``solution`` gathers whole (an edge of theirs moves them by an all-gather)."""
    return {
        name.removeprefix(PREFIX)
        for name, size in graph.gathered.items()
        if size.edge in solution.edge_specs and size.bytes_for(*solution.edge_specs[size.edge])
    }


def with_kept(graph: ChoiceGraph, kept: tuple[str, ...], cluster: ClusterSpec) -> ChoiceGraph:
    """``graph`` priced under a schedule that keeps ``kept`` layers gathered: its gathered
    parameters' intervals and overlap terms anew, the rest shared."""
    comm = dataclasses.replace(graph.comm, reshard_after_forward=kept)
    intervals = _fixed_intervals(graph) + _gathered_intervals(graph, comm)
    other = dataclasses.replace(graph, comm=comm, timeline=liveness.Timeline(graph.timeline.names, intervals), overlap=None)
    other.overlap = gather_overlap(other, cluster, like=graph.overlap)
    for key in ("live_nodes", "gather_rows"):
        other.derived[key] = graph.derived[key]
    return other


def _fixed_intervals(graph: ChoiceGraph) -> tuple[liveness.Interval, ...]:
    """``graph``'s intervals that no schedule changes: all but its gathered parameters'."""
    return tuple(interval for interval in graph.timeline.intervals if not interval.node.startswith(PREFIX))


def _gathered_intervals(graph: ChoiceGraph, comm: CommOptions) -> tuple[liveness.Interval, ...]:
    """``graph``'s gathered parameters' intervals under the schedule ``comm``."""
    rows, exchange = graph.derived["gather_rows"]
    _, nodes = graph.derived["live_nodes"]
    return tuple(gathered_intervals(rows, nodes, comm, exchange))


def _peaks(graph: ChoiceGraph, solution: Solution, layers: list[str]) -> Callable[[int], float]:
    """The peak of ``solution`` with the last ``count`` of ``layers`` kept, for each ``count``:
    the curve of the intervals no schedule changes, walked once, plus that of the gathered ones."""
    bytes_of = graph.bytes_of(solution.choice)
    names = graph.timeline.names
    fixed = liveness.Timeline(names, _fixed_intervals(graph)).curve_array(bytes_of)

    def peak(count: int) -> float:
        comm = dataclasses.replace(graph.comm, reshard_after_forward=_kept(layers, count))
        return float((fixed + liveness.Timeline(names, _gathered_intervals(graph, comm)).curve_array(bytes_of)).max())

    return peak


def _kept(layers: list[str], count: int) -> tuple[str, ...]:
    return ("", *layers[len(layers) - count :]) if count else ("",)


def choose_kept(
    graph: ChoiceGraph, solution: Solution, cluster: ClusterSpec, budget: float | None, default: _Priced, step_of: Callable
) -> tuple[ChoiceGraph, tuple[str, ...], _Priced] | None:
    """(``graph`` under the schedule chosen, the layers it keeps, its step's parts) for
    ``solution``, whose step under FSDP2's default is ``default`` (module docstring); None where
    keeping no more than the root is as fast. ``step_of(graph)`` prices the solution's step on a
    graph (``sharding._StepParts``)."""
    layers = resharded_layers(graph, solution)
    if not layers:
        return None
    peak = _peaks(graph, solution, layers)
    low, high = 0, len(layers)  # the plan as solved (FSDP2's default) fits
    if not fits(peak(high), budget):
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(peak(middle), budget) else (low, middle)
        high = low
    while high > 0:  # the walk of the whole timeline, as the plan will be priced, has the last word
        other = with_kept(graph, _kept(layers, high), cluster)
        if fits(other.peak(solution.choice)[0], budget):
            break
        high -= 1
    if high == 0:
        return None
    parts = step_of(other)
    if parts.step_s >= default.step_s * (1 - _LEAST_GAIN):
        return None
    log.info(
        "autopar: keeping the gathered parameters of %d of %d layers from forward to backward: step %.4g -> %.4g s",
        high,
        len(layers),
        default.step_s,
        parts.step_s,
    )
    return other, _kept(layers, high), parts


__all__ = ["choose_kept", "given_kept", "resharded_layers", "with_kept"]
