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
    "op", ["all_gather", "chunk", "reduce_scatter", "all_to_all", "allreduce_grad", "all_reduce", "gather_param"]
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
