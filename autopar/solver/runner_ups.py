"""Why the solver chose what it chose: each decision's runner-up strategies and their costs.

A *decision* is one block of ILP variables: a free node, together with every node that shares
its variables (the same node in later repeated layers, tied parameter names) and every follower
whose strategy is a function of theirs. For each decision this module prices the counterfactual
"this decision takes strategy s, everything else stays as solved": the same objective terms the
ILP sums (compute and gradient sync of every member, resharding on every edge that touches a
member), split into parts, plus the memory the ILP counts for the members.

The plan stores the chosen strategy and the ``top_k`` cheapest others, so ``autopar explain``
needs neither the model nor a re-solve. The numbers are exact for the choice graph that was
solved, and deterministic (ties are broken by strategy index).
"""

from __future__ import annotations

from typing import Any

from autopar.cost.cluster import ClusterSpec
from autopar.cost import comm
from autopar.solver.choices import ChoiceGraph, grad_sync_axes, grad_sync_cost, kernel_collectives
from autopar.solver.ilp import Solution
from autopar.ir.spec import format_spec

TOP_K = 3
# Relative slack under which two totals count as equal (float sums in different orders).
_REL_TOL = 1e-9


def explain_decisions(
    graph: ChoiceGraph,
    solution: Solution,
    cluster: ClusterSpec,
    memory_budget: float | None,
    top_k: int = TOP_K,
) -> dict[str, dict[str, Any]]:
    """Representative node name → the decision's record (see docs/plan-format.md, ``decisions``)."""
    edges_of: dict[str, list[int]] = {}
    for e, edge in enumerate(graph.edges):
        edges_of.setdefault(edge.producer, []).append(e)
        edges_of.setdefault(edge.consumer, []).append(e)
    decisions = {}
    position = {name: i for i, name in enumerate(graph.order)}
    memo = _Memo(graph, cluster)
    followers: dict[str, list[str]] = {}
    for name in graph.order:
        follower_of = graph.choices[name].follower_of
        if follower_of is not None:
            followers.setdefault(follower_of, []).append(name)
    groups, _ = graph.param_sync_groups()
    for rep, base in _decision_bases(graph).items():
        choice = graph.choices[rep]
        if len(choice.strategies) < 2:
            continue
        members = _members(base, followers)
        ordered = sorted(members, key=position.__getitem__)
        # Per touching edge, what does not depend on the strategy: the edge, its class (the
        # price table and both ends' layer classes) and whether it enters the decision.
        touching = [memo.edge_class(graph.edges[e], members)
                    for e in sorted({e for name in members for e in edges_of.get(name, ())})]
        # The parameter reductions a member may need (the others cannot change with it).
        synced = [group for group in groups.values() if any(consumer in members for consumer, _ in group.uses)]
        priced = []
        for s in range(len(choice.strategies)):
            assignment = _assignment(graph, solution, base, ordered, s, memo)
            cost = _price(graph, solution, assignment, members, touching, synced, memo)
            if cost is not None:
                priced.append((s, assignment, cost))
        chosen = solution.choice[rep]
        ranked = sorted(priced, key=lambda item: (item[0] != chosen, item[2]["total_s"], item[0]))
        kept = ranked[: top_k + 1]
        candidates = [_candidate(graph, rep, s, assignment, cost, s == chosen, memo) for s, assignment, cost in kept]
        decisions[rep] = {
            "members": ordered,
            "fqns": [graph.choices[n].fqn for n in ordered if graph.choices[n].fqn],
            "num_strategies": len(choice.strategies),
            "num_impossible": len(choice.strategies) - len(priced),
            "binding": _binding(ranked, chosen, memory_budget, solution.status),
            "candidates": candidates,
        }
    return decisions


class _Memo:
    """What the counterfactuals of one ``explain_decisions`` call share, keyed by *class*: a
    node of a repeated layer stands for its first-layer counterpart (``layer_template``), whose
    strategy list and prices are equal by construction (``choices.repeated_layers``). So a
    decision over 80 copies of a layer prices each distinct (edge class, src, dst) and each
    follower's strategy once, not once per copy; the sums still run over every member, in
    the same order as before, so the numbers are the same to the last bit."""

    def __init__(self, graph: ChoiceGraph, cluster: ClusterSpec):
        self.graph, self.cluster = graph, cluster
        self.template = graph.layer_template
        self.follow: dict[tuple, int] = {}  # (follower class, producer class, out index, producer's index) → index
        self.edge: dict[tuple, tuple[float, float] | None | bool] = {}  # → price, None (impossible), False (no change)
        self.grad_sync: dict[tuple, float] = {}
        self.kernel_comm: dict[tuple, float] = {}
        self.by_input: dict[int, dict] = {}  # follower strategy lists, by identity

    def cls(self, name: str) -> str:
        return self.template.get(name, name)

    def edge_class(self, edge, members: set[str]) -> tuple:
        """(edge, its class: price table, out index and in index and both ends' classes, whether
        it enters the decision): what of a touching edge does not depend on the strategy."""
        return (edge, (id(edge.price), self.cls(edge.producer), edge.out_index, self.cls(edge.consumer), edge.in_index),
                edge.consumer in members)

    def inputs_key(self, name: str) -> tuple:
        """What a member's gradient all-reduces depend on beyond its class and strategy."""
        choice = self.graph.choices[name]
        return tuple((self.graph.choices[p].requires_grad, self.graph.choices[p].kind, tuple(arg.shape), arg.dtype)
                     for (p, _), arg in zip(choice.inputs, choice.info.inputs))

