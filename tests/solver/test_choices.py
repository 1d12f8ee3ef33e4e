"""The choice graph's shortcuts for repeated layers give what each node alone gives."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost.cluster import get_cluster
from autopar.rules import op_info
from autopar.rules.registry import tensor_input_nodes
from autopar.solver.problem import choices, op_prices
from autopar.trace import trace_repeated
from autopar.zoo.models import build_model, example_batch
from tests.conftest import WideNet, wide_batch


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


def test_followers_of_repeated_layers_share_their_tables():
    """Every follower of a repeated layer, getitems included, holds its first-layer
    counterpart's very table: ``_mark_followers`` cut it once, not once per layer."""
    traced = trace_repeated(build_model("llama", n_layer=6), example_batch("llama", 4, n_layer=6))
    graph = choices.build_choice_graph(traced, (2, 2), get_cluster("cpu"))
    followers = [name for name, template in graph.layer_template.items() if graph.choices[name].follower_of]
    assert any(graph.choices[name].info is None for name in followers)  # getitems among them
    for name in followers:
        assert graph.choices[name].priced is graph.choices[graph.layer_template[name]].priced, name


def test_a_replaced_graph_starts_with_its_own_derived_cache():
    """``ChoiceGraph.derived`` holds what later stages compute from one graph's choices and prices
    (``solver.planners.memory_plan``, ``comm_schedule``, ``rounding``); a graph made from it by
    ``dataclasses.replace`` (``stage_costs.per_step_graph``: other prices) must not read it."""
    import dataclasses

    traced = trace_repeated(build_model("gpt", n_layer=2), example_batch("gpt", 2, n_layer=2))
    graph = choices.build_choice_graph(traced, (2,), get_cluster("cpu"))
    graph.derived["param_uses"] = "computed for graph"
    other = dataclasses.replace(graph, edges=list(graph.edges))
    assert other.derived == {} and graph.derived["param_uses"] == "computed for graph"


def _priced_one_by_one(choice, graph, cluster):
    """A node's compute seconds, output bytes and parameter reductions as the cost model defines
    them, strategy by strategy, with nothing shared between strategies."""
    from autopar.cost import comm, compute, memory

    info, mesh = choice.info, graph.mesh_shape
    rows = []
    for strategy in choice.strategies:
        flops_s, bytes_s, factor = compute.roofline_terms(info, strategy, mesh, cluster, choice.requires_grad)
        seconds = max(flops_s, bytes_s) * factor
        merged = []
        for index, arg in enumerate(info.inputs):
            producer = graph.choices[choice.inputs[index][0]]
            if not producer.requires_grad:
                continue
            dtype = choice.sync_dtypes[index]
            for axis in op_prices.grad_sync_axes(strategy, index):
                spec = strategy.ins[index]
                cost = op_prices.grad_sync_cost(arg, spec, axis, producer.kind == "param", mesh, cluster, dtype)
                seconds += cost.backward_s
                if producer.kind == "param" or dtype is not None:
                    bucketed = comm.param_grad_sync_cost(arg.shape, spec, axis, dtype or arg.dtype, mesh, cluster)
                    merged.append((index, axis, cost.backward_s, bucketed.backward_s))
        kernel = op_prices.kernel_collectives(info, strategy, mesh, choice.requires_grad)
        seconds += comm.collectives_cost(kernel, mesh, cluster)[0]
        out_bytes = sum(
            memory.local_bytes(shape, dtype, spec, mesh)
            for shape, spec, dtype in zip(info.out_shapes, strategy.outs, choice.out_dtypes)
        )
        rows.append((seconds, float(out_bytes), tuple(merged)))
    return rows


def test_strategies_price_as_each_alone_on_three_axes():
    """``op_prices.price_each`` prices what one strategy reads once per op (the roofline per work split,
    an all-reduce and an output's bytes per spec object): the same floats, to the last bit, as
    pricing each strategy on its own, on a 3-axis mesh (axes of two sizes) with a precision
    policy's casts."""
    from autopar.ir.options import PlanOptions
    from autopar.trace import trace

    cluster = get_cluster("cpu")
    model, batch = build_model("llama", n_layer=2), example_batch("llama", 4, n_layer=2)
    traced = trace(model, batch, precision=PlanOptions.from_keywords(precision="bf16-mixed").precision)
    graph = choices.build_choice_graph(traced, (2, 4, 2), cluster)
    checked = 0
    for name in graph.order:
        choice = graph.choices[name]
        if choice.info is None or choice.follower_of is not None or len(choice.strategies) < 2:
            continue
        expected = _priced_one_by_one(choice, graph, cluster)
        assert [(p.compute_s, p.memory_bytes, p.param_syncs) for p in choice.priced] == expected, name
        checked += 1
    assert checked > 20


