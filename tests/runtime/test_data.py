"""The ranks' agreement on each call's data (``autopar.runtime.data``): on rows made here, and on two pooled gloo ranks."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.ir.data import DataLayout
from autopar.ops import collectives
from autopar.runtime.data import _check_same_data, fingerprint, writes_state
from autopar.trace import trace


def _rows(groups: list[int], batches: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(
        [
            torch.cat([torch.tensor([g, 0.0], dtype=torch.float64), fingerprint([b], torch.device("cpu"))])
            for g, b in zip(groups, batches)
        ]
    )


def test_fingerprints_tell_reordered_shifted_and_reshaped_batches_apart() -> None:
    x = torch.arange(12.0).reshape(4, 3)
    same = fingerprint([x, torch.tensor([1, 2])], torch.device("cpu"))
    assert torch.equal(same, fingerprint([x.clone(), torch.tensor([1, 2])], torch.device("cpu")))
    for other in (x.flip(0), x + 1, x.reshape(3, 4), x[:3]):
        assert not torch.equal(fingerprint([other, torch.tensor([1, 2])], torch.device("cpu")), same)
    assert not torch.equal(fingerprint([torch.tensor([1, 2]), x], torch.device("cpu")), same)
    # a NaN in float data still fingerprints equal batches alike (beside integer inputs, which skip that step)
    nan = x.clone()
    nan[1, 1] = float("nan")
    assert torch.equal(*(fingerprint([b, torch.tensor([1, 2])], torch.device("cpu")) for b in (nan, nan.clone())))


def test_whole_batches_must_be_equal_on_every_rank_and_the_error_names_the_per_rank_mode() -> None:
    x = torch.randn(4, 3)
    layout = DataLayout("whole", (0,), (2, 2))
    _check_same_data(_rows([0, 0, 0, 0], [x, x, x, x]), layout)
    with pytest.raises(ValueError, match=r"ranks 0 and 2 passed different batches.*batch='per_rank'"):
        _check_same_data(_rows([0, 0, 0, 0], [x, x, x[[1, 0, 2, 3]], x]), layout)


def test_per_rank_rows_agree_within_a_data_parallel_rank_only() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    layout = DataLayout("per_rank", (0,), (2, 2))
    _check_same_data(_rows([0, 0, 1, 1], [a, a, b, b]), layout)
    with pytest.raises(ValueError, match=r"ranks 2 and 3 have data-parallel rank 1.*DistributedSampler"):
        _check_same_data(_rows([0, 0, 1, 1], [a, a, b, a]), layout)


class _Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.dropout(torch.relu(self.a(x)), 0.5, self.training)), y)


def _error(call) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "no error"


def _calls(rank: int, world_size: int, kind: str) -> dict:
    """Under a plan whose forward has no collective before its loss (ddp) and one that gathers
    parameters first (fsdp): other data and a refused call fail on every rank before the call
    returns, in grad mode and under no_grad, and the module is unharmed for the next call."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 4, generator=generator)
    model = _Regression()
    plan = autopar.hand_plan(kind, model, (world_size,), example_inputs=(x, y), cluster="cpu")
    pm = autopar.compile(model, (world_size,), example_inputs=(x, y), plan=plan)
    torch.manual_seed(5)
    first = pm(x, y)
    first.backward()
    rng = torch.get_rng_state()
    out = {
        "mixed": _error(lambda: pm(x + (rank == 1), y)),
        "refused": _error(lambda: pm(torch.cat([x, x]) if rank else x, y)),  # larger than planned
        "shapes": _error(lambda: pm(x[:4] if rank else x, y[:4] if rank else y)),  # smaller: planned, if all agree
    }
    with torch.no_grad():
        out["mixed_no_grad"] = _error(lambda: pm(x, y + (rank == 0)))
    out["same_rng"] = torch.equal(rng, torch.get_rng_state())  # the forward's dropout drew before the check failed
    torch.manual_seed(5)
    again = pm(x, y)
    again.backward()
    out["same_loss"] = again.item() == first.item()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_other_data_or_a_refused_call_fails_on_every_rank_before_the_call_returns(rank_pool, kind) -> None:
    results = rank_pool(2).run(_calls, kind, timeout_s=300)
    for rank, out in enumerate(results):
        assert "ranks 0 and 1 passed different batches" in out["mixed"], (rank, out["mixed"])
        assert "ranks 0 and 1 passed different batches" in out["mixed_no_grad"], (rank, out["mixed_no_grad"])
        assert "ranks 0 and 1 passed inputs of different shapes" in out["shapes"], (rank, out["shapes"])
        assert out["same_loss"], f"rank {rank}: the call after the refused ones computed another loss"
        assert out["same_rng"], f"rank {rank}: a refused call left the random generator drawn from"
    assert "refused this call" not in results[1]["refused"] and results[1]["refused"] != "no error", results[1]
    assert "ranks [1] refused this call" in results[0]["refused"], results[0]["refused"]


