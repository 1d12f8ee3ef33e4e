"""Helpers for testing autopar: run a function on real gloo ranks, and compare tensors by name.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, gives each a
process group, and returns what ``fn(rank, world_size, *args)`` returned on each rank, in rank
order. It never hangs: every process group gets a timeout, and the parent kills every child once
a rank fails, dies, or the whole run exceeds ``timeout_s + 30`` seconds. A failure is raised in
the parent with the rank's name and its formatted traceback.

``max_rel_diff`` and ``assert_close_dicts`` compare dicts of tensors keyed by FQN, such as
``pm.full_grads()`` against the gradients of an eager copy of the model.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# DistributedRankError is defined in the error family, and importable from here as before.
from autopar.errors import ConfigError, ConfigTypeError, DistributedRankError

__all__ = [
    "DistributedRankError",
    "run_distributed",
    "rel_diff",
    "max_rel_diff",
    "assert_close_dicts",
]

# Seconds the parent keeps listening after the first rank fails, so that errors raised at the
# same time on other ranks are reported too; ranks still blocked in a collective are then killed.
_ERROR_GRACE_S = 2.0
# Seconds a child may lie dead without a report before it counts as lost. A child that reported
# and exited at once can still have its report in the queue's pipe.
_DEAD_GRACE_S = 2.0
_EXTRA_DEADLINE_S = 30.0


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    init_method: str,
    backend: str,
    pg_timeout_s: float,
    report_queue: Any,
) -> None:
    # Mimic torchrun, so code under test that reads these sees the same as under torchrun.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args)
        # Pickled here, not by the queue's feeder thread, which would only print the error.
        try:
            payload = pickle.dumps(result)
        except Exception as exc:
            raise ConfigTypeError(
                f"the result of {_name(fn)} on rank {rank} cannot be pickled ({type(result).__name__}): {exc}"
            ) from exc
        report_queue.put((rank, "ok", payload))
    except BaseException:  # noqa: BLE001 - everything, even SystemExit, must reach the parent
        report_queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group must not hide the real report
                pass


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    backend: str = "gloo",
    pg_timeout_s: float | None = None,
    grace_s: float = _ERROR_GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return results by rank.

    ``fn`` must be a module-level function and ``args`` and its result must be picklable. Each
    rank joins a process group (``backend``, rendezvous through a file in a temporary directory)
    with a timeout of ``pg_timeout_s`` seconds (default ``timeout_s``), uses one CPU thread,
    and finds ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set as
    torchrun would set them.

    Raises ``DistributedRankError`` naming the rank, with its traceback, if any rank raises or
    dies (after the first failure the other ranks get ``grace_s`` seconds to report; fault tests
    raise it to see what the survivors say), and ``TimeoutError`` naming the ranks that did not report if the run takes longer than
    ``timeout_s + 30`` seconds. In both cases every child is killed first.
    """
    if world_size < 1:
        raise ConfigError(f"world_size must be at least 1, got {world_size}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ConfigError(
            f"run_distributed needs a module-level function, because the ranks are spawned "
            f"processes that import it; got {fn!r} ({exc})"
        ) from exc
    try:
        pickle.dumps(args)
    except Exception as exc:
        raise ConfigError(f"the arguments passed to {_name(fn)} cannot be pickled: {exc}") from exc

    ctx = mp.get_context("spawn")
    report_queue = ctx.Queue()
    tmpdir = tempfile.mkdtemp(prefix="autopar_rdzv_")
    init_method = "file://" + os.path.join(tmpdir, "rendezvous")
    pg_timeout = timeout_s if pg_timeout_s is None else pg_timeout_s
    procs = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, fn, args, init_method, backend, pg_timeout, report_queue),
                name=f"autopar-rank{rank}",
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        return _collect(
            fn,
            procs,
            report_queue,
            deadline=time.monotonic() + timeout_s + _EXTRA_DEADLINE_S,
            timeout_s=timeout_s,
            grace_s=grace_s,
        )
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        report_queue.close()
        shutil.rmtree(tmpdir, ignore_errors=True)


