"""Integer plans without branching, and their exact price.

- ``round_relaxation``: each node with variables takes the strategy its LP-relaxation x
  weighs most (ties to the lowest index); followers and repeated layers follow as in the ILP.
- ``greedy``: in graph order, each node with variables takes the strategy that minimizes its
  own compute plus the resharding of its inputs from the producers already chosen, plus
  ``memory_weight`` seconds per byte of its memory. A larger weight trades time for memory,
  which is how a plan is found under a tight budget.
- ``check``: sets the ILP's x and y to an assignment and checks every constraint of every
  family, so a rounded or greedy plan is held to exactly what the ILP demands; its objective
  is then the ILP objective of that assignment.

These serve the fast path (an LP relaxation whose rounding meets the LP bound is optimal) and
the fallback when a MILP solve fails or runs out of time; the gap to the LP bound is reported.
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np
import pulp

from autopar.solver.search import backends

if TYPE_CHECKING:
    from autopar.solver.problem.choices import ChoiceGraph
    from autopar.solver.problem.ilp import ShardingILP

# Constraint slack accepted when checking an assignment (the equalities have 0/1 coefficients
# and the memory family is in bytes, so this is tight for both).
_TOLERANCE = 1e-6


def complete(graph: ChoiceGraph, picked: dict[str, int]) -> dict[str, int] | None:
    """Strategy index of every node from ``picked`` (the nodes with variables of their own).
    None if a follower has no strategy for its producer's spec."""
    # A follower's strategy for each of its producer's: followers of identical ops share their
    # strategy lists (``choices._mark_followers``), so one lookup serves every layer, and every
    # plan of this graph (the lists are fixed once the graph is built, and kept by it).
    follows = graph.derived.setdefault("rounding_follows", {})
    choice: dict[str, int] = {}
    for name in graph.order:
        node = graph.choices[name]
        if node.follower_of is not None and name not in graph.layer_template:
            producer, out_index = node.inputs[0]
            key = (id(node.strategies), id(graph.choices[producer].strategies), choice[producer], out_index)
            index = follows[key] if key in follows else follows.setdefault(key, complete_one(graph, name, picked, choice))
        else:
            index = complete_one(graph, name, picked, choice)
        if index is None:
            return None
        choice[name] = index
    return choice


def deciding_nodes(graph: ChoiceGraph) -> list[str]:
    """Nodes that carry variables of their own in the ILP, in graph order."""
    return [
        name
        for name in graph.order
        if name not in graph.layer_template
        and graph.choices[name].follower_of is None
        and len(graph.choices[name].strategies) > 1
    ]


def round_relaxation(ilp: ShardingILP) -> dict[str, int] | None:
    picked = {}
    for name in deciding_nodes(ilp.graph):
        values = [_value(x) for x in ilp.x[name]]
        picked[name] = max(range(len(values)), key=lambda s: (values[s], -s))
    return complete(ilp.graph, picked)


def greedy(ilp: ShardingILP, memory_weight: float = 0.0) -> dict[str, int] | None:
    graph = ilp.graph
    inputs_of: dict[str, list] = {}
    for edge in graph.edges:
        inputs_of.setdefault(edge.consumer, []).append(edge)
    picked: dict[str, int] = {}
    chosen: dict[str, int] = {}  # every node decided so far (followers, templates too)
    deciding = set(deciding_nodes(graph))
    for name in graph.order:
        node = graph.choices[name]
        if name in deciding:
            best, best_cost = None, math.inf
            seconds = graph.objective_s(name)  # a parameter's with its optimizer step, as the ILP has it
            for s, strategy in enumerate(node.strategies):
                cost = seconds[s] + memory_weight * node.priced[s].memory_bytes
                for edge in inputs_of.get(name, []):
                    producer = graph.choices[edge.producer]
                    src = producer.strategies[chosen[edge.producer]].outs[edge.out_index]
                    price = edge.price.get((src, strategy.ins[edge.in_index]))
                    cost = math.inf if price is None else cost + price[0]
                    if cost == math.inf:
                        break
                if cost < best_cost:
                    best, best_cost = s, cost
            if best is None:
                return None
            picked[name] = best
        partial = complete_one(graph, name, picked, chosen)
        if partial is None:
            return None
        chosen[name] = partial
    return chosen