def test_the_check_is_awaited_once_before_the_next_collective_only(world_of_one) -> None:
    calls = []
    collectives.before_next_collective(lambda: calls.append("settled"))
    group = dist.group.WORLD.group_name
    collectives.no_grad_all_reduce(torch.ones(2), group)
    collectives.no_grad_all_reduce(torch.ones(2), group)
    assert calls == ["settled"]
    collectives.before_next_collective(lambda: calls.append("dropped"))
    collectives.before_next_collective(None)
    collectives.no_grad_all_reduce(torch.ones(2), group)
    assert calls == ["settled"]


class _Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(2))

    def forward(self, x):
        self.steps[0].add_(1)
        return x.sum() + self.steps[1]


def test_graphs_that_write_a_buffer_in_place_are_known() -> None:
    x = torch.randn(3, 4)
    assert writes_state(trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)), (x,)).gm)
    assert writes_state(trace(_Counter(), (x,)).gm)
    assert not writes_state(trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout()), (x,)).gm)
    assert not writes_state(trace(torch.nn.Sequential(torch.nn.BatchNorm1d(4)).eval(), (x,)).gm)


def test_random_ops_on_replicated_tensors_are_found_with_their_axes() -> None:
    """Ranks must draw alike only where a random op's output is whole on a mesh axis: sharded
    dropout may draw per rank (as DDP's does), eval-mode dropout draws nothing."""
    import dataclasses

    from torch.distributed.tensor import Replicate, Shard

    from autopar.runtime.data import random_ops

    model = _Regression()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    traced = trace(model, (x, y))
    plan = autopar.plan(model, (2, 2), example_inputs=(x, y), cluster="cpu")
    (name,) = [n.name for n in traced.gm.graph.nodes if n.target is torch.ops.aten.dropout.default]

    def placed(*spec):
        nodes = dict(plan.nodes)
        nodes[name] = dataclasses.replace(nodes[name], outs=(spec,))
        return dataclasses.replace(plan, nodes=nodes)

    assert random_ops(traced.gm, placed(Shard(0), Shard(0)), (1, 1)) is None
    found = random_ops(traced.gm, placed(Shard(0), Replicate()), (1, 1))
    assert found is not None and found.axes == (1,) and found.nodes == (name,)
    # ranks (1, 0) and (1, 1) must agree with each other, not with (0, 1)
    assert found.group == random_ops(traced.gm, placed(Shard(0), Replicate()), (1, 0)).group
    assert found.group != random_ops(traced.gm, placed(Shard(0), Replicate()), (0, 1)).group
    assert random_ops(traced.gm, placed(Replicate(), Replicate()), (0, 1)).axes == (0, 1)
    assert random_ops(trace(model.eval(), (x, y)).gm, plan, (0, 0)) is None  # eval: dropout draws nothing


class _Attention(torch.nn.Module):
    def __init__(self, dropout_p: float):
        super().__init__()
        self.qkv, self.dropout_p = torch.nn.Linear(16, 48), dropout_p

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout_p, is_causal=True).sum()


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_attention_draws_only_with_dropout(dropout_p) -> None:
    """SDPA is tagged random whatever its dropout: whole on a mesh axis, it needs the ranks'
    generators in step only where its ``dropout_p`` draws (ranks seeded apart, as DDP scripts
    seed them, must not be refused for a model without dropout)."""
    import dataclasses

    from torch.distributed.tensor import Replicate

    from autopar.runtime.data import random_ops

    model, x = _Attention(dropout_p), torch.randn(4, 6, 16)
    traced = trace(model, (x,))
    plan = autopar.plan(model, (2, 2), example_inputs=(x,), cluster="cpu")
    (name,) = [n.name for n in traced.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    nodes = dict(plan.nodes)
    nodes[name] = dataclasses.replace(nodes[name], outs=((Replicate(), Replicate()),))
    found = random_ops(traced.gm, dataclasses.replace(plan, nodes=nodes), (0, 1))
    if dropout_p:
        assert found is not None and found.nodes == (name,) and found.axes == (0, 1)
    else:
        assert found is None, found


class _DroppedScale(torch.nn.Module):
    """The zoo's GPT (cross entropy: one all-reduce of its sum and denominator under a data-parallel
    plan) times the mean of a replicated parameter under dropout, so that the ranks' random
    generators must agree."""

    def __init__(self):
        super().__init__()
        from autopar.zoo.models import build_model

        self.gpt = build_model("gpt", seed=0)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, idx, targets):
        return self.gpt(idx, targets) * torch.dropout(self.scale, 0.5, self.training).mean()


