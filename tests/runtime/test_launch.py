"""Tests of autopar.runtime.tools.launch: the multi-process harness and the tensor-dict comparisons."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.tools.launch import (
    DistributedRankError,
    assert_close_dicts,
    max_rel_diff,
    rel_diff,
    run_distributed,
)


def _all_reduce_rank(rank: int, world_size: int, offset: float) -> list[float]:
    tensor = torch.tensor([rank + offset, 1.0])
    dist.all_reduce(tensor)
    return tensor.tolist()


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom from the test")
    # Rank 0 blocks in a collective its peer never joins: the harness must still return.
    dist.barrier()
    return rank


@pytest.mark.multiproc
def test_run_distributed_all_reduce_sums_over_ranks():
    results = run_distributed(_all_reduce_rank, 2, 10.0, timeout_s=60)
    assert results == [[21.0, 2.0], [21.0, 2.0]]


@pytest.mark.multiproc
def test_run_distributed_names_the_rank_that_raised():
    start = time.monotonic()
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_raise_on_rank_one, 2, timeout_s=60)
    message = str(info.value)
    assert "rank 1 of 2 raised" in message
    assert "ValueError: boom from the test" in message
    assert "_raise_on_rank_one" in message
    assert 1 in info.value.failed_ranks
    assert time.monotonic() - start < 60, "the harness waited for the process-group timeout"


def test_run_distributed_rejects_a_local_function():
    with pytest.raises(ValueError, match="module-level"):
        run_distributed(lambda rank, world_size: rank, 2)


def test_rel_diff_is_relative_to_the_largest_entry():
    want = torch.tensor([10.0, 0.0])
    assert rel_diff(want + torch.tensor([0.0, 1e-3]), want) == pytest.approx(1e-4)
    assert rel_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_diff(torch.ones(2), torch.zeros(2)) == float("inf")


def test_max_rel_diff_and_assert_close_dicts_name_the_worst_tensor():
    want = {"a.weight": torch.ones(2, 3), "b.bias": torch.ones(3), "loss": torch.tensor(2.0)}
    got = {name: tensor.clone() for name, tensor in want.items()}
    assert_close_dicts(got, want)
    got["a.weight"][1, 2] += 1e-2
    got["b.bias"][0] += 1.0
    diffs = max_rel_diff(got, want)
    assert diffs["loss"] == 0.0 and diffs["b.bias"] == pytest.approx(1.0)
    with pytest.raises(AssertionError, match=r"2 of 3 parameters differ .*worst is 'b.bias'") as info:
        assert_close_dicts(got, want, what="parameters")
    assert "a.weight" in str(info.value) and "(1, 2)" in str(info.value)
    with pytest.raises(AssertionError, match="missing from got: \\['loss'\\]"):
        assert_close_dicts({k: v for k, v in got.items() if k != "loss"}, want)
