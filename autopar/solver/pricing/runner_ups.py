"""Why the solver chose what it chose: each decision's runner-up strategies and their costs.

A *decision* is one block of ILP variables: a free node, together with every node that shares
its variables (the same node in later repeated layers, tied parameter names) and every follower
whose strategy is a function of theirs. For each decision this module prices the counterfactual
"this decision takes strategy s, everything else stays as solved": the same objective terms the
ILP sums (compute and gradient sync of every member, resharding on every edge that touches a
member), split into parts, plus the memory the ILP counts for the members. Where the ILP prices
the communication the runtime overlaps (``problem.gather_overlap``: a term of the whole plan, not
a sum over nodes), a counterfactual also prices how that term changes (``overlap_s``).

The plan stores the chosen strategy and the ``top_k`` cheapest others, so ``autopar explain``
needs neither the model nor a re-solve. The numbers are exact for the choice graph that was
solved, and deterministic (ties are broken by strategy index).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from autopar.cost import comm
from autopar.cost.cluster import ClusterSpec
from autopar.ir.spec import format_spec
from autopar.solver.problem.choices import ChoiceGraph
from autopar.solver.problem.edges import EdgePrices
from autopar.solver.problem.ilp import Solution
from autopar.solver.problem.op_prices import grad_sync_axes, grad_sync_cost, kernel_collectives

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
    overlap = _SolvedOverlap.of(graph, solution, groups)
    for rep, base in _decision_bases(graph).items():
        choice = graph.choices[rep]
        if len(choice.strategies) < 2:
            continue
        members = _members(base, followers)
        ordered = sorted(members, key=position.__getitem__)
        decision = _Decision(graph, solution, base, ordered, edges_of, groups, memo, overlap)
        costs = decision.costs(len(choice.strategies))
        chosen = solution.choice[rep]
        ranked = costs.ranked(chosen)
        candidates = [_candidate(graph, rep, s, decision, costs.record(s), s == chosen, memo) for s in ranked[: top_k + 1]]
        decisions[rep] = {
            "members": ordered,
            "fqns": [graph.choices[n].fqn for n in ordered if graph.choices[n].fqn],
            "num_strategies": len(choice.strategies),
            "num_impossible": len(choice.strategies) - len(ranked),
            "binding": _binding(costs, chosen, memory_budget, solution.status),
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
        self.codes: dict[tuple, np.ndarray] = {}  # (pricer, strategy list, side, index) → spec code per strategy
        self.group_users: dict[int, tuple[dict, dict]] = {}  # ``groups_used_by``, by the groups' id
        self.spec_codes: dict[tuple[int, int], int] = {}  # (pricer, spec object) → code: an op's equal specs are one object

    def codes_of(self, coder: Callable, name: str, side: str, index: int) -> np.ndarray:
        """``coder``'s code of each strategy's spec of node ``name``'s output (``side`` "out")
        or input ``index``, -1 until asked (``_codes``); one array per strategy list (identical
        ops share theirs). One pricer numbers every hub table's specs (``edges.price_edges``)."""
        strategies = self.graph.choices[name].strategies
        key = (id(getattr(coder, "__self__", coder)), id(strategies), side, index)
        codes = self.codes.get(key)
        if codes is None:
            codes = self.codes[key] = np.full(len(strategies), -1, dtype=np.int64)
        return codes

    def groups_used_by(self, groups: dict) -> dict[str, list[int]]:
        """Consumer → the positions in ``groups`` (``choices.param_sync_groups``) of the groups
        it uses, in order; once per dict (the caller holds it)."""
        held = self.group_users.get(id(groups))
        if held is None:
            found: dict[str, list[int]] = {}
            for position, group in enumerate(groups.values()):
                for consumer, _ in group.uses:
                    positions = found.setdefault(consumer, [])
                    if not positions or positions[-1] != position:
                        positions.append(position)
            held = self.group_users[id(groups)] = (found, groups)  # ``groups`` held: its id is not reused
        return held[0]

    def cls(self, name: str) -> str:
        return self.template.get(name, name)

    def edge_class(self, edge, members: set[str]) -> tuple:
        """(edge, its class: price table, out index and in index and both ends' classes, whether
        it enters the decision): what of a touching edge does not depend on the strategy."""
        return (
            edge,
            (id(edge.price), self.cls(edge.producer), edge.out_index, self.cls(edge.consumer), edge.in_index),
            edge.consumer in members,
        )

    def inputs_key(self, name: str) -> tuple:
        """What a member's gradient all-reduces depend on beyond its class and strategy."""
        choice = self.graph.choices[name]
        return tuple(
            (self.graph.choices[p].requires_grad, self.graph.choices[p].kind, tuple(arg.shape), arg.dtype)
            for (p, _), arg in zip(choice.inputs, choice.info.inputs)
        )