def _decision_bases(graph: ChoiceGraph) -> dict[str, set[str]]:
    """Representative → the free nodes that share its variables (layer copies, tied names)."""
    tie_first = {name: group[0] for group in graph.ties for name in group}
    bases: dict[str, set[str]] = {}
    for name in graph.order:
        choice = graph.choices[name]
        if choice.follower_of is not None or choice.kind == "output":
            continue
        rep = graph.layer_template.get(name, name)
        rep = tie_first.get(rep, rep)
        rep = graph.layer_template.get(rep, rep)
        bases.setdefault(rep, set()).add(name)
    return bases


def _members(base: set[str], followers: dict[str, list[str]]) -> set[str]:
    """The base nodes and, transitively, their followers."""
    members, stack = set(base), list(base)
    while stack:
        for follower in followers.get(stack.pop(), ()):
            if follower not in members:
                members.add(follower)
                stack.append(follower)
    return members


def _assignment(graph: ChoiceGraph, solution: Solution, base: set[str], ordered: list[str], s: int,
                memo: _Memo) -> dict[str, int]:
    """Strategy index of every member (``ordered``: in graph order) when the decision takes strategy ``s``."""
    assignment: dict[str, int] = {}
    for name in ordered:
        if name in base:
            assignment[name] = s
            continue
        choice = graph.choices[name]
        producer, out_index = choice.inputs[0]
        producer_index = assignment.get(producer, solution.choice[producer])
        key = (memo.cls(name), memo.cls(producer), out_index, producer_index)
        index = memo.follow.get(key)
        if index is None:
            spec = graph.choices[producer].strategies[producer_index].outs[out_index]
            index = memo.follow[key] = _index_by_input(choice.strategies, memo.by_input)[spec]
        assignment[name] = index
    return assignment


def _index_by_input(strategies: list, cache: dict[int, dict]) -> dict:
    """First strategy index per input spec of a follower's strategy list (identical ops share
    one list, so this is computed once per distinct list while ``cache`` lives)."""
    index = cache.get(id(strategies))
    if index is None:
        index = cache[id(strategies)] = {}
        for i, strategy in enumerate(strategies):
            index.setdefault(strategy.ins[0], i)
    return index


def _price(graph: ChoiceGraph, solution: Solution, assignment: dict[str, int], members: set[str],
           touching: list[tuple], synced: list, memo: _Memo) -> dict[str, float] | None:
    """Seconds and bytes the members cost under ``assignment``; None if a resharding is impossible.
    ``synced``: the parameter reduction groups that a member uses."""
    compute_s = memory_bytes = reshard_in_s = reshard_out_s = 0.0
    for name, index in assignment.items():
        choice = graph.choices[name]
        compute_s += choice.compute_s[index]
        memory_bytes += choice.memory_bytes[index]
    # Parameter reductions run once per parameter (``choices.param_sync_groups``): the members'
    # per-use prices give way to each group a member uses, priced once.
    _, refunds = graph.param_sync_groups()
    merged_s = -sum(refunds[name][index] for name, index in assignment.items() if name in refunds)
    full = _Overlay(assignment, solution.choice)
    for group in synced:
        if group.needed(full):
            merged_s += group.total_s
    for edge, edge_class, enters in touching:
        src_index = assignment.get(edge.producer, solution.choice[edge.producer])
        dst_index = assignment.get(edge.consumer, solution.choice[edge.consumer])
        key = (edge_class, src_index, dst_index)
        price = memo.edge.get(key, True)
        if price is True:
            src = graph.choices[edge.producer].strategies[src_index].outs[edge.out_index]
            dst = graph.choices[edge.consumer].strategies[dst_index].ins[edge.in_index]
            price = memo.edge[key] = False if src == dst else edge.price.get((src, dst))
        if price is False:
            continue
        if price is None:
            return None
        if enters:
            reshard_in_s += price[0]
        else:
            reshard_out_s += price[0]
    return {"compute_s": compute_s, "param_sync_merge_s": merged_s, "reshard_in_s": reshard_in_s,
            "reshard_out_s": reshard_out_s, "memory_bytes": memory_bytes,
            "total_s": compute_s + merged_s + reshard_in_s + reshard_out_s}