def _stepped(module, opt, batch, seed, micro: int) -> float:
    """One SGD step of ``module`` on ``batch`` in ``micro`` micro-batches (the first ones under
    no_sync where ``module`` has it), dropout seeded with ``seed``; the first micro-batch's loss."""
    losses = []
    for index in range(micro):
        torch.manual_seed(seed + index)
        sync = hasattr(module, "no_sync") and index < micro - 1
        with module.no_sync() if sync else contextlib.nullcontext():
            loss = module(*batch)
            loss.div(micro).backward()
        losses.append(loss.item())
    opt.step()
    opt.zero_grad()
    return losses[0]


def _riding(rank: int, world_size: int) -> dict:
    """A data-parallel plan whose data check carries the loss's all-reduce: four SGD steps (one of
    two micro-batches under no_sync) and eval-mode calls (a graph of its own) equal eager's in float64, with no
    all-reduce in the forward once learned; other data, other shapes, a refused call and random
    generators out of step fail on every rank, and the module is unharmed after them."""
    import torch.distributed._functional_collectives as funcol

    from autopar.zoo.models import example_batch

    torch.set_default_dtype(torch.float64)
    x, y = example_batch("gpt", 8, seed=1)
    model = _DroppedScale()
    eager = copy.deepcopy(model)
    plan = autopar.hand_plan("ddp", model, (world_size,), example_inputs=(x, y), cluster="cpu")
    pm = autopar.compile(model, (world_size,), example_inputs=(x, y), plan=plan)
    reduces = []
    real_all_reduce = funcol.all_reduce
    funcol.all_reduce = lambda *args, **kwargs: reduces.append(1) or real_all_reduce(*args, **kwargs)
    out: dict = {"kernel": plan.nodes["cross_entropy_loss"].kernel}
    try:
        opt, eager_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(eager.parameters(), lr=0.1)
        out["losses"] = []
        for step in range(4):
            batch = (x.roll(step, 1), y.roll(step, 1))
            micro = 2 if step == 2 else 1
            ours, theirs = _stepped(pm, opt, batch, 10 * step, micro), _stepped(eager, eager_opt, batch, 10 * step, micro)
            out["losses"].append(abs(ours - theirs))
            if step == 0:
                out["reduces_learning"] = len(reduces)  # first call: the check settles at the loss's all-reduce
                reduces.clear()
        out["reduces_riding"] = len(reduces)
        out["riding"] = sorted(pm._riding)
        out["params"] = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(pm.parameters(), eager.parameters()))
        torch.manual_seed(0)
        first = pm(x, y).item()
        out["mixed"] = _error(lambda: pm(x.flip(0) if rank else x, y))
        out["shapes"] = _error(lambda: pm(x[:4] if rank else x, y[:4] if rank else y))
        out["refused"] = _error(lambda: pm(torch.cat([x, x]) if rank else x, y))
        torch.manual_seed(rank)
        out["random"] = _error(lambda: pm(x, y))
        torch.manual_seed(0)
        out["same_loss"] = pm(x, y).item() == first
        pm.eval(), eager.eval()
        out["eval"] = max(abs(pm(x, y).item() - eager(x, y).item()) for _ in range(2))
    finally:
        funcol.all_reduce = real_all_reduce
    return out


def _assert_rode_and_refused(rank: int, out: dict) -> None:
    """One rank of ``_riding``: the loss's all-reduce rode the check, the loop equals eager's in
    float64, and other data, shapes and random states were refused."""
    assert out["kernel"] == "cross_entropy_mean", out  # the plan these tests are about
    assert out["reduces_learning"] == 1 and out["reduces_riding"] == 0 and len(out["riding"]) == 1, (rank, out)
    assert max(out["losses"]) < 1e-12 and out["params"] < 1e-12 and out["eval"] < 1e-12, (rank, out)
    assert "ranks 0 and 1 passed different batches" in out["mixed"], (rank, out["mixed"])
    assert "ranks 0 and 1 passed inputs of different shapes" in out["shapes"], (rank, out["shapes"])
    assert "draw different random numbers" in out["random"], (rank, out["random"])
    assert out["same_loss"], f"rank {rank}: the call after the refused ones computed another loss"