@dataclass(frozen=True)
class _SolvedOverlap:
    """The solved plan's terms of the communication the runtime overlaps
    (``problem.gather_overlap``): a term of the whole plan, not a sum over nodes, so each
    counterfactual prices it anew from these sums, swapping its own members' parts in
    (``_Decision._overlap_s``). ``items``: the gathered parameters' terms by their edge."""

    items: dict[int, Any]
    delta_s: float
    forward_s: float
    backward_s: float
    sync_s: float

    @classmethod
    def of(cls, graph: ChoiceGraph, solution: Solution, groups: dict) -> _SolvedOverlap | None:
        overlap = graph.overlap
        if overlap is None:
            return None
        sums = overlap.sums(solution.edge_specs)  # as the plan's own ``overlap_s`` reads them
        return cls({item.edge: item for item in overlap.items}, *sums, overlap.hidden_sync_s(groups, solution.choice))


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


@dataclass(frozen=True)
class Costs:
    """A decision's counterfactuals (``_Decision.costs``), one entry per strategy: the terms of
    the objective its members cost when the decision takes it, everything else as solved, and
    whether every resharding it asks for is possible."""

    compute_s: np.ndarray
    param_sync_merge_s: np.ndarray
    reshard_in_s: np.ndarray
    reshard_out_s: np.ndarray
    memory_bytes: np.ndarray
    total_s: np.ndarray
    possible: np.ndarray
    # The optimizer step of the members' shards (``ChoiceGraph.optimizer_s``), and DTensor's
    # dispatch where the decision alone decides it (``_Decision._optimizer_s``); None: neither.
    optimizer_s: np.ndarray | None = None
    # What the communication the runtime overlaps (``problem.gather_overlap``) adds against the
    # solved plan (0 for the chosen strategy: ``_Decision._overlap_s``); None: no overlap priced.
    overlap_s: np.ndarray | None = None

    def record(self, s: int) -> dict[str, float]:
        """Strategy ``s``'s terms by name (its ``total_s`` their sum, in this order)."""
        return {
            "compute_s": float(self.compute_s[s]),
            "param_sync_merge_s": float(self.param_sync_merge_s[s]),
            "reshard_in_s": float(self.reshard_in_s[s]),
            "reshard_out_s": float(self.reshard_out_s[s]),
            "memory_bytes": float(self.memory_bytes[s]),
            **({"optimizer_s": float(self.optimizer_s[s])} if self.optimizer_s is not None else {}),
            **({"overlap_s": float(self.overlap_s[s])} if self.overlap_s is not None else {}),
            "total_s": float(self.total_s[s]),
        }

    def ranked(self, chosen: int) -> list[int]:
        """The possible strategies, ``chosen`` first, then by total, ties by index."""
        strategies = np.flatnonzero(self.possible)
        order = np.lexsort((strategies, self.total_s[strategies], strategies != chosen))
        return strategies[order].tolist()