def test_distinct_specs_are_by_value_in_first_seen_order():
    """Equal specs that are distinct objects count once, at their first place."""
    from torch.distributed.tensor import Replicate, Shard

    first, again, other = (Shard(0), Replicate()), (Shard(0), Replicate()), (Replicate(), Replicate())
    assert first is not again
    assert choices.distinct_specs([other, first, other, again, first]) == [other, first]
    strategies = [choices.Strategy((spec,), (spec,)) for spec in (first, other, again, first)]
    strategies.append(choices.Strategy((other,), (other,), kernel="k"))
    by_input = choices.strategies_by_spec(strategies, False, 0, plain_only=True)
    assert by_input == {first: [0, 2, 3], other: [1]}
    assert list(choices.strategies_by_spec(strategies, True, 0)) == [first, other]
    assert choices.strategies_by_spec(strategies, True, 0)[other] == [1, 4]


def test_a_graphs_peak_is_its_timelines_walked_once_per_sharding(monkeypatch):
    """``ChoiceGraph.peak`` is ``timeline.peak(bytes_of(...))`` to the last bit, for each of several
    shardings, and asked again of one it does not walk again (a budgeted solve asks it of one
    plan several times)."""
    traced = trace_repeated(build_model("gpt", n_layer=2), example_batch("gpt", 2, n_layer=2))
    graph = choices.build_choice_graph(traced, (2,), get_cluster("cpu"))
    shardings = [
        {name: (i + shift) % len(c.strategies) for i, (name, c) in enumerate(graph.choices.items())} for shift in range(3)
    ]
    want = [graph.timeline.peak(graph.bytes_of(choice)) for choice in shardings]
    assert len(set(want)) > 1  # the shardings differ in memory
    assert [graph.peak(choice) for choice in shardings] == want
    walked = []
    monkeypatch.setattr(type(graph.timeline), "peak", lambda self, bytes_of: walked.append(bytes_of))  # asked again: cached
    assert [graph.peak(dict(choice)) for choice in shardings] == want and not walked


def _wide_specs(monkeypatch, padded: bool, mesh: tuple[int, ...], executor: str = "eager") -> dict[str, list[str]]:
    """Each placeholder's specs, as plan text, with ``PADDED_PARAM_SHARDS`` set to ``padded``, priced
    for ``executor``."""
    import dataclasses

    from autopar.ir import spec as spec_module
    from autopar.ir.spec import format_spec
    from autopar.trace import trace

    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", padded)
    batch = (torch.randn(6, 64), torch.randint(0, 2, (6,)))
    traced = trace(WideNet(), batch)
    graph = choices.build_choice_graph(traced, mesh, dataclasses.replace(get_cluster("cpu"), executor=executor))
    return {
        c.fqn: ["".join(format_spec(s.outs[0])) for s in c.strategies]
        for c in graph.choices.values()
        if c.kind in ("param", "buffer")
    }


def test_parameters_may_be_padded_shards_behind_the_flag_and_buffers_never(monkeypatch):
    off = _wide_specs(monkeypatch, False, (3,))
    assert all(specs == ["R"] for specs in off.values()), off
    on = _wide_specs(monkeypatch, True, (3,))
    assert on["up.weight"] == ["R", "S(0)"] and on["down.weight"] == ["R", "S(0)"] and on["down.bias"] == ["R", "S(0)"]
    assert on["scale"] == ["R"], "a buffer is read whole by its ops: never padded"
    # two axes larger than 1: padded on the axis that divides no dim, replicated or an even cut of
    # another dim on the other (HSDP's and FSDP + TP's layouts), never a second cut of dim 0
    two = _wide_specs(monkeypatch, True, (2, 3))
    assert {"RS(0)", "S(1)S(0)", "S(0)R"} <= set(two["up.weight"]) and "S(0)S(0)" not in two["up.weight"], two["up.weight"]
    # a plan priced for inductor (compile's or plan's compiler="inductor"): its traced gathers are unpadded
    compiled = _wide_specs(monkeypatch, True, (3,), executor="inductor")
    assert all(specs == ["R"] for specs in compiled.values()), compiled


