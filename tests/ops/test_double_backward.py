"""A gradient of a gradient through a collective is refused (``collectives.refuse_double_backward``):
the second backward cannot follow the communication and would give wrong weight gradients
(probed on two ranks: an FSDP plan's gradient penalty 0.41 off eager's). One rank's group stands in:
each collective's backward runs as it would on more."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import UsageError
from autopar.ops import collectives


def _ops(group: str):
    return {
        "all_reduce": lambda x: collectives.all_reduce(x, group),
        "all_gather": lambda x: collectives.all_gather(x, 0, group),
        "chunk": lambda x: collectives.chunk(x, 0, group),
        "reduce_scatter": lambda x: collectives.reduce_scatter(x, 0, group),
        "all_to_all": lambda x: collectives.all_to_all(x, 0, 1, group),
        "allreduce_grad": lambda x: collectives.allreduce_grad(x, group),
        "gather_param": lambda x: collectives.gather_param(x, 0, group),
        "gather_cast_param": lambda x: collectives.gather_cast_param(x, 0, group, None, x.dtype),
    }


@pytest.mark.parametrize("op", list(_ops("")))
def test_a_gradient_of_a_gradient_through_a_collective_is_refused(world_of_one, op):
    run = _ops(world_of_one)[op]
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(4, 4, requires_grad=True)
    out = (run(x) @ weight).tanh().sum()
    (first,) = torch.autograd.grad(out, x, retain_graph=True)  # a plain first-order gradient: as before
    torch.testing.assert_close(first, torch.autograd.grad((x @ weight).tanh().sum(), x)[0])
    with pytest.raises(UsageError, match=r"gradient of a gradient .*create_graph=True.*hand_plan\('ddp'"):
        torch.autograd.grad(out, x, create_graph=True)  # the input gradient depends on the weight
    # where the gradient reaching the collective needs no graph, create_graph changes nothing
    (linear,) = torch.autograd.grad(run(x).sum(), x, create_graph=True)
    torch.testing.assert_close(linear, torch.ones(4, 4))


def test_the_vocab_parallel_loss_refuses_it_too(world_of_one):
    """Its backward reads a softmax saved without a graph: a second backward would see none."""
    from autopar.ops.parallel import cross_entropy_vocab_split

    logits, target = torch.randn(6, 10, requires_grad=True), torch.randint(0, 10, (6,))
    loss = cross_entropy_vocab_split(axis_groups=[world_of_one], self=logits, target=target)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits, target))
    with pytest.raises(UsageError, match="gradient of a gradient"):
        torch.autograd.grad(loss, logits, create_graph=True)


def test_a_cast_gather_moves_the_cast_and_gives_the_master_its_gradient(world_of_one):
    """``gather_cast_param`` (a pipeline's FSDP under a precision policy): the cast is gathered,
    and the master shard's gradient is reduced in ``reduce_dtype`` and handed back in its own."""
    master = torch.randn(4, 3, dtype=torch.float32, requires_grad=True)
    whole = collectives.gather_cast_param(master, 0, world_of_one, torch.float32, torch.bfloat16)
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, master.detach().to(torch.bfloat16))
    grad = torch.randn(4, 3).to(torch.bfloat16)
    whole.backward(grad)
    assert master.grad.dtype == torch.float32 and torch.equal(master.grad, grad.float())