class _Decision:
    """One decision's members grouped into *slots*, so that pricing its counterfactuals costs the
    number of distinct members, not of members (a decision over 80 copies of a layer has about
    as many slots as one over 2). Members share a slot when they take the same strategy index
    whatever the decision takes: the base nodes of one class (``_Memo.cls``), and the followers
    of one class that read one output of producers of one class in one slot. Their terms are
    then equal (their strategy lists and prices are, by ``choices.repeated_layers``), and one
    member per slot prices them. The sums still add every member's term, in graph order
    (``_in_order``), so every number is the one a member-by-member loop gives, to the last bit."""

    def __init__(
        self,
        graph: ChoiceGraph,
        solution: Solution,
        base: set[str],
        ordered: list[str],
        edges_of: dict[str, list[int]],
        groups: dict,
        memo: _Memo,
        overlap: _SolvedOverlap | None = None,
    ):
        self.graph, self.solution, self.memo, self.overlap = graph, solution, memo, overlap
        self.chosen = solution.choice[next(iter(base))]  # the base nodes share their variables
        self.slot_of: dict[str, int] = {}
        self.reps: list[str] = []  # per slot: its first member, which prices it
        # per slot: None for base nodes (they take the decision's strategy), else the follow
        # memo's key without the producer's index, and the producer's slot
        self.follows: list[tuple[tuple, int] | None] = []
        slots: dict[tuple, int] = {}
        for name in ordered:
            if name in base:
                key, follow = ("base", memo.cls(name)), None
            else:
                producer, out_index = graph.choices[name].inputs[0]
                follow = ((memo.cls(name), memo.cls(producer), out_index), self.slot_of[producer])
                key = follow
            if key not in slots:
                slots[key] = len(self.reps)
                self.reps.append(name)
                self.follows.append(follow)
            self.slot_of[name] = slots[key]
        self.columns = np.array([self.slot_of[name] for name in ordered], dtype=np.intp)
        touching = sorted({e for name in ordered for e in edges_of.get(name, ())})
        self._slot_edges(touching)
        # The gathered parameters' edges among them (``_overlap_s``), each with its edge slot.
        items = overlap.items if overlap is not None else {}
        self.gathered = [(items[e], column) for e, column in zip(touching, self.edge_columns.tolist()) if e in items]
        # Parameter reductions (``choices.param_sync_groups``): the members' per-use prices, and
        # the groups a member may need (the others cannot change with it).
        _, refunds = graph.param_sync_groups()
        self.refunds = [(self.slot_of[name], refunds[name]) for name in ordered if name in refunds]
        self.synced = _synced_groups(groups, self.slot_of, solution, memo.groups_used_by(groups), graph.overlap)
        # What a member's gradient all-reduces and kernel collectives depend on beyond its slot.
        inner: dict[tuple, int] = {}
        self.inner_reps: list[str] = []
        inner_columns = []
        for name in ordered:
            choice = graph.choices[name]
            key = (self.slot_of[name], choice.requires_grad, memo.inputs_key(name) if choice.info is not None else None)
            if key not in inner:
                inner[key] = len(self.inner_reps)
                self.inner_reps.append(name)
            inner_columns.append(inner[key])
        self.inner_columns = inner_columns
        self.indices: list[list[int]] = []
        # Whether a parameter outside the decision is sharded as solved: then the plan holds
        # DTensors whatever the decision takes (``ChoiceGraph.dtensor_step_s``).
        self.dtensors_outside = any(
            _sharded(choice, solution.choice[name])
            for name, choice in graph.choices.items()
            if choice.kind == "param" and name not in self.slot_of
        )

    def _slot_edges(self, touching: list[int]) -> None:
        """``edges`` and ``edge_columns``: per touching edge, what does not depend on the
        strategy: its class, whether it enters the decision, and its ends, each a member's slot or
        a node outside at its solved index. Edges alike in all of these price alike: one per edge
        slot prices them."""
        graph, memo, choice = self.graph, self.memo, self.solution.choice
        members = self.slot_of.keys()
        self.edges: list[tuple] = []  # per edge slot: (edge, class, enters, src slot, src index, dst slot, dst index)
        edge_slots: dict[tuple, int] = {}
        edge_columns = []
        for e in touching:
            edge, edge_class, enters = memo.edge_class(graph.edges[e], members)
            src_slot, dst_slot = self.slot_of.get(edge.producer), self.slot_of.get(edge.consumer)
            key = (
                edge_class,
                enters,
                src_slot,
                choice[edge.producer] if src_slot is None else None,
                dst_slot,
                choice[edge.consumer] if dst_slot is None else None,
            )
            if key not in edge_slots:
                edge_slots[key] = len(self.edges)
                self.edges.append((edge, *key))
            edge_columns.append(edge_slots[key])
        self.edge_columns = np.array(edge_columns, dtype=np.intp)

    def price(self, num_strategies: int) -> list[dict[str, float] | None]:
        """Per strategy of the decision: seconds and bytes the members cost when it takes that
        strategy, everything else as solved (``Costs.record``); None if a resharding is impossible."""
        costs = self.costs(num_strategies)
        return [costs.record(s) if costs.possible[s] else None for s in range(num_strategies)]

    def costs(self, num_strategies: int) -> Costs:
        """``price`` of every strategy at once, as arrays. Keeps each strategy's slot indices for
        ``member_sum``."""
        graph = self.graph
        self.indices = index = self._index_table(num_strategies)
        choices = [graph.choices[rep] for rep in self.reps]
        compute = np.empty(index.shape)
        memory = np.empty(index.shape)
        for slot, choice in enumerate(choices):
            compute[:, slot] = np.asarray(choice.priced.compute_s, dtype=float)[index[:, slot]]
            memory[:, slot] = np.asarray(choice.priced.memory_bytes, dtype=float)[index[:, slot]]
        seconds, possible = self._reshard_s(index)
        enters = np.array([edge[2] for edge in self.edges], dtype=bool)
        compute_s, memory_bytes = _in_order(compute, self.columns), _in_order(memory, self.columns)
        reshard_in_s = _in_order(np.where(enters, seconds, 0.0), self.edge_columns)
        reshard_out_s = _in_order(np.where(enters, 0.0, seconds), self.edge_columns)
        # per reduction group a member uses, the strategies that need it (None: needed as solved, outside)
        needed = [None if outside else self._needed(index, uses) for _, outside, uses, _ in self.synced]
        merged = self._merged_s(index, needed)
        total_s = compute_s + merged + reshard_in_s + reshard_out_s
        optimizer_s = self._optimizer_s(index)
        if optimizer_s is not None:
            total_s = total_s + optimizer_s
        overlap_s = self._overlap_s(index, needed)
        if overlap_s is not None:
            total_s = total_s + overlap_s
        return Costs(compute_s, merged, reshard_in_s, reshard_out_s, memory_bytes, total_s, possible, optimizer_s, overlap_s)

    def _optimizer_s(self, index: np.ndarray) -> np.ndarray | None:
        """Per strategy, the optimizer step of the members that are parameters it steps, in
        member order (``_in_order``), and DTensor's dispatch where the strategy alone decides
        whether the plan holds DTensors; None where there are none."""
        graph = self.graph
        steps = [graph.optimizer_s.get(rep) for rep in self.reps]
        params = [slot for slot, rep in enumerate(self.reps) if graph.choices[rep].kind == "param"]
        dispatch = bool(graph.dtensor_step_s and params and not self.dtensors_outside)
        if all(step is None for step in steps) and not dispatch:
            return None
        seconds = np.zeros(index.shape)
        for slot, step in enumerate(steps):
            if step is not None:
                seconds[:, slot] = np.asarray(step, dtype=float)[index[:, slot]]
        total = _in_order(seconds, self.columns)
        if dispatch:
            sharded = np.zeros(len(index), dtype=bool)
            for slot in params:
                choice = graph.choices[self.reps[slot]]
                flags = np.array([_sharded(choice, s) for s in range(len(choice.strategies))], dtype=bool)
                sharded |= flags[index[:, slot]]
            total = total + np.where(sharded, graph.dtensor_step_s, 0.0)
        return total

    def _merged_s(self, index: np.ndarray, needed: list[np.ndarray | None]) -> np.ndarray:
        """Per strategy, the parameter reductions' change: they run once per parameter, so the
        members' per-use prices give way to each group a member uses, priced once (a ``+=``
        per term, in order, for all strategies at once). ``needed``: ``costs``'."""
        refunded = np.zeros(len(index))
        for slot, refund in self.refunds:
            refunded += np.asarray(refund, dtype=float)[index[:, slot]]
        merged = -refunded
        for (total_s, _, _, _), wanted in zip(self.synced, needed):
            if wanted is None:
                merged += total_s
                continue
            merged[wanted] += total_s
        return merged

    def _needed(self, index: np.ndarray, uses: list[tuple[int, Any]]) -> np.ndarray:
        """Per strategy, whether one of a reduction group's member ``uses`` (``_synced_groups``) needs it."""
        needed = np.zeros(len(index), dtype=bool)
        for slot, wanted in uses:
            wants = np.zeros(len(self.graph.choices[self.reps[slot]].strategies), dtype=bool)
            wants[list(wanted)] = True
            needed |= wants[index[:, slot]]
        return needed

    def _overlap_s(self, index: np.ndarray, needed: list[np.ndarray | None]) -> np.ndarray | None:
        """Per strategy, what ``gather_overlap``'s term of the whole plan changes against the
        solved plan's: the members' gathered edges and the reductions they need (``needed``:
        ``costs``') swapped into its sums (``_SolvedOverlap``), then priced as the ILP prices
        the term; None where there is none (gloo, three axes, nothing gathered)."""
        if self.overlap is None:
            return None
        graph, count = self.graph, len(index)
        delta, forward, backward, sync = (np.zeros(count) for _ in range(4))
        for item, column in self.gathered:
            edge, _, _, src_slot, src_index, dst_slot, dst_index = self.edges[column]
            src = index[:, src_slot] if src_slot is not None else np.full(count, src_index)
            dst = index[:, dst_slot] if dst_slot is not None else np.full(count, dst_index)
            outs, ins = graph.choices[edge.producer].strategies, graph.choices[edge.consumer].strategies
            found: dict[tuple[int, int], tuple[float, float, float]] = {}
            for k, pair in enumerate(zip(src.tolist(), dst.tolist())):
                if pair not in found:
                    found[pair] = item.parts((outs[pair[0]].outs[edge.out_index], ins[pair[1]].ins[edge.in_index]))
                delta[k] += found[pair][0]
                forward[k] += found[pair][1]
                backward[k] += found[pair][2]
        for (_, _, _, hidden_s), wanted in zip(self.synced, needed):
            if wanted is not None:  # (one needed as solved whatever the decision takes stays in the sums)
                sync[wanted] += hidden_s
        solved, c = self.overlap, self.chosen
        priced = graph.overlap.combined(
            solved.delta_s - delta[c] + delta,
            solved.forward_s - forward[c] + forward,
            solved.backward_s - backward[c] + backward,
            solved.sync_s - sync[c] + sync,
        )
        return priced - priced[c]

    def _reshard_s(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Resharding seconds per (strategy, edge slot) when the slots take ``index`` (0.0
        where the spec does not change), and whether each strategy's are all possible. Edge
        slots are priced in order, each for the strategies that every earlier one allows, and
        each distinct (src, dst) of a slot once: the pairs a strategy-by-strategy walk that
        stops at the first impossible edge prices."""
        num_strategies = len(index)
        seconds = np.zeros((num_strategies, len(self.edges)))
        alive = np.arange(num_strategies)
        for e, (edge, edge_class, _, src_slot, src_index, dst_slot, dst_index) in enumerate(self.edges):
            if not len(alive):
                break
            src = index[alive, src_slot] if src_slot is not None else np.full(len(alive), src_index)
            dst = index[alive, dst_slot] if dst_slot is not None else np.full(len(alive), dst_index)
            inverse, found = _edge_prices(self.memo, edge, edge_class, src, dst)
            possible = np.array([price is not None for price in found], dtype=bool)
            values = np.array([0.0 if price is None or price is False else price[0] for price in found])
            seconds[alive, e] = values[inverse]
            alive = alive[possible[inverse]]
        possible = np.zeros(num_strategies, dtype=bool)
        possible[alive] = True
        return seconds, possible

    def _index_table(self, num_strategies: int) -> np.ndarray:
        """Strategy index of each slot (a column) when the decision takes each strategy (a row)."""
        graph, memo = self.graph, self.memo
        index = np.empty((num_strategies, len(self.reps)), dtype=np.intp)
        for slot, (rep, follow) in enumerate(zip(self.reps, self.follows)):
            if follow is None:
                index[:, slot] = np.arange(num_strategies)
                continue
            prefix, producer_slot = follow
            producer_index = index[:, producer_slot]
            values = np.unique(producer_index)
            found = []
            for value in values.tolist():
                key = (*prefix, value)
                follows = memo.follow.get(key)
                if follows is None:
                    producer, out_index = graph.choices[rep].inputs[0]
                    spec = graph.choices[producer].strategies[value].outs[out_index]
                    follows = memo.follow[key] = _index_by_input(graph.choices[rep].strategies, memo.by_input)[spec]
                found.append(follows)
            index[:, slot] = np.array(found, dtype=np.intp)[np.searchsorted(values, producer_index)]
        return index

    def member_sum(self, term: Callable[[_Memo, str, int], float], s: int) -> float:
        """``sum`` of ``term(memo, member, its index)`` over the members in graph order when the
        decision takes strategy ``s`` (``_grad_sync_s``, ``_kernel_comm_s``: terms that depend
        on a member's class, index and ``_Memo.inputs_key``)."""
        index = self.indices[s].tolist()
        values = [term(self.memo, rep, index[self.slot_of[rep]]) for rep in self.inner_reps]
        return sum(map(values.__getitem__, self.inner_columns))


def _in_order(values: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Per row of ``values`` (a strategy's term per slot): 0.0 plus the term of each member
    (``columns``: their slots, in graph order) added left to right, as a ``+=`` loop adds them.
    ``np.add.accumulate`` never reorders the additions (``np.sum`` adds pairwise)."""
    terms = np.zeros((len(values), len(columns) + 1))
    terms[:, 1:] = values.reshape(len(values), -1)[:, columns]
    return np.add.accumulate(terms, axis=1)[:, -1]


def _index_by_input(strategies: list, cache: dict[int, dict]) -> dict:
    """First strategy index per input spec of a follower's strategy list (identical ops share
    one list, so this is computed once per distinct list while ``cache`` lives)."""
    index = cache.get(id(strategies))
    if index is None:
        index = cache[id(strategies)] = {}
        for i, strategy in enumerate(strategies):
            index.setdefault(strategy.ins[0], i)
    return index


def _edge_prices(memo: _Memo, edge, edge_class: tuple, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, list]:
    """An edge's prices between its ends' strategies ``src[k]`` and ``dst[k]``: the distinct
    ones, each (seconds, bytes), False where the spec does not change or None where the change
    is impossible, and per k which. A table whose pricer numbers specs is asked once per pair
    of codes (equal codes, equal specs), all together (``EdgePrices.get_coded_many``); another
    once per pair of strategies (``_Memo.edge``)."""
    coder = edge.price.coder() if isinstance(edge.price, EdgePrices) else None
    src_keys, dst_keys = src, dst
    if coder is not None:
        src_keys = _codes(memo, coder, edge.producer, "out", edge.out_index, src)
        dst_keys = _codes(memo, coder, edge.consumer, "in", edge.in_index, dst)
    width = int(dst_keys.max()) + 1
    first, inverse = _distinct(src_keys * width + dst_keys)
    if coder is not None:  # the pairs that change spec priced together, by their codes
        pairs = list(zip(src_keys[first].tolist(), dst_keys[first].tolist()))
        asked = [pair for pair in pairs if pair[0] != pair[1]]
        prices = dict(zip(asked, edge.price.get_coded_many(asked)))
        return inverse, [False if src_code == dst_code else prices[(src_code, dst_code)] for src_code, dst_code in pairs]
    producer, consumer = memo.graph.choices[edge.producer].strategies, memo.graph.choices[edge.consumer].strategies
    found = []
    for k in first:
        src_index, dst_index = int(src[k]), int(dst[k])
        src_spec, dst_spec = producer[src_index].outs[edge.out_index], consumer[dst_index].ins[edge.in_index]
        key = (edge_class, src_index, dst_index)
        price = memo.edge.get(key, True)
        if price is True:
            price = memo.edge[key] = False if src_spec == dst_spec else edge.price.get((src_spec, dst_spec))
        found.append(price)
    return inverse, found


def _distinct(keys: np.ndarray) -> tuple[list[int], np.ndarray]:
    """Where each distinct key of ``keys`` first occurs, in increasing order of key, and per
    key the number of its distinct one (``np.unique``; a few keys, as on a 2-axis mesh, in
    Python, where numpy's calls cost more than the work)."""
    if len(keys) > 16:
        _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        return first.tolist(), inverse.reshape(-1)
    listed = keys.tolist()
    firsts: dict[int, int] = {}
    for k, key in enumerate(listed):
        firsts.setdefault(key, k)
    ordered = sorted(firsts)
    number = {key: n for n, key in enumerate(ordered)}
    return [firsts[key] for key in ordered], np.array([number[key] for key in listed], dtype=np.intp)


def _codes(memo: _Memo, coder: Callable, name: str, side: str, index: int, strategies: np.ndarray) -> np.ndarray:
    """``coder``'s code of the spec of node ``name``'s output or input ``index`` (``side``) in
    each of ``strategies`` (indices): once per strategy (``_Memo.codes_of``), and once per spec
    object (``_Memo.spec_codes``; the graph holds them all, so no id is reused)."""
    codes = memo.codes_of(coder, name, side, index)
    unknown = codes[strategies] < 0
    if unknown.any():
        missing = np.unique(strategies[unknown])
        listed, pricer = memo.graph.choices[name].strategies, id(getattr(coder, "__self__", coder))
        for s in missing.tolist():
            spec = listed[s].outs[index] if side == "out" else listed[s].ins[index]
            code = memo.spec_codes.get((pricer, id(spec)))
            if code is None:
                code = memo.spec_codes[(pricer, id(spec))] = coder(spec)
            codes[s] = code
    return codes[strategies]


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
    context-parallel attention's K/V gathers and row exchanges: ``op_prices.kernel_collectives``)."""
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


def _candidate(graph, rep, s, decision: _Decision, cost, chosen, memo: _Memo) -> dict[str, Any]:
    strategy = graph.choices[rep].strategies[s]
    grad_sync_s = decision.member_sum(_grad_sync_s, s)
    kernel_comm_s = decision.member_sum(_kernel_comm_s, s)
    record: dict[str, Any] = {"strategy": s}
    if chosen:
        record["chosen"] = True
    record.update(
        {
            "out": [format_spec(spec) for spec in strategy.outs],
            "in": [format_spec(spec) for spec in strategy.ins],
            "compute_s": cost["compute_s"] - grad_sync_s - kernel_comm_s,
            "grad_sync_s": grad_sync_s + cost["param_sync_merge_s"],
            "reshard_in_s": cost["reshard_in_s"],
            "reshard_out_s": cost["reshard_out_s"],
            "total_s": cost["total_s"],
            "memory_bytes": int(cost["memory_bytes"]),
        }
    )
    if "optimizer_s" in cost:
        record["optimizer_s"] = cost["optimizer_s"]
    if "overlap_s" in cost:
        record["overlap_s"] = cost["overlap_s"]
    if strategy.kernel:
        record["kernel"] = strategy.kernel
        record["kernel_axes"] = list(strategy.kernel_axes)
    if kernel_comm_s:
        record["kernel_comm_s"] = kernel_comm_s
    return record


def _sharded(choice, s: int) -> bool:
    """Whether strategy ``s`` of a parameter's ``choice`` shards it on some mesh axis."""
    return not all(p.is_replicate() for p in choice.strategies[s].outs[0])


def _binding(costs: Costs, chosen: int, memory_budget: float | None, status: str) -> str:
    """Which constraint decided: ``cost`` when the chosen strategy is the cheapest priced one;
    ``memory_budget`` when every cheaper one needs more memory under a budget; ``time_limit``
    when the solver stopped before proving optimality; ``coupled`` otherwise (a cheaper change
    exists only for this decision alone, which an optimal solve rules out; kept as a guard)."""
    assert costs.possible[chosen], "the solved strategy of a decision is always possible"
    chosen_s = float(costs.total_s[chosen])
    cheaper = costs.possible & (costs.total_s < chosen_s - _REL_TOL * max(abs(chosen_s), 1e-30))
    cheaper[chosen] = False
    if not cheaper.any():
        return "cost"
    if memory_budget is not None and bool(np.all(costs.memory_bytes[cheaper] > costs.memory_bytes[chosen])):
        return "memory_budget"
    if status != "Optimal":
        return "time_limit"
    return "coupled"


def _synced_groups(
    groups: dict, slot_of: dict[str, int], solution: Solution, used_by: dict[str, list[int]], overlap=None
) -> list[tuple]:
    """Per parameter-reduction group a member (a key of ``slot_of``) uses: its seconds, whether a
    use outside the decision needs it (as solved: then always), the members' uses, (slot, the
    strategies that need it): ``needed`` in parts, and the seconds of it that ``overlap``
    (``ChoiceGraph.overlap``) lets backward hide (0 without one). ``used_by``: ``_Memo.groups_used_by``."""
    positions = sorted({position for name in slot_of for position in used_by.get(name, ())})
    listed = list(groups.values())
    return [
        (
            group.total_s,
            any(solution.choice[consumer] in wanted for (consumer, _), wanted in group.uses.items() if consumer not in slot_of),
            [(slot_of[consumer], wanted) for (consumer, _), wanted in group.uses.items() if consumer in slot_of],
            overlap.hidden_s(group) if overlap is not None else 0.0,
        )
        for group in map(listed.__getitem__, positions)
    ]
