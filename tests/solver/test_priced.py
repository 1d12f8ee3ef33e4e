"""A strategy's prices stay with that strategy (``solver.problem.priced``) through everything that
builds, cuts, follows, forces and reprices a node's strategies.

Each record of a built graph is checked against its strategy priced alone, so a price that
moved to another strategy (a column reordered or cut on its own) fails, as the last test shows.
"""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cost import memory
from autopar.cost.cluster import get_cluster
from autopar.rules.registry import tensor_input_nodes
from autopar.solver.planners.stage_costs import per_step_graph, split_op_costs
from autopar.solver.problem import choices, op_prices
from autopar.solver.problem.priced import PricedStrategy, PriceTable
from autopar.trace import trace_repeated
from autopar.zoo.models import build_model, example_batch

CLUSTER = get_cluster("cpu")
MESH = (2, 2)


def _traced():
    return trace_repeated(build_model("llama", n_layer=3), example_batch("llama", 4, n_layer=3))


def _misplaced(graph: choices.ChoiceGraph, traced) -> list[str]:
    """Where a record's prices are not its own strategy's, priced alone: every field of an op's
    record (``op_prices.price_each`` of that one strategy), a placeholder's output bytes, and a
    getitem's zeros. Returns "node[index]" for each record that differs."""
    nodes = {node.name: node for node in traced.gm.graph.nodes}
    wrong = []
    for name, choice in graph.choices.items():
        node = nodes[name]
        for index, priced in enumerate(choice.priced):
            if choice.info is not None:
                args = (choice.info, node.meta.get("val"), graph.choices, tensor_input_nodes(node), MESH, CLUSTER)
                alone = op_prices.price_each(*args, choice.requires_grad, choice.sync_dtypes, [priced.strategy])[0]
            elif choice.kind == "op":  # a getitem: its producer's spec as it is, at no cost
                alone = PricedStrategy(priced.strategy)
            else:
                outs = priced.strategy.outs
                size = memory.local_bytes(choice.out_shapes[0], choice.out_dtypes[0], outs[0], MESH) if outs else 0
                alone = PricedStrategy(priced.strategy, memory_bytes=float(size))
            if priced != alone:
                wrong.append(f"{name}[{index}]")
    return wrong


def _forced_node(graph: choices.ChoiceGraph) -> tuple[str, object]:
    """A free op, with several strategies, and the output spec of its last strategy, which
    several of its strategies share: forcing it cuts the list from both ends."""
    for name in graph.order:
        choice = graph.choices[name]
        if choice.info is None or choice.follower_of is not None or name in graph.layer_template:
            continue
        spec = choice.strategies[-1].outs[0]
        if 1 < sum(s.outs[0] == spec for s in choice.strategies) < len(choice.strategies):
            return name, spec
    raise AssertionError("no op to force")


def test_every_record_prices_its_own_strategy_after_cutting_following_and_forcing():
    traced = _traced()
    graph = choices.build_choice_graph(traced, MESH, CLUSTER)
    name, spec = _forced_node(graph)
    forced = choices.build_choice_graph(traced, MESH, CLUSTER, forced={name: spec})
    # What the check covers: each way a node's list is cut or taken over.
    assert graph.pruned.impossible > 0
    assert any(c.follower_of and c.info is not None for c in graph.choices.values())  # cut to its producer's specs
    assert any(c.follower_of and c.info is None for c in graph.choices.values())  # getitems
    assert 1 < len(forced.choices[name].priced) < len(graph.choices[name].priced)
    assert all(s.outs[0] == spec for s in forced.choices[name].strategies)
    for built in (graph, forced):
        assert _misplaced(built, traced) == []


