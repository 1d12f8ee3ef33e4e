"""Example inputs that alias each other are traced as independent inputs (``trace.aliases``);
a call whose inputs alias where the graph writes one of them is refused."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


class Pair(torch.nn.Module):
    """Reads two inputs that an example may pass as views of one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return (self.fc(x) * y).square().mean()


class WritesInput(torch.nn.Module):
    """Writes its first input in place (a running sum a caller reads back)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, acc, x):
        acc.add_(x)
        return (self.fc(acc) + x).square().mean()


def _users(traced) -> dict[str, int]:
    return {n.name: len(n.users) for n in traced.gm.graph.nodes if n.op == "placeholder" and n.name in ("idx", "targets")}


def test_one_tensor_twice_is_traced_as_two_inputs():
    model = build_model("gpt")
    idx, _ = example_batch("gpt", 2)
    zeros = torch.zeros_like(idx)
    users = _users(trace(model, (zeros, zeros)))
    assert users["idx"] > 0 and users["targets"] > 0, users


def test_compiled_with_aliased_examples_trains_as_eager(world_of_one):
    torch.manual_seed(0)
    model = build_model("gpt").double()
    eager = copy.deepcopy(model)
    idx, _ = example_batch("gpt", 2)
    zeros = torch.zeros_like(idx)
    pm = autopar.compile(model, mesh=(1,), example_inputs=(zeros, zeros))
    opt, eager_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x, y = (torch.randint(0, 64, idx.shape, generator=generator) for _ in range(2))
        loss, want = pm(x, y), eager(x, y)
        loss.backward(), want.backward()
        torch.testing.assert_close(loss.detach(), want.detach())
        opt.step(), eager_opt.step(), opt.zero_grad(), eager_opt.zero_grad()
    full = pm.full_state_dict()
    for name, p in eager.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), msg=name)


def test_views_of_one_tensor_as_examples_then_separate_calls(world_of_one):
    torch.manual_seed(0)
    model = Pair().double()
    eager = copy.deepcopy(model)
    base = torch.randn(8, 8, dtype=torch.float64)
    pm = autopar.compile(model, mesh=(1,), example_inputs=(base, base.view(8, 8)))
    for seed in range(2):
        x, y = torch.randn(2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(pm(x, y), eager(x, y))
    torch.testing.assert_close(pm(base, base), eager(base, base))  # aliased calls read alike


def test_a_call_aliasing_an_input_the_graph_writes_is_refused(world_of_one):
    torch.manual_seed(0)
    model = WritesInput().double()
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, mesh=(1,), example_inputs=(torch.zeros(4, 8).double(), torch.ones(4, 8).double()))
    acc, x = torch.zeros(4, 8).double(), torch.randn(4, 8).double()
    acc_eager = acc.clone()
    torch.testing.assert_close(pm(acc, x), eager(acc_eager, x))
    torch.testing.assert_close(acc, acc_eager)
    same = torch.randn(4, 8).double()
    with pytest.raises(autopar.InputError, match=r"share memory.*writes 'acc' in place.*clone\(\)"):
        pm(same, same)
