"""Custom autograd Functions keep their backward (``autopar.trace.functions``): traced as one
op, run through the compiled module and the numerics guard, equal to eager over several steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.autograd.function import once_differentiable

import autopar
from autopar.errors import TraceError
from autopar.runtime.tools.numerics import check_numerics
from autopar.trace import trace
from autopar.trace.functions import FUNCTION_OP


class ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class SavedCube(torch.autograd.Function):
    """Saves its input; a backward that is not the forward's derivative (3x² + 1)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (3 * x * x + 1)


class SplitTwo(torch.autograd.Function):
    """Two outputs, the second non-differentiable, the backward once-differentiable."""

    @staticmethod
    def forward(ctx, x, y):
        index = (x > 0).to(x.dtype)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(y)
        return x * y, index

    @staticmethod
    @once_differentiable
    def backward(ctx, grad, _grad_index):
        (y,) = ctx.saved_tensors
        return grad * y * 2, grad.sum(0, keepdim=True).expand_as(y) * 0.5


class StraightThrough(torch.autograd.Function):
    """Rounding forward, identity backward (quantization-aware training)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class Masked(torch.autograd.Function):
    """Reads ``ctx.needs_input_grad``: the mask (data) asks for no gradient, as in eager."""

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        assert ctx.needs_input_grad == (True, False), ctx.needs_input_grad
        return grad * mask * 2, None


class FunctionsNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.gate = torch.nn.Parameter(torch.randn(1, 16))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = ScaleGrad.apply(self.fc1(x), 4.0)
        h = SavedCube.apply(torch.tanh(h))
        h, index = SplitTwo.apply(self.fc2(h), self.gate.expand(x.shape[0], -1))
        h = StraightThrough.apply(h) + index
        h = Masked.apply(h, (x.sum(-1, keepdim=True) > 0).to(h.dtype).expand_as(h))
        return self.head(h).square().mean()


def _model_and_batch():
    torch.manual_seed(0)
    model = FunctionsNet().double()
    return model, (torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),)


def test_each_function_call_is_one_op():
    model, batch = _model_and_batch()
    traced = trace(model, batch)
    calls = [n for n in traced.gm.graph.nodes if n.target is FUNCTION_OP]
    assert len(calls) == 5
    assert not any(n.target is torch.ops.aten.round.default for n in traced.gm.graph.nodes)


def test_the_traced_graph_differentiates_through_the_users_backward():
    model, batch = _model_and_batch()
    traced = trace(copy.deepcopy(model), batch)
    params = dict(model.named_parameters())
    values = []
    for graph_input in traced.inputs:
        values.append(params[graph_input.fqn] if graph_input.kind == "param" else batch[0])
    (loss,) = traced.gm(*values)
    got = torch.autograd.grad(loss, list(params.values()))
    want = torch.autograd.grad(model(*batch), list(params.values()))
    for name, g, w in zip(params, got, want):
        torch.testing.assert_close(g, w, msg=name)


class CallWith(torch.autograd.Function):
    """A non-tensor argument whose repr holds an address (a lambda); the gradient doubled."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def _lambdas():
    return [lambda t: t * 3, lambda t: t + 1]  # one qualname, two objects


