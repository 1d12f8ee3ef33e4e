"""The ranks' agreement on each call's data (``autopar.runtime.data``): on rows made here, and on two pooled gloo ranks."""

from __future__ import annotations

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
