"""The choice graph's shortcuts for repeated layers give what each node alone gives."""

from __future__ import annotations

import torch

from autopar.cost.cluster import get_cluster
from autopar.rules import op_info
from autopar.rules.registry import tensor_input_nodes
from autopar.solver.problem import choices
from autopar.trace import trace_repeated
from autopar.zoo.models import build_model, example_batch


def test_op_info_of_layer_copies_is_each_nodes_own():
    """``choices._op_info`` reuses the info of a node whose arguments are the same objects (a
    layer's copies in a graph built by ``trace.repeat``): the same info, under the node's own
    name, and the same tensor inputs, as ``op_info`` and ``tensor_input_nodes`` of that node."""
    traced = trace_repeated(build_model("llama", n_layer=6), example_batch("llama", 4, n_layer=6))
    seen: dict = {}
    nodes = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    for node in nodes:
        info, inputs, kw_text = choices._op_info(node, seen)
        assert info == op_info(node) and info.name == node.name
        assert inputs == tensor_input_nodes(node) and kw_text == repr(info.kw)
    assert len(seen) < len(nodes) / 2  # most nodes are copies: their infos were reused


def test_op_info_tells_apart_a_repeated_argument():
    """Two calls on values that are the same objects differ when one repeats a node the other
    does not: the inputs come from each node's own arguments."""
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    value = torch.ones(2)
    for node in (x, y):
        node.meta["val"] = value
    twice, once = (graph.call_function(torch.ops.aten.mul.Tensor, args) for args in ((x, x), (x, y)))
    for node in (twice, once):
        node.meta["val"] = value
    seen: dict = {}
    assert choices._op_info(twice, seen)[1] == [x, x]
    assert choices._op_info(once, seen)[1] == [x, y]


def test_followers_of_repeated_layers_share_their_lists():
    """Every follower of a repeated layer, getitems included, holds its first-layer
    counterpart's very lists: ``_mark_followers`` cut them once, not once per layer."""
    traced = trace_repeated(build_model("llama", n_layer=6), example_batch("llama", 4, n_layer=6))
    graph = choices.build_choice_graph(traced, (2, 2), get_cluster("cpu"))
    followers = [name for name, template in graph.layer_template.items() if graph.choices[name].follower_of]
    assert any(graph.choices[name].info is None for name in followers)  # getitems among them
    for name in followers:
        assert graph.choices[name].strategies is graph.choices[graph.layer_template[name]].strategies, name


def test_a_replaced_graph_starts_with_its_own_derived_cache():
    """``ChoiceGraph.derived`` holds what later stages compute from one graph's choices and prices
    (``solver.planners.memory_plan``, ``comm_schedule``, ``rounding``); a graph made from it by
    ``dataclasses.replace`` (``stage_costs.per_step_graph``: other prices) must not read it."""
    import dataclasses

    traced = trace_repeated(build_model("gpt", n_layer=2), example_batch("gpt", 2, n_layer=2))
    graph = choices.build_choice_graph(traced, (2,), get_cluster("cpu"))
    graph.derived["param_uses"] = "computed for graph"
    other = dataclasses.replace(graph, edges=list(graph.edges))
    assert other.derived == {} and graph.derived == {"param_uses": "computed for graph"}