class Lambdas(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.fns = _lambdas()

    def forward(self, x):
        return sum(CallWith.apply(self.fc(x), fn) for fn in self.fns).square().sum()


def test_arguments_that_print_alike_are_different_calls_and_the_hash_is_stable():
    torch.manual_seed(0)
    model, x = Lambdas().double(), torch.randn(2, 4, dtype=torch.float64)
    first, second = trace(model, (x,)), trace(model, (x,))
    keys = [n.args[1] for n in first.gm.graph.nodes if n.target is FUNCTION_OP]
    assert len(set(keys)) == 2 and all("0x" not in key for key in keys)
    assert first.graph_hash == second.graph_hash
    params = dict(model.named_parameters())
    values = [params[i.fqn] if i.kind == "param" else x for i in first.inputs]
    (loss,) = first.gm(*values)
    want = model(x)
    torch.testing.assert_close(loss, want)
    got = torch.autograd.grad(loss, list(params.values()))
    torch.testing.assert_close(got, torch.autograd.grad(want, list(params.values())))


class AddInPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.add_(1)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Dirty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return (AddInPlace.apply(h) * h).sum()


def test_a_function_that_writes_its_input_in_place_is_refused_with_the_fix():
    with pytest.raises(TraceError, match=r"AddInPlace writes .* in place \(ctx.mark_dirty\).*out of place"):
        trace(Dirty(), (torch.randn(2, 4),))


class ThroughModule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, module):
        return module(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GivesModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return ThroughModule.apply(x, self.fc).sum()


def test_a_function_given_a_module_is_refused_with_the_fix():
    with pytest.raises(TraceError, match=r"ThroughModule is given a module \(Linear\).*Pass the tensors"):
        trace(GivesModule(), (torch.randn(2, 4),))


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_numerics_guard_equals_eager_with_custom_functions(mesh):
    model, batch = _model_and_batch()
    plan = autopar.plan(model, mesh, example_inputs=batch, cluster="cpu")
    result = check_numerics(model, plan, batch)
    assert result.ok, result.text()


def test_compiled_module_trains_as_eager_with_custom_functions(world_of_one):
    model, batch = _model_and_batch()
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, mesh=(1,), example_inputs=batch)
    opt = torch.optim.SGD(pm.parameters(), lr=0.05)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(8, 8, dtype=torch.float64, generator=generator)
        loss, want = pm(x), eager(x)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss.detach(), want.detach())
        grads = pm.full_grads()
        for name, p in eager.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=name)
        opt.step(), eager_opt.step(), opt.zero_grad(), eager_opt.zero_grad()
    full = pm.full_state_dict()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), msg=name)


class Regression(FunctionsNet):
    """``FunctionsNet`` against a target shaped like its input (so ``(z, z)`` can stand for both)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 8)

    def forward(self, x, target):
        h = ScaleGrad.apply(self.fc1(x), 4.0)
        h = SavedCube.apply(torch.tanh(h))
        h, index = SplitTwo.apply(self.fc2(h), self.gate.expand(x.shape[0], -1))
        return (self.head(StraightThrough.apply(h) + index) - target).square().mean()


def _train_on_ranks(rank: int, world_size: int) -> dict:
    """Rank ``rank`` of mesh (2, 2): Functions and examples ``(z, z)``, 3 SGD steps against eager."""
    torch.manual_seed(0)
    model = Regression().double()
    eager = copy.deepcopy(model)
    zeros = torch.zeros(8, 8, dtype=torch.float64)
    pm = autopar.compile(model, mesh=(2, 2), example_inputs=(zeros, zeros))
    opt, eager_opt = torch.optim.SGD(pm.parameters(), lr=0.05), torch.optim.SGD(eager.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(5)
    losses, grad_err = [], 0.0
    for _ in range(3):
        x, y = (torch.randn(8, 8, dtype=torch.float64, generator=generator) for _ in range(2))
        loss, want = pm(x, y), eager(x, y)
        loss.backward(), want.backward()
        losses.append((loss.item(), want.item()))
        grads = pm.full_grads()
        grad_err = max([grad_err] + [(grads[n] - p.grad).abs().max().item() for n, p in eager.named_parameters()])
        opt.step(), eager_opt.step(), opt.zero_grad(), eager_opt.zero_grad()
    full = pm.full_state_dict()
    param_err = max((full[n] - p.detach()).abs().max().item() for n, p in eager.named_parameters())
    return {"losses": losses, "grad_err": grad_err, "param_err": param_err}


@pytest.mark.multiproc
def test_functions_and_aliased_examples_train_as_eager_on_4_gloo_ranks(rank_pool):
    for rank, result in enumerate(rank_pool(4).run(_train_on_ranks, timeout_s=300)):
        for got, want in result["losses"]:
            assert got == pytest.approx(want, rel=1e-9), (rank, result["losses"])
        assert result["grad_err"] < 1e-9 and result["param_err"] < 1e-9, (rank, result)