def _collect(
    fn: Callable[..., Any],
    procs: list,
    report_queue: Any,
    deadline: float,
    timeout_s: float,
    grace_s: float = _ERROR_GRACE_S,
) -> list[Any]:
    world_size = len(procs)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead_since: dict[int, float] = {}
    lost: dict[int, int | None] = {}  # rank -> exit code of a child that died silently
    first_error_at: float | None = None

    while len(results) + len(errors) + len(lost) < world_size:
        now = time.monotonic()
        if first_error_at is not None and now - first_error_at > grace_s:
            break
        if now > deadline:
            break
        try:
            rank, status, payload = report_queue.get(timeout=0.1)
        except queue.Empty:
            pass
        else:
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()
            continue
        now = time.monotonic()
        for rank, proc in enumerate(procs):
            if rank in results or rank in errors or rank in lost or proc.exitcode is None:
                continue
            dead_since.setdefault(rank, now)
            if now - dead_since[rank] > _DEAD_GRACE_S:
                lost[rank] = proc.exitcode
                first_error_at = first_error_at or now

    if len(results) == world_size:
        for proc in procs:
            proc.join(timeout=30)
        return [results[rank] for rank in range(world_size)]

    _drain(report_queue, results, errors)
    for rank, proc in enumerate(procs):
        if rank not in results and rank not in errors and rank not in lost and proc.exitcode is not None:
            lost[rank] = proc.exitcode
    silent = [r for r in range(world_size) if r not in results and r not in errors and r not in lost]
    failed = sorted(set(errors) | set(lost) | set(silent))
    if errors or lost:
        # A rank that died silently is the likely cause; the errors of its peers are echoes.
        lines = [f"{_name(fn)} failed on {world_size} ranks:"] if lost else []
        lines += _lost_lines(lost)
        if errors:
            # The first error to arrive is usually the cause; the later ones are often its echo
            # (a peer closing the connection under a collective).
            first = next(iter(errors))
            lines += [f"rank {first} of {world_size} raised in {_name(fn)}:", errors[first].rstrip()]
            for rank in errors:
                if rank != first:
                    last_line = errors[rank].strip().splitlines()[-1]
                    lines.append(f"rank {rank} also raised, later: {last_line}")
        if silent:
            lines.append(f"ranks that had not reported and were killed: {silent}")
        raise DistributedRankError("\n".join(lines), failed)
    raise TimeoutError(
        f"{_name(fn)} on {world_size} ranks did not finish within {timeout_s} + "
        f"{_EXTRA_DEADLINE_S:g} s; ranks that did not report: {silent}; ranks that finished: "
        f"{sorted(results)}. All ranks were killed."
    )


def _drain(report_queue: Any, results: dict[int, Any], errors: dict[int, str]) -> None:
    """Read the reports still in the pipe, so that a rank that did report is not called lost."""
    while True:
        try:
            rank, status, payload = report_queue.get(timeout=0.2)
        except queue.Empty:
            return
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload


def _lost_lines(lost: dict[int, int | None]) -> list[str]:
    return [
        f"rank {rank} exited with code {code} without reporting (killed, or crashed outside Python)"
        for rank, code in sorted(lost.items())
    ]


# ---------------------------------------------------------------------------------------------
# Comparing tensors by name


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|``: the error relative to the tensor's scale (0 if both are 0)."""
    if got.shape != want.shape:
        # A programming error of the test or script that compares, not a user's input to autopar:
        # a plain ValueError, as numpy's and torch's own comparisons raise (allowed in test_error_family).
        raise ValueError(f"shapes differ: got {tuple(got.shape)}, want {tuple(want.shape)}")
    got64 = got.detach().to("cpu", torch.float64)
    want64 = want.detach().to("cpu", torch.float64)
    if got64.numel() == 0:
        return 0.0
    abs_err = (got64 - want64).abs().max().item()
    scale = want64.abs().max().item()
    if abs_err == 0.0:
        return 0.0
    if math.isnan(abs_err):
        return math.inf
    return abs_err / scale if scale > 0 else math.inf


def _check_keys(got: Mapping[str, Any], want: Mapping[str, Any], what: str) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise AssertionError(f"{what}: names differ; missing from got: {missing or 'none'}; not in want: {extra or 'none'}")


def max_rel_diff(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per name, ``rel_diff(got[name], want[name])``. Both dicts must have the same names."""
    _check_keys(got, want, "max_rel_diff")
    return {name: rel_diff(got[name], want[name]) for name in want}


def assert_close_dicts(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    rtol: float = 1e-4,
    atol: float = 1e-6,
    what: str = "tensors",
) -> None:
    """Assert every ``got[name]`` is close to ``want[name]`` (``torch.allclose`` semantics).

    On failure the message names every failing tensor, worst first (by ``rel_diff``), with the
    largest absolute error and where it is.
    """
    _check_keys(got, want, what)
    failures = []
    for name in want:
        got_t, want_t = got[name].detach().cpu(), want[name].detach().cpu()
        if got_t.shape != want_t.shape:
            failures.append((math.inf, name, f"shape {tuple(got_t.shape)}, want {tuple(want_t.shape)}"))
            continue
        if got_t.dtype != want_t.dtype:
            got_t = got_t.to(want_t.dtype)
        if torch.allclose(got_t, want_t, rtol=rtol, atol=atol, equal_nan=True):
            continue
        err = (got_t.double() - want_t.double()).abs()
        err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
        flat = int(err.argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
        failures.append(
            (
                rel_diff(got_t, want_t),
                name,
                f"max abs err {err.max().item():.3e} at {index} "
                f"(got {got_t.reshape(-1)[flat].item():.6g}, want {want_t.reshape(-1)[flat].item():.6g}), "
                f"rel diff {rel_diff(got_t, want_t):.3e}",
            )
        )
    if failures:
        failures.sort(key=lambda item: -item[0])
        worst = failures[0][1]
        lines = [f"{len(failures)} of {len(want)} {what} differ (rtol={rtol}, atol={atol}); worst is {worst!r}:"]
        lines += [f"  {name}: {detail}" for _, name, detail in failures]
        raise AssertionError("\n".join(lines))