def test_a_padded_shard_moves_by_its_own_gather_on_a_mesh_priced_through_the_hub():
    """On three axes larger than 1 an edge's table holds near pairs and a route through the
    replicated spec (``edges.EdgePrices.hub``); a padded shard has no such route (the runtime
    gathers it on its own axis only), so a plan that holds one prices and names only pairs it runs."""
    from autopar.ir.options import PlanOptions
    from autopar.ir.spec import padded_axis
    from autopar.solver.planners.sharding import solve
    from autopar.trace import trace

    mesh = (3, 2, 2)
    traced = trace(WideNet(), wide_batch(0))
    graph = choices.build_choice_graph(traced, mesh, get_cluster("cpu"))
    weight = graph.choices["p_up_weight"]
    padded = [s.outs[0] for s in weight.strategies if padded_axis((64, 64), s.outs[0], mesh) is not None]
    assert (Shard(0), Replicate(), Shard(1)) in padded, padded
    edges = [edge for edge in graph.edges if edge.producer == "p_up_weight"]
    assert edges and all(edge.price.hub is not None for edge in edges)
    for edge in edges:
        assert not set(padded) & set(edge.price.hub[0]), "no route through the replicated spec"
    pinned = {"p_up_weight": (Shard(0), Replicate(), Shard(1)), "p_down_weight": (Replicate(), Shard(0), Replicate())}
    plan = solve(traced, mesh, get_cluster("cpu"), PlanOptions(), forced=pinned)
    assert plan.params["up.weight"] == (Shard(0), Replicate(), Shard(1))
    assert plan.params["down.weight"] == (Replicate(), Shard(0), Replicate())


def test_the_solver_plans_fsdp_with_padded_shards_under_a_tight_budget(monkeypatch):
    """A Llama 256 wide (hidden 512, vocab 1000) on 3 ranks: no dim divides, so without padded
    shards every parameter stays whole and 70% of its replicated state is infeasible; with them
    the solver shards parameters padded, and the prediction counts ceil(n / 3) rows a rank."""
    import pytest

    import autopar
    from autopar.errors import InfeasibleError
    from autopar.ir import spec as spec_module

    with torch.device("meta"):
        model = build_model("llama", n_embd=256, n_layer=4, n_head=4, n_kv_head=4, vocab_size=1000, hidden=512)
    batch = example_batch("llama", batch_size=6, seq_len=32, vocab_size=1000)
    params = dict(model.named_parameters())
    budget = 0.7 * 16 * sum(p.numel() for p in params.values())  # fp32 param, grad, 2 AdamW states
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", False)
    with pytest.raises(InfeasibleError):
        autopar.plan(model, (3,), example_inputs=batch, cluster="cpu", memory_budget=budget, checkpointing=False)
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", True)
    plan = autopar.plan(model, (3,), example_inputs=batch, cluster="cpu", memory_budget=budget, checkpointing=False)
    assert plan.predicted.peak_memory_bytes <= budget
    sharded = {fqn for fqn, spec in plan.params.items() if spec != (Replicate(),)}
    assert sharded and all(plan.params[fqn] == (Shard(0),) for fqn in sharded), plan.params
    assert all(params[fqn].shape[0] % 3 for fqn in sharded), "every shard here is padded"
    rows = {fqn: -(-p.shape[0] // 3) if fqn in sharded else p.shape[0] for fqn, p in params.items()}  # ceil(n / 3)
    state = sum(2 * 4 * rows[fqn] * p[0].numel() for fqn, p in params.items())
    assert plan.predicted.memory_at_peak_bytes["optimizer_state"] == state


def test_an_infeasible_budget_names_the_mesh_axis_that_cannot_split_the_largest_parameters(monkeypatch):
    """On (3, 2), axis 0 divides no dim of a 64-wide net, and without padded shards (a plan for
    inductor, whose traced gathers are unpadded): the error says so, and how to let them shard."""
    import pytest

    import autopar
    from autopar.errors import InfeasibleError
    from autopar.ir import spec as spec_module

    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", False)  # as a plan for inductor is priced
    for checkpointing in (False, True):  # the sharding's own error, and the memory planner's
        with pytest.raises(InfeasibleError, match=r"Mesh axis 0 \(3 ranks\) divides no dim of up\.weight.*powers of two"):
            autopar.plan(WideNet(), (3, 2), example_inputs=wide_batch(0), cluster="cpu", memory_budget=4096,
                         checkpointing=checkpointing)  # fmt: skip
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", True)
    for mesh in ((6,), (3, 2)):  # padded shards split them on any axis: no such line
        with pytest.raises(InfeasibleError) as caught:
            autopar.plan(WideNet(), mesh, example_inputs=wide_batch(0), cluster="cpu", memory_budget=1024)
        assert "divides no dim" not in str(caught.value), mesh
