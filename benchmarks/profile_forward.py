"""Where a 2-rank data-parallel forward's host time goes: autopar's ddp plan against DDP (gloo, CPU).

    python benchmarks/profile_forward.py                 # 2 ranks, 100 forwards each
    python benchmarks/profile_forward.py --ranks 4 --calls 60

``bench_param_path``'s GPT and batch, both trainers in the same spawned ranks, taking turns call
by call (forward, then backward, so each forward meets the state a training step leaves). Each
forward is timed with ``time.thread_time`` (the calling thread's CPU: Python and the kernels,
torch runs one thread) and ``time.process_time`` (the process's: gloo's threads too); the parts
of autopar's call path are timed the same way by wrapping them for this run only: the call's own
checks and the data check's row (``start_check``; inside it ``validate``, the data's
fingerprint and the random generators' state), the graph's inputs (``_graph_values``), the
graph (``run_eager``; inside it the gradient buckets' forward node and the loss's all-reduce, which
the data check's all-gather carries: ``ride``, with its launch and wait). Medians over the calls of
rank 0, in microseconds; "gloo" is process minus thread time (what gloo's threads spent); "wall"
is ``time.perf_counter``: where it exceeds the CPU time, rank 0 waited: in the loss's ride, for
its peer's forward (a barrier starts each forward) and, on a busy machine, for a core after
gloo's threads ran; DDP's forward has no such point.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_param_path import BATCH, CONFIG
from bench_vs_torch import build

_TIMES: dict[str, list[tuple[float, float, float]]] = {}


def _timed(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that records its thread and process CPU seconds and its wall seconds."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def run(*args, **kwargs):
        thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent = time.thread_time() - thread, time.process_time() - process, time.perf_counter() - wall
            _TIMES.setdefault(label, []).append(spent)

    setattr(owner, name, run)


def _instrument() -> None:
    from autopar.ops import buckets
    from autopar.runtime import data, module

    _timed(module, "start_check", "start_check (checks, data row)")
    _timed(module.ParallelModule, "_check_call", "  validate (arguments, shapes)")
    _timed(data, "_data_sums", "  data fingerprint")
    _timed(data, "_rng_state", "  random generators' state")
    _timed(module.ParallelModule, "_graph_values", "graph inputs")
    _timed(module, "run_eager", "graph (run_eager)")
    _timed(buckets._SyncGrads, "apply", "  gradient buckets' forward node")
    _timed(data._Check, "ride", "  loss all-reduce riding the check")
    _timed(data._Check, "post", "    all-gather launch")
    _timed(data._Check, "wait", "    all-gather wait")


def _forward(module, batch) -> tuple[float, float, float]:
    thread, process, wall = time.thread_time(), time.process_time(), time.perf_counter()
    loss = module(*batch)
    spent = time.thread_time() - thread, time.process_time() - process, time.perf_counter() - wall
    loss.backward()
    return spent


def _rank(rank: int, world: int, init: str, out: str, calls: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        ours, theirs = build("autopar_ddp", world, rank, CONFIG, BATCH), build("torch_ddp", world, rank, CONFIG, BATCH)
        for _ in range(5):  # warm-up: the data check learns to ride, buckets are made
            _forward(*ours), _forward(*theirs)
        _instrument()
        _TIMES.clear()
        whole: dict[str, list[tuple[float, float, float]]] = {"autopar ddp forward": [], "DDP forward": []}
        for _ in range(calls):
            dist.barrier()
            whole["autopar ddp forward"].append(_forward(*ours))
            dist.barrier()
            whole["DDP forward"].append(_forward(*theirs))
        if rank == 0:
            with open(out, "w") as handle:
                handle.write(_table({**whole, **_TIMES}, calls))
    finally:
        dist.destroy_process_group()


def _table(times: dict[str, list[tuple[float, float, float]]], calls: int) -> str:
    lines = [f"{'part':40s} {'calls':>5s} {'thread':>7s} {'process':>8s} {'gloo':>6s} {'wall':>7s}  (us, median)"]
    for label, spent in times.items():
        thread, process, wall = (1e6 * statistics.median(s[k] for s in spent) for k in range(3))
        lines.append(f"{label:40s} {len(spent) / calls:5.1f} {thread:7.0f} {process:8.0f} {process - thread:6.0f} {wall:7.0f}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="profile_forward_") as tmp:
        out = os.path.join(tmp, "table.txt")
        load = os.getloadavg()[0]
        mp.spawn(_rank, args=(args.ranks, "file://" + os.path.join(tmp, "rendezvous"), out, args.calls), nprocs=args.ranks)
        with open(out) as handle:
            print(handle.read() + f"ranks {args.ranks}, load {load:.1f} -> {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
