"""Gloo ranks spawned once per test session and reused by the multi-process tests.

Starting four ranks that import torch, autopar (and transformers) costs 10-30 s on the two-core
test machine, far more than many of the checks run on them. ``RankPool(n).run(fn, *args)`` runs
``fn(rank, world_size, *args)`` on ``n`` ranks that were spawned (and joined a gloo process group
with a timeout) at the first call, and returns what each rank returned, in rank order, as
``autopar.runtime.tools.launch.run_distributed`` does. Between jobs every rank restores the state a
fresh rank starts with (torch's default RNG seed, float32 default dtype, grad mode on) and the
ranks meet at a barrier, so a job starts from a clean, synchronized world.

Failures are as loud as ``run_distributed``'s: if any rank raises or dies, or the job outlives
``timeout_s`` (+30 s), every rank is killed, ``DistributedRankError`` (with the first failing
rank's traceback) or ``TimeoutError`` is raised, and the next job spawns fresh ranks.

Tests that check the process group itself (its timeout, a rank killed on purpose, the launcher)
keep their own ``run_distributed`` spawn.
"""

from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.runtime.tools.launch import DistributedRankError

PG_TIMEOUT_S = 600.0  # every collective of a pooled rank gives up after this long
_GRACE_S = 2.0  # after a first failure, how long the other ranks may still report theirs
_EXTRA_DEADLINE_S = 30.0


def _worker(rank: int, world_size: int, init_method: str, pg_timeout_s: float, tasks: Any, reports: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    seed = torch.initial_seed()  # a fresh process's default seed, restored before every job
    try:
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout_s)
        )
    except BaseException:  # noqa: BLE001 - the parent must hear of it
        reports.put((None, rank, "error", traceback.format_exc()))
        return
    while True:
        job = tasks.get()
        if job is None:
            break
        job_id, fn, args = job
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            result = fn(rank, world_size, *args)
            try:
                payload = pickle.dumps(result)
            except Exception as exc:
                raise TypeError(f"the result of {fn.__qualname__} on rank {rank} cannot be pickled: {exc}") from exc
            dist.barrier()  # every rank is done with this job before any starts the next
            reports.put((job_id, rank, "ok", payload))
        except BaseException:  # noqa: BLE001 - everything must reach the parent
            reports.put((job_id, rank, "error", traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world_size`` gloo ranks, spawned at the first ``run`` and kept for the next ones."""

    def __init__(self, world_size: int, pg_timeout_s: float = PG_TIMEOUT_S) -> None:
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self._procs: list = []
        self._tasks: list = []
        self._reports = None
        self._tmpdir: str | None = None
        self._jobs = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="autopar_pool_")
        init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
        self._reports = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                name=f"autopar-pool-rank{rank}",
                daemon=True,
                args=(rank, self.world_size, init_method, self.pg_timeout_s, self._tasks[rank], self._reports),
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 600) -> list[Any]:
        """``fn(rank, world_size, *args)`` on every rank; the results in rank order."""
        pickle.dumps((fn, args))  # fail here, not in a queue's feeder thread
        if not self._procs:
            self._start()
        self._jobs += 1
        job_id = self._jobs
        for tasks in self._tasks:
            tasks.put((job_id, fn, args))
        try:
            return self._collect(fn, job_id, time.monotonic() + timeout_s + _EXTRA_DEADLINE_S, timeout_s)
        except BaseException:
            self.close(kill=True)  # a failed job leaves the world unusable: the next one respawns it
            raise

    def _collect(self, fn: Callable[..., Any], job_id: int, deadline: float, timeout_s: float) -> list[Any]:
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        lost: dict[int, int | None] = {}
        first_error_at: float | None = None
        while len(results) + len(errors) + len(lost) < self.world_size:
            now = time.monotonic()
            if (first_error_at is not None and now - first_error_at > _GRACE_S) or now > deadline:
                break
            try:
                got_job, rank, status, payload = self._reports.get(timeout=0.1)
            except queue.Empty:
                for rank, proc in enumerate(self._procs):
                    if proc.exitcode is not None and rank not in results and rank not in errors:
                        lost[rank] = proc.exitcode
                        first_error_at = first_error_at or now
                continue
            if got_job not in (job_id, None):
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()
        if len(results) == self.world_size:
            return [results[rank] for rank in range(self.world_size)]
        silent = [r for r in range(self.world_size) if r not in results and r not in errors and r not in lost]
        if errors or lost:
            lines = [f"{name} failed on {self.world_size} pooled ranks:"]
            lines += [f"rank {rank} exited with code {code} without reporting" for rank, code in sorted(lost.items())]
            if errors:
                first = next(iter(errors))
                lines += [f"rank {first} of {self.world_size} raised in {name}:", errors[first].rstrip()]
                lines += [
                    f"rank {rank} also raised, later: {errors[rank].strip().splitlines()[-1]}" for rank in errors if rank != first
                ]
            if silent:
                lines.append(f"ranks that had not reported and were killed: {silent}")
            raise DistributedRankError("\n".join(lines), sorted(set(errors) | set(lost) | set(silent)))
        raise TimeoutError(
            f"{name} on {self.world_size} pooled ranks did not finish within {timeout_s} + "
            f"{_EXTRA_DEADLINE_S:g} s; ranks that did not report: {silent}. All ranks were killed."
        )

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``kill``: at once, as after a failure)."""
        if not kill:
            for tasks in self._tasks:
                tasks.put(None)
            for proc in self._procs:
                proc.join(timeout=30)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for q in [*self._tasks, self._reports]:
            if q is not None:
                q.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
        self._procs, self._tasks, self._reports, self._tmpdir = [], [], None, None
