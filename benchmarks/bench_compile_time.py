"""How long ``autopar.compile(..., compiler="inductor")`` and the first step take: the README's GPT.

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/bench_compile_time.py   # cold, then warm

Spawns gloo ranks for the mesh (``--mesh 2x2``: 4 ranks, one thread each), compiles the README's
GPT without a plan (rank 0 plans) and runs one forward and backward, twice in fresh processes:
first with inductor's cache as it is (empty, for a cold compile, when ``TORCHINDUCTOR_CACHE_DIR``
is a new directory), then warm. Prints, per rank, seconds for plan and rewrite, the first
forward (dynamo, AOTAutograd and inductor's forward), the first backward (inductor's backward),
and the wall time of each run with the spawn and imports.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import math
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, init: str, mesh: tuple[int, ...], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    try:
        import autopar
        from autopar.zoo.models import GPT

        torch.manual_seed(0)
        model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
        idx, targets = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
        dist.barrier()
        start = time.perf_counter()
        pm = autopar.compile(model, mesh=mesh, example_inputs=(idx, targets), compiler="inductor")
        planned = time.perf_counter()
        loss = pm(idx, targets)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        times = [None] * world
        dist.all_gather_object(times, (planned - start, forward - planned, backward - forward))
        if rank == 0:
            with open(os.path.join(out_dir, "times"), "w") as handle:
                handle.write(repr(times))
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mesh", default="2x2")
    args = parser.parse_args()
    mesh = tuple(int(size) for size in args.mesh.split("x"))
    for run in ("first (cold with an empty cache)", "second (warm)"):
        with tempfile.TemporaryDirectory(prefix="compile_time_") as out_dir:
            start = time.perf_counter()
            mp.spawn(
                _rank, args=(math.prod(mesh), f"file://{out_dir}/rendezvous", mesh, out_dir), nprocs=math.prod(mesh), join=True
            )
            wall = time.perf_counter() - start
            with open(os.path.join(out_dir, "times")) as handle:
                times = ast.literal_eval(handle.read())
        print(
            f"{run}: wall {wall:.1f} s; per rank (plan, first forward, first backward) s:",
            [tuple(round(t, 1) for t in row) for row in times],
            flush=True,
        )


if __name__ == "__main__":
    main()
