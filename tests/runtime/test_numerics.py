"""The numerics guard (autopar.runtime.tools.numerics): every rank's rewritten module in one process.

Issue 15's patterns (label shifting by in-place writes into slices, teacher forcing, an
``nn.Sequential`` whose modules take ``input``) equal eager under plans that shard; and the guard
finds the silent error those writes made before ``trace`` functionalized them, naming a node.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.cost.memory import param_state_bytes
from autopar.runtime.tools.numerics import check_numerics, run_ranks_in_threads
from autopar.trace import export
from tests.conftest import gpt_and_batch
from tests.trace.test_export import ShiftRight

MESH = (2, 2)


def _tight(model: torch.nn.Module) -> float:
    """90% of the replicated parameters' bytes with gradients and AdamW state: plans must shard."""
    return 0.9 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())


def _sharded(plan: autopar.Plan) -> bool:
    return any(not isinstance(p, Replicate) for spec in plan.params.values() for p in spec)


class TeacherForcing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.fc = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1]
        h = torch.relu(self.fc(self.emb(shifted)))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


class SquareLoss(torch.nn.Module):
    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Sequential's name
        return input.square().mean()


def _teacher_forcing(batch_size: int = 4) -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    shape = (batch_size, 16)
    ids, labels = torch.randint(0, 64, shape, generator=generator), torch.randint(0, 64, shape, generator=generator)
    return TeacherForcing(), (ids, labels)


def _sequential() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), SquareLoss())
    return model, (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),)


def _shift_right() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    return ShiftRight(), (torch.randint(4, 64, (16, 8), generator=torch.Generator().manual_seed(1)),)


CASES = {"teacher_forcing": _teacher_forcing, "sequential": _sequential, "shift_right": _shift_right}


@pytest.mark.parametrize("name", list(CASES))
def test_issue_15_patterns_equal_eager_under_sharded_plans(name):
    model, inputs = CASES[name]()
    plan = autopar.plan(model, MESH, example_inputs=inputs, cluster="cpu", memory_budget=_tight(model))
    assert _sharded(plan), "a tight budget must shard, or this checks only replication"
    result = check_numerics(model, plan, inputs)
    assert result.ok, result.text()
    assert result.loss is not None and result.grad_rel and result.num_nodes >= 5


def test_the_guard_finds_the_wrong_plan_that_unfunctionalized_writes_made(monkeypatch):
    # Before functionalization, teacher forcing compiled and ran, 0.5% off in the loss and over
    # 100% in the embedding's gradient, with no error.
    monkeypatch.setattr(export, "_functionalize_aliased_writes", lambda exported: (exported, []))
    model, inputs = _teacher_forcing(batch_size=32)  # large enough that the cpu preset shards it
    plan = autopar.plan(model, MESH, example_inputs=inputs, cluster="cpu")
    result = check_numerics(model, plan, inputs)
    assert not result.ok
    assert result.first_bad is not None and result.first_bad.node == "embedding", result.text()
    assert result.max_grad_rel > 1.0
    assert "first node that differs: embedding" in result.text()


def test_gpt_plan_on_2x2_equals_eager_node_by_node(gpt_plan_2x2):
    model, batch = gpt_and_batch()
    result = check_numerics(model, gpt_plan_2x2, batch)
    assert result.ok, result.text()
    assert result.num_nodes >= 40 and result.loss[0] == pytest.approx(result.loss[1], rel=1e-5)


def test_pipelined_plans_are_refused_with_the_reason():
    model, batch = gpt_and_batch()
    plan = autopar.plan(model, (2,), example_inputs=batch, cluster="cpu", pipeline=2, num_microbatches=2)
    with pytest.raises(ValueError, match="pipelined"):
        check_numerics(model, plan, batch)


def test_a_failing_rank_is_reported_and_the_others_are_released():
    def fn(rank):
        if rank == 1:
            raise KeyError("boom")
        torch.distributed.barrier()  # would wait forever for rank 1
        return rank

    with pytest.raises(RuntimeError, match="rank 1 of 3 failed: KeyError"):
        run_ranks_in_threads(3, fn, timeout_s=60)
    assert run_ranks_in_threads(2, lambda rank: rank * 10) == [0, 10]


def test_a_mixed_precision_plan_is_refused_with_the_fix():
    model, batch = gpt_and_batch()
    plan = autopar.hand_plan("ddp", model, (2,), example_inputs=batch, cluster="cpu", precision="bf16-mixed")
    with pytest.raises(ValueError, match="precision='32-true'"):
        check_numerics(model, plan, batch)