class _Overlay(dict):
    """``assignment`` over the solution's choice, read-only."""

    def __init__(self, assignment: dict[str, int], base: dict[str, int]):
        super().__init__(assignment)
        self._base = base

    def __missing__(self, name: str) -> int:
        return self._base[name]


def _grad_sync_s(memo: _Memo, name: str, index: int) -> float:
    """Seconds of backward gradient all-reduces inside a member's ``compute_s``."""
    graph = memo.graph
    choice = graph.choices[name]
    if choice.info is None:
        return 0.0
    key = (memo.cls(name), index, memo.inputs_key(name))
    if key in memo.grad_sync:
        return memo.grad_sync[key]
    strategy = choice.strategies[index]
    seconds = 0.0
    for i, arg in enumerate(choice.info.inputs):
        if not graph.choices[choice.inputs[i][0]].requires_grad:
            continue
        for axis in grad_sync_axes(strategy, i):
            is_param = graph.choices[choice.inputs[i][0]].kind == "param"
            seconds += grad_sync_cost(arg, strategy.ins[i], axis, is_param, graph.mesh_shape, memo.cluster).backward_s
    memo.grad_sync[key] = seconds
    return seconds


def _kernel_comm_s(memo: _Memo, name: str, index: int) -> float:
    """Seconds of a kernel's own collectives inside a member's ``compute_s`` (the
    context-parallel attention's K/V gathers and row exchanges: ``choices.kernel_collectives``)."""
    graph = memo.graph
    choice = graph.choices[name]
    if choice.info is None or choice.strategies[index].kernel is None:
        return 0.0
    key = (memo.cls(name), index, choice.requires_grad, memo.inputs_key(name))
    seconds = memo.kernel_comm.get(key)
    if seconds is None:
        steps = kernel_collectives(choice.info, choice.strategies[index], graph.mesh_shape, choice.requires_grad)
        seconds = memo.kernel_comm[key] = comm.collectives_cost(steps, graph.mesh_shape, memo.cluster)[0] if steps else 0.0
    return seconds


def _candidate(graph, rep, s, assignment, cost, chosen, memo: _Memo) -> dict[str, Any]:
    strategy = graph.choices[rep].strategies[s]
    grad_sync_s = sum(_grad_sync_s(memo, name, index) for name, index in assignment.items())
    kernel_comm_s = sum(_kernel_comm_s(memo, name, index) for name, index in assignment.items())
    record: dict[str, Any] = {"strategy": s}
    if chosen:
        record["chosen"] = True
    record.update({
        "out": [format_spec(spec) for spec in strategy.outs],
        "in": [format_spec(spec) for spec in strategy.ins],
        "compute_s": cost["compute_s"] - grad_sync_s - kernel_comm_s,
        "grad_sync_s": grad_sync_s + cost["param_sync_merge_s"],
        "reshard_in_s": cost["reshard_in_s"],
        "reshard_out_s": cost["reshard_out_s"],
        "total_s": cost["total_s"],
        "memory_bytes": int(cost["memory_bytes"]),
    })
    if strategy.kernel:
        record["kernel"] = strategy.kernel
        record["kernel_axes"] = list(strategy.kernel_axes)
    if kernel_comm_s:
        record["kernel_comm_s"] = kernel_comm_s
    return record


def _binding(ranked: list, chosen: int, memory_budget: float | None, status: str) -> str:
    """Which constraint decided: ``cost`` when the chosen strategy is the cheapest priced one;
    ``memory_budget`` when every cheaper one needs more memory under a budget; ``time_limit``
    when the solver stopped before proving optimality; ``coupled`` otherwise (a cheaper change
    exists only for this decision alone, which an optimal solve rules out; kept as a guard)."""
    chosen_cost = next(cost for s, _, cost in ranked if s == chosen)
    cheaper = [cost for s, _, cost in ranked if s != chosen
               and cost["total_s"] < chosen_cost["total_s"] - _REL_TOL * max(abs(chosen_cost["total_s"]), 1e-30)]
    if not cheaper:
        return "cost"
    if memory_budget is not None and all(c["memory_bytes"] > chosen_cost["memory_bytes"] for c in cheaper):
        return "memory_budget"
    if status != "Optimal":
        return "time_limit"
    return "coupled"