def complete_one(graph: ChoiceGraph, name: str, picked: dict[str, int], chosen: dict[str, int]) -> int | None:
    """``complete`` for one node, given the choices of the nodes before it."""
    node = graph.choices[name]
    template = graph.layer_template.get(name)
    if template is not None:
        return chosen[template]
    if node.follower_of is not None:
        producer, out_index = node.inputs[0]
        spec = graph.choices[producer].strategies[chosen[producer]].outs[out_index]
        matches = [s for s, strategy in enumerate(node.strategies) if strategy.ins[0] == spec]
        return matches[0] if matches else None
    if len(node.strategies) == 1:
        return 0
    return picked[name]


def check(ilp: ShardingILP, choice: dict[str, int]) -> float | None:
    """The ILP objective of ``choice``, or None if it breaks a constraint (or an edge's
    transition does not exist). Leaves the variables set to the assignment."""
    graph = ilp.graph
    for name in deciding_nodes(graph):
        for s, var in enumerate(ilp.x[name]):
            var.varValue = 1.0 if s == choice[name] else 0.0
    # Edges of repeated layers share one y (``ShardingILP.add_edge_constraints``: their ends have
    # equal strategy lists), so one (y, strategy indices) names one transition: look each up once.
    taken: dict[tuple, tuple] = {}  # → the variables at 1 of its transition
    wanted: dict[tuple, int] = {}  # → the held y it uses (``solver.problem.columns``), a variable below
    for e, variables in ilp.y.items():
        edge = graph.edges[e]
        key = (id(variables), edge.out_index, edge.in_index, choice[edge.producer], choice[edge.consumer])
        if key in taken or key in wanted:
            continue
        src = graph.choices[edge.producer].strategies[choice[edge.producer]].outs[edge.out_index]
        dst = graph.choices[edge.consumer].strategies[choice[edge.consumer]].ins[edge.in_index]
        if (src, dst) in variables:
            taken[key] = (variables[(src, dst)],)
            continue
        held = ilp.held.find(variables, (src, dst))
        if held is not None:  # a y of its own, still held
            wanted[key] = held
            continue
        # Not a pair of its own: through the replicated spec, where the edge has that hub.
        outs, ins = ilp.hub.get(e, ({}, {}))
        if src not in outs or dst not in ins:
            return None
        taken[key] = (outs[src], ins[dst])
    if wanted:
        ilp.generate(np.array(sorted(set(wanted.values())), dtype=np.int64))
        made = {k: var for var, k in ilp.generated}
        for key, k in wanted.items():
            taken[key] = (made[k],)
    for variables in {id(variables): variables for variables in ilp.y.values()}.values():
        for var in variables.values():
            var.varValue = 0.0
    for outs, ins in {id(hub[0]): hub for hub in ilp.hub.values()}.values():
        for var in itertools.chain(outs.values(), ins.values()):
            var.varValue = 0.0
    for used in taken.values():
        for var in used:
            var.varValue = 1.0
    for key, value in ilp.param_sync_values().items():  # each z at the least its rows allow
        ilp.z[key].varValue = value
    for exposed, value in ilp.exposed_gathers_values():  # and each E (``gather_overlap``)
        exposed.varValue = value
    if any(var.varValue is None for var in ilp.variables()):
        return _fixed_solve(ilp, choice)  # another family added variables: let the LP set them
    if not ilp.rows_hold(_TOLERANCE):
        return None
    return float(pulp.value(ilp.problem.objective) or 0.0)


def _fixed_solve(ilp: ShardingILP, choice: dict[str, int]) -> float | None:
    """Fix x to ``choice`` and solve the LP over the remaining variables."""
    ilp.generate_all()  # PuLP's solver sees every y (``solver.problem.columns``)
    fixed = [var for name in deciding_nodes(ilp.graph) for var in ilp.x[name]]
    bounds = [(var.lowBound, var.upBound) for var in fixed]
    for var in fixed:
        var.lowBound = var.upBound = var.varValue
    try:
        ilp.problem.solve(backends.make(backends.lp_backend(), 60.0, mip=False))
        ok = ilp.problem.status == pulp.LpStatusOptimal
        return float(pulp.value(ilp.problem.objective) or 0.0) if ok else None
    finally:
        for var, (low, up) in zip(fixed, bounds):
            var.lowBound, var.upBound = low, up


def _value(x) -> float:
    return float(pulp.value(x) or 0.0)