@pytest.mark.multiproc
def test_the_data_check_carries_the_loss_all_reduce_and_still_fails_on_every_rank(rank_pool) -> None:
    results = rank_pool(2).run(_riding, timeout_s=300)
    for rank, out in enumerate(results):
        _assert_rode_and_refused(rank, out)
    assert "refused this call" not in results[1]["refused"] and results[1]["refused"] != "no error", results[1]
    assert "ranks [1] refused this call" in results[0]["refused"], results[0]["refused"]


@pytest.mark.multiproc
def test_four_ranks_ride_as_two_do_and_refuse_on_every_rank(rank_pool) -> None:
    """At 4 ranks as at 2: the check carries the loss's all-reduce (the planner prices it so:
    ``op_prices.rides_data_check``), losses and parameters equal eager's in float64, and other
    data, shapes or random states, or a call three ranks refuse, fail on every rank."""
    results = rank_pool(4).run(_riding, timeout_s=300)
    for rank, out in enumerate(results):
        _assert_rode_and_refused(rank, out)
    for out in results[1:]:
        assert "refused this call" not in out["refused"] and out["refused"] != "no error", out
    assert "ranks [1, 2, 3] refused this call" in results[0]["refused"], results[0]["refused"]


class _Done:
    def wait(self) -> None:
        pass


def test_an_all_reduce_rides_only_where_every_rank_of_its_group_carried_it(world_of_one, monkeypatch) -> None:
    """Each rank sums the ridden numbers from the same table, so all ranks of a group ride or none
    does: where another rank's row carries nothing (it posted its check before its all-reduce) or
    another group's numbers, the all-reduce runs as it is. Too many numbers never ride."""
    from autopar.runtime import data

    cpu = torch.device("cpu")
    monkeypatch.setattr(collectives, "group_ranks", lambda name: [0, 1])
    other = torch.zeros(data._FIELDS, dtype=torch.float64)

    def post(self) -> None:  # rank 0's row beside ``other`` (rank 1's), as the gather would return them
        self._gathered, self._work = torch.cat([self._row, other]), _Done()

    monkeypatch.setattr(data._Check, "post", post)

    def ride(x: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        check = data._Check(
            torch.zeros(data._FIELDS, dtype=torch.float64), DataLayout("whole", (), (2,)), None, data._rng_state(cpu), cpu
        )
        return check.ride(x, "group"), check.rode

    other[data._RIDE : data._RIDE + 4] = torch.tensor([2, data._group_key([0, 1]), 0.25, 4.0], dtype=torch.float64)
    summed, rode = ride(torch.tensor([1.5, 2.0], dtype=torch.float32))
    assert rode and summed is not None and summed.dtype == torch.float32 and summed.tolist() == [1.75, 6.0]
    other[data._RIDE + 1] = data._group_key([0, 2])
    assert ride(torch.tensor([1.5, 2.0])) == (None, True)
    other[data._RIDE : data._RIDE + 2] = 0.0
    assert ride(torch.tensor([1.5, 2.0])) == (None, True)
    assert ride(torch.ones(data.RIDE_SLOTS + 1)) == (None, False)


@pytest.mark.parametrize("batch, sync, said", [("per_rank", False, True), ("per_rank", True, False), ("whole", False, False)])
def test_batch_norm_over_per_rank_rows_says_it_takes_the_whole_batch(caplog, batch, sync, said) -> None:
    """Where each rank passes its own rows, a plain BatchNorm takes every rank's rows' statistics
    (eager's, SyncBatchNorm's), not its own as under DDP: said at compile, once per compile."""
    import types

    from autopar.runtime.compile_checks import warn_batch_statistics

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    if sync:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    plan = types.SimpleNamespace(data_layout=DataLayout(batch, (0,), (2,)))
    with caplog.at_level("WARNING", logger="autopar"):
        warn_batch_statistics(model, plan)
    assert ("'1' normalizes over the whole batch, all 2 data-parallel ranks' rows" in caplog.text) == said, caplog.text
