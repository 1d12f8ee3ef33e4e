"""The collectives are traceable: dynamo captures them with no graph break, as functional
collectives, forward and backward (one process, a world of one over gloo)."""

from __future__ import annotations

import pytest
import torch

from autopar.ops import collectives


@pytest.fixture(scope="module")
def world_of_one(world_of_one):
    """tests/conftest.py's group, with its size and rank remembered for traced collectives."""
    collectives.remember_groups([world_of_one])
    return world_of_one


def _graphs(fn, *args):
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    return explained


@pytest.mark.parametrize(
    "op",
    [
        "all_gather",
        "chunk",
        "reduce_scatter",
        "all_to_all",
        "allreduce_grad",
        "all_reduce",
        "gather_param",
        "gather_param_resharded",
    ],
)
def test_each_collective_traces_without_a_graph_break(world_of_one, op):
    group = world_of_one
    calls = {
        "all_gather": lambda x: collectives.all_gather(x, 0, group),
        "chunk": lambda x: collectives.chunk(x, 1, group),
        "reduce_scatter": lambda x: collectives.reduce_scatter(x, 0, group),
        "all_to_all": lambda x: collectives.all_to_all(x, 0, 1, group),
        "allreduce_grad": lambda x: collectives.allreduce_grad(x, group),
        "all_reduce": lambda x: collectives.all_reduce(x, group),
        "gather_param": lambda x: collectives.gather_param(x, 0, group),
        "gather_param_resharded": lambda x: collectives.gather_param_resharded(x, 1, group, torch.float64, "h.0"),
    }

    def fn(x):
        return (calls[op](x) * 2).sum()

    x = torch.randn(4, 6, requires_grad=True)
    explained = _graphs(fn, x)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(fn, backend="aot_eager")
    got = compiled(x)
    got.backward()
    grad, x.grad = x.grad, None
    want = fn(x)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grad, x.grad)


def _partitioned(gather, group):
    """The forward and backward graphs that inductor's partitioner (min-cut) makes of two
    linears whose weights are gathered by ``gather``, and the gradients they compute."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    graphs = []

    def backend(gm, inputs):
        def keep(graph, _):
            graphs.append(graph)
            return make_boxed_func(graph)

        return aot_module_simplified(
            gm, inputs, fw_compiler=keep, bw_compiler=keep, partition_fn=min_cut_rematerialization_partition
        )

    def fn(w1, w2, x):
        hidden = torch.relu(x @ gather(w1, 0, group, None, "h.0").t())
        return (hidden @ gather(w2, 1, group, None, "h.1").t()).sum()

    torch._dynamo.reset()
    w1, w2, x = (torch.randn(*shape, requires_grad=True) for shape in ((8, 4), (3, 8), (5, 4)))
    torch.compile(fn, backend=backend)(w1, w2, x).backward()
    grads = [t.grad for t in (w1, w2, x)]
    for t in (w1, w2, x):
        t.grad = None
    fn(w1, w2, x).backward()
    for got, t in zip(grads, (w1, w2, x)):
        torch.testing.assert_close(got, t.grad)
    return graphs


def _gathers(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]


_LAYOUT = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten.permute.default, torch.ops.aten._to_copy.default}


def _saved_gathers(forward: torch.fx.Graph) -> list[str]:
    """The tensors forward saves for backward that are a gathered weight (a collective's
    output, or a view or cast of one)."""
    found = []
    for node in forward.output_node().args[0][1:]:
        source = node
        while source.op == "call_function" and source.target in _LAYOUT:
            source = source.args[0]
        if source.target is torch.ops._c10d_functional.wait_tensor.default:
            found.append(node.format_node())
    return found


def test_a_resharded_gather_is_recomputed_in_backward_not_saved(world_of_one):
    """SimpleFSDP's reshard_after_forward: forward saves the shards, backward gathers again
    (each gather annotated with its layer); the plain gather saves the gathered weight."""
    forward, backward = (g.graph for g in _partitioned(collectives.gather_param_resharded, world_of_one))
    assert not _saved_gathers(forward), _saved_gathers(forward)
    assert len(_gathers(forward)) == 2 and len(_gathers(backward)) == 2
    assert {n.meta.get("custom", {}).get(collectives.LAYER_ANNOTATION) for n in _gathers(backward)} == {"h.0", "h.1"}
    forward, backward = (g.graph for g in _partitioned(collectives.gather_param, world_of_one))
    assert _saved_gathers(forward) and not _gathers(backward)
