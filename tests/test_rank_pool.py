"""The session's pooled gloo ranks (tests/rank_pool.py) fail as loudly as fresh ones."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.tools.launch import DistributedRankError
from tests.rank_pool import RankPool


def _sum_and_dirty(rank: int, world_size: int) -> tuple[float, float, bool]:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    drawn = torch.rand(1).item()  # the default generator: reseeded with the rank's initial seed before every job
    torch.manual_seed(rank)  # state a job leaves behind must not reach the next one
    torch.set_grad_enabled(False)
    return value.item(), drawn, dist.get_backend() == "gloo"


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()  # rank 0 waits on rank 1, which never comes: the pool must not hang
    return rank


@pytest.mark.multiproc
def test_pooled_ranks_reset_between_jobs_and_a_failure_fails_the_job():
    pool = RankPool(2)
    try:
        first, second = pool.run(_sum_and_dirty, timeout_s=60), pool.run(_sum_and_dirty, timeout_s=60)
        # Each rank draws what it drew in the first job: its own fresh-process seed, restored.
        assert first == second and [r[0] for r in first] == [3.0, 3.0] and all(r[2] for r in first), (first, second)
        with pytest.raises(DistributedRankError, match="rank one fails on purpose") as error:
            pool.run(_raise_on_rank_one, timeout_s=60)
        assert 1 in error.value.failed_ranks
        after = pool.run(_sum_and_dirty, timeout_s=60)  # fresh ranks (fresh seeds): the world works again
        assert [r[0] for r in after] == [3.0, 3.0] and all(r[2] for r in after), after
    finally:
        pool.close()
