"""The leanest sharding without a MILP, where it can be proved leanest.

Every node's outputs take at least ``m_min[n] = min_s m[n, s]`` bytes, so the liveness curve
with each node at its least bytes (a gathered parameter at 0) lies under the curve of every
sharding, time by time: its peak ``least_peak`` is a lower bound on any plan's peak. Two uses:

- a budget under that bound is met by no sharding alone, which says so without an LP with memory
  rows (on a tiny GPT-OSS that LP took 4.6 s of simplex to find itself infeasible);
- a plan whose peak equals the bound is the leanest there is. ``lean_choice`` builds one from
  the per-node minima (each deciding node at its least bytes, then the fastest; followers and
  repeated layers follow as in the ILP), and from greedy plans at rising memory weights
  (``rounding.greedy``: the least bytes whose input reshardings exist). Where neither meets the
  bound, the caller solves the min-peak MILP as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.solver.search import rounding

if TYPE_CHECKING:
    from autopar.solver.problem.choices import ChoiceGraph
    from autopar.solver.problem.ilp import ShardingILP

# Seconds-per-byte weights of the greedy plans, as multiples of (compute seconds / bytes): high
# enough that bytes decide and time only breaks ties.
_LEAN_WEIGHTS = (1e3, 1e6)


def least_peak(graph: ChoiceGraph) -> float:
    """The peak of the curve with every node at its least bytes: no sharding peaks lower."""
    return graph.timeline.peak(graph.bytes_bound(largest=False))[0]


def lean_choice(ilp: ShardingILP, floor: float) -> dict[str, int] | None:
    """The first plan built as the module docstring says whose peak is ``floor`` (``least_peak``:
    so it is the leanest) and that meets every row of ``ilp``; None where none does. Call it
    before memory rows are added (``rounding.check`` holds a plan to every row)."""
    graph = ilp.graph
    for choice in _lean_plans(ilp):
        if choice is None or graph.peak(choice)[0] > floor:
            continue
        if rounding.check(ilp, choice) is not None:
            return choice
    return None


def _lean_plans(ilp: ShardingILP):
    graph = ilp.graph
    picked = {}
    for name in rounding.deciding_nodes(graph):
        node = graph.choices[name]
        priced = node.priced
        picked[name] = min(range(len(priced)), key=lambda s: (priced[s].memory_bytes, priced[s].compute_s, s))
    yield rounding.complete(graph, picked)
    seconds = sum(min(c.priced.compute_s, default=0.0) for c in graph.choices.values())
    total_bytes = sum(min(c.priced.memory_bytes, default=0.0) for c in graph.choices.values())
    for weight in _LEAN_WEIGHTS:
        yield rounding.greedy(ilp, weight * max(seconds, 1e-12) / max(total_bytes, 1.0))
