"""The eval graph of a compiled module is planned on the train plan's shards (``autopar.runtime.modes``)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.options import PlanOptions
from autopar.runtime.modes import ModeKey, describe_mode, in_mode, pinned_placements
from autopar.solver.planners.traced import plan_traced
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_eval_graph_keeps_every_parameter_and_buffer_where_the_train_plan_put_it(kind) -> None:
    model, batch = build_model("cnn"), example_batch("cnn", 8)
    train = autopar.hand_plan(kind, model, (2, 2), example_inputs=batch, cluster="cpu")
    model.eval()
    traced = trace(model, batch)
    norms = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
    assert norms and all(n.args[5] is False for n in norms), "eval-mode batch norm reads the running statistics"
    pinned = pinned_placements(traced, train)
    made = plan_traced(traced, (2, 2), get_cluster("cpu"), PlanOptions(), forced=pinned)
    for graph_input in traced.inputs:
        if graph_input.kind in ("param", "buffer"):
            assert made.nodes[graph_input.name].outs[0] == train.params[graph_input.fqn], graph_input.fqn


def test_a_tensor_the_compiled_mode_never_read_is_refused_by_name() -> None:
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return (self.a(x) if self.training else self.b(x)).sum()

    model = Branchy()
    x = torch.randn(2, 4)
    train = autopar.hand_plan("ddp", model, (2,), example_inputs=(x,), cluster="cpu")
    train = type(train)(
        **{
            **{f: getattr(train, f) for f in ("mesh_shape", "graph_hash", "nodes", "predicted")},
            "params": {k: v for k, v in train.params.items() if k.startswith("a.")},
        }
    )
    with pytest.raises(ValueError, match=r"parameter 'b.weight'.*model.train\(\) or model.eval\(\)"):
        pinned_placements(trace(model.eval(), (x,)), train)


class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.bn, self.drop, self.head = (
            torch.nn.Linear(8, 8),
            torch.nn.BatchNorm1d(8),
            torch.nn.Dropout(0.5),
            torch.nn.Linear(8, 1),
        )

    def forward(self, x):
        return self.head(self.drop(self.bn(self.up(x)))).pow(2).mean()


X = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))


def _same_call(pm, eager, seed: int = 3) -> None:
    torch.manual_seed(seed)
    got = pm(X)
    torch.manual_seed(seed)
    torch.testing.assert_close(got, eager(X), rtol=0, atol=0)


def test_each_module_runs_in_its_own_mode_as_in_eager(world_of_one) -> None:
    model = _Noisy()
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")
    pm.module.eval()  # DDP's model.module.eval(): the module's mode
    eager.eval()
    assert not pm.training
    _same_call(pm, eager)
    with torch.no_grad():
        _same_call(pm, eager)
    pm.module.drop.train()  # Monte Carlo dropout: dropout on in an evaluating model
    eager.drop.train()
    with torch.no_grad():  # not the local evaluation, which would run every module in eval mode
        _same_call(pm, eager)
    pm.train()
    eager.train()
    pm.module.bn.eval()  # a frozen batch norm in a training model: its running statistics stay
    eager.bn.eval()
    opt_pm, opt_eager = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
    for seed in range(3):
        for module, opt in ((pm, opt_pm), (eager, opt_eager)):
            torch.manual_seed(seed)
            module(X).backward()
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(pm.module.state_dict(), eager.state_dict(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pm.module.bn.running_mean, torch.zeros(8))  # frozen: never updated
    assert {describe_mode(mode) for mode in pm._modes} == {
        "train",
        "eval",
        "eval (with 'drop' in train mode)",
        "train (with 'bn' in eval mode)",
    }


def test_modes_set_on_the_model_before_compile_are_the_compiled_graphs(world_of_one) -> None:
    model = _Noisy()
    model.bn.eval()  # frozen before compile: the graph is traced so, and pm's module keeps it so
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, (1,), example_inputs=(X,), cluster="cpu")
    assert not pm.module.bn.training and pm.module.drop.training
    _same_call(pm, eager)
    assert list(pm._modes) == [ModeKey(True, frozenset({"bn"}))]  # no other graph was made


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 2)]
    return torch.nn.Sequential(*layers).double()


def _unfrozen_later(rank: int, world: int) -> dict[str, tuple[float, list[str]]]:
    """Per plan: how far from eager the parameters are after four SGD steps of a model compiled
    with its first layer frozen, which is unfrozen after two steps while the second is frozen,
    and the modes of the graphs the module made."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = {}
    for kind in ("fsdp", "auto"):
        model = _mlp()
        model[0].requires_grad_(False)  # frozen at compile: the traced graph has no gradient for it
        eager = copy.deepcopy(model)
        plan = None if kind == "auto" else autopar.hand_plan(kind, model, (world,), example_inputs=(x,), cluster="cpu")
        pm = autopar.compile(model, (world,), example_inputs=(x,), cluster="cpu", plan=plan)
        opts = [(pm, torch.optim.SGD(pm.parameters(), lr=0.1)), (eager, torch.optim.SGD(eager.parameters(), lr=0.1))]
        for step in range(4):
            if step == 2:  # gradual unfreezing: the first layer trains from here, the second is frozen
                for module in (pm.module, eager):
                    module[0].requires_grad_(True)
                    module[2].requires_grad_(False)
                with torch.no_grad():  # no gradient flows: no graph of its own
                    pm(x)
            for module, opt in opts:
                module(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        full = pm.full_state_dict()
        worst = max((full[name] - value).abs().max().item() for name, value in eager.state_dict().items())
        results[kind] = (worst, sorted(describe_mode(mode) for mode in pm._modes))
    return results


@pytest.mark.multiproc
def test_a_parameter_frozen_at_compile_and_unfrozen_later_trains_as_in_eager(rank_pool) -> None:
    """Gradual unfreezing on two ranks: the graph traced with a parameter frozen plans no reduction
    of its gradient (FSDP's plan gave each rank its own: off by 1e-3), so a call that trains it
    runs a graph traced with it trainable. Freezing after compile needs no graph of its own."""
    for result in rank_pool(2).run(_unfrozen_later, timeout_s=300):
        for kind, (worst, modes) in result.items():
            assert worst < 1e-12, f"{kind}: parameters off eager's by {worst:.1e}"
            assert modes == ["train", "train (training '0.bias', '0.weight', frozen at compile)"], (kind, modes)


def test_in_mode_trains_the_unfrozen_parameters_and_puts_them_back() -> None:
    model = _mlp()
    model[0].requires_grad_(False)
    key = ModeKey(True, frozenset({"1"}), frozenset({"0.weight"}))
    with in_mode(model, key):
        assert model[0].weight.requires_grad and not model[0].bias.requires_grad and not model[1].training
    assert not model[0].weight.requires_grad and model[1].training
    assert describe_mode(key) == "train (with '1' in eval mode; training '0.weight', frozen at compile)"


class _Doubling(torch.nn.Module):
    """A layer whose train mode doubles its output: its eval mode is another graph."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * 2.0 if self.training else self.fc(x)


def _accumulated_across_modes(rank: int, world: int) -> dict:
    """How far from eager the gradients of three micro-steps are, the first two under
    ``pm.no_sync()`` and the second with a layer in eval mode (a graph of its own), on the solver's
    data-parallel plan; and how much the first held back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Doubling(), torch.nn.ReLU(), torch.nn.Linear(8, 1)).double()
    eager = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 8, generator=generator, dtype=torch.float64) for _ in range(3)]
    pm = autopar.compile(model, (world,), example_inputs=(batches[0],))
    held = 0
    for module, sync in ((pm, pm.no_sync), (eager, contextlib.nullcontext)):
        layer = module.module[0] if module is pm else module[0]
        with sync():
            module(batches[0]).pow(2).mean().backward()
            held = held or sum(bucket.held_numel for bucket in pm._no_sync_buckets())
            layer.eval()  # the second micro-step in another mode: another graph, with buckets of its own
            module(batches[1]).pow(2).mean().backward()
            layer.train()
        module(batches[2]).pow(2).mean().backward()
    grads = pm.full_grads()
    worst = max((grads[name] - p.grad).abs().max().item() / p.grad.abs().max().item() for name, p in eager.named_parameters())
    return {"worst": worst, "held": held, "size": pm.data_parallel_size, "graphs": len({run.attr for run in pm._modes.values()})}


@pytest.mark.multiproc
def test_accumulation_under_no_sync_across_modes_equals_eager(rank_pool) -> None:
    """A graph of another mode added its reduced gradients into the ``.grad`` views that
    ``no_sync()`` held back for the first graph, which the next synced backward all-reduced again:
    0.91 off eager on two ranks, without a word. The held sums are now reduced before it runs."""
    for result in rank_pool(2).run(_accumulated_across_modes, timeout_s=300):
        assert result["size"] == 2 and result["held"] > 0 and result["graphs"] == 2, result
        assert result["worst"] < 1e-12, result