def test_cutting_dominated_strategies_keeps_the_others_records_whole(monkeypatch):
    """The zoo's rules rarely offer two strategies of one interface, so each op here is offered,
    before each of its plain strategies, a dearer twin: the same specs, with a kernel that adds
    an all-reduce. Pruning cuts every twin (``pruning.undominated``; the first of a pair goes),
    and leaves the very records the graph has without them."""
    traced = _traced()
    graph = choices.build_choice_graph(traced, MESH, CLUSTER)
    offered = op_prices.node_strategies

    def with_dearer_twins(info, mesh_shape):
        strategies = []
        for strategy in offered(info, mesh_shape):
            if strategy.kernel is None:
                strategies.append(dataclasses.replace(strategy, kernel="cross_entropy_mean", kernel_axes=(0,)))
            strategies.append(strategy)
        return strategies

    monkeypatch.setattr(op_prices, "node_strategies", with_dearer_twins)
    twinned = choices.build_choice_graph(traced, MESH, CLUSTER)
    kept, twins_kept = (c.enumerated - c.impossible - c.dominated for c in (graph.pruned, twinned.pruned))
    assert twinned.pruned.dominated > 1000 and twins_kept == kept
    for name, choice in graph.choices.items():
        assert twinned.choices[name].priced == choice.priced, name
    assert _misplaced(twinned, traced) == []


def test_per_step_prices_stay_with_their_strategies():
    """``stage_costs.per_step_graph`` reprices every record: compute × M less the parameter
    reductions paid once, every other field and the strategy as they were."""
    traced = _traced()
    graph = choices.build_choice_graph(traced, MESH, CLUSTER)
    split = split_op_costs(graph, CLUSTER)
    stepped = per_step_graph(graph, split, 4)
    for name, choice in graph.choices.items():
        sync = split.sync.get(name) or [0.0] * len(choice.priced)
        after = stepped.choices[name].priced
        assert after.strategies is choice.priced.strategies  # the same strategies, in the same order
        for before, now, synced in zip(choice.priced, after, sync, strict=True):
            assert now == dataclasses.replace(before, compute_s=4.0 * (before.compute_s - synced) + synced)


def test_keep_and_repriced_move_whole_records():
    table = PriceTable(
        PricedStrategy(choices.Strategy((), (spec,)), compute_s=float(i), memory_bytes=10.0 * i, backward_s=i / 2)
        for i, spec in enumerate(["a", "b", "c"])
    )
    kept = table.keep([2, 0])
    assert [p is q for p, q in zip(kept, (table[2], table[0]))] == [True, True]
    assert kept.compute_s == (2.0, 0.0) and kept.memory_bytes == (20.0, 0.0)
    assert kept.strategies == (table.strategies[2], table.strategies[0])
    repriced = table.repriced([5.0, 6.0, 7.0])
    assert repriced.strategies is table.strategies and repriced.compute_s == (5.0, 6.0, 7.0)
    assert [p.backward_s for p in repriced] == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        table.repriced([1.0])  # one price per strategy, no fewer


def test_the_check_catches_prices_moved_without_their_strategies():
    """One op's strategies rotated one place against their prices, as a column reordered alone
    would leave them: the check above names every record of that op and nothing else (an op
    whose neighbouring strategies all differ in some price, so no record lands on its own)."""
    traced = _traced()
    graph = choices.build_choice_graph(traced, MESH, CLUSTER)

    def rotated(priced: PriceTable) -> PriceTable:
        strategies = priced.strategies[1:] + priced.strategies[:1]
        return PriceTable(dataclasses.replace(p, strategy=s) for p, s in zip(priced, strategies))

    def all_moved(priced: PriceTable) -> bool:
        return len(priced) > 2 and all(a != b for a, b in zip(rotated(priced), priced[1:] + priced[:1]))

    name = next(n for n in graph.order if graph.choices[n].info is not None and all_moved(graph.choices[n].priced))
    choice = graph.choices[name]
    choice.priced = rotated(choice.priced)
    assert _misplaced(graph, traced) == [f"{name}[{i}]" for i in range(len(choice.priced))]
