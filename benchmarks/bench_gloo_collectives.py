"""gloo's collectives on one host, and the reduce-scatter autopar runs on gloo.

    python benchmarks/bench_gloo_collectives.py                  # 2 and 4 ranks, 16 MiB
    python benchmarks/bench_gloo_collectives.py --ranks 2 --mib 4

For each world size, spawned gloo ranks (one thread each) time, one after another with a barrier
before each call: an all-reduce of the tensor, an all-gather into it, gloo's own reduce-scatter
of it (``dist.reduce_scatter_tensor``), and the reduce-scatter autopar runs on gloo
(``autopar.ops.collectives.start_reduce_scatter``: one all-to-all and a local sum of the k
pieces received). Each figure is the median of ``--repeat`` calls on the slowest rank: wall time,
and the CPU time of the rank's process (all its threads: gloo's included), which is what the
ranks' compute competes with on a machine with fewer cores than ranks. Writes
``results/gloo_collectives.csv``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import resource
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rank(rank: int, world: int, init: str, numel: int, repeat: int, out: str) -> None:
    from autopar.ops import collectives

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    group = dist.group.WORLD.group_name
    whole = torch.randn(numel)
    shard = torch.randn(numel // world)
    gathered = torch.empty(numel)
    scattered = torch.empty(numel // world)
    runs = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, shard),
        "reduce_scatter_gloo": lambda: dist.reduce_scatter_tensor(scattered, whole),
        "reduce_scatter_autopar": lambda: collectives.wait(collectives.start_reduce_scatter(scattered, whole, group), group),
    }
    results = {}
    for name, run in runs.items():
        run()
        walls, cpus = [], []
        for _ in range(repeat):
            dist.barrier()
            wall, cpu = time.perf_counter(), _cpu_s()
            run()
            walls.append(time.perf_counter() - wall)
            cpus.append(_cpu_s() - cpu)
        figures = torch.tensor([statistics.median(walls), statistics.median(cpus)], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        results[name] = figures.tolist()
    if rank == 0:
        with open(out, "w") as handle:
            for name, (wall, cpu) in results.items():
                handle.write(f"{name},{wall},{cpu}\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=float, default=16.0, help="size of the whole tensor (fp32)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/gloo_collectives.csv")
    args = parser.parse_args()
    rows = []
    for world in args.ranks:
        numel = int(args.mib * 2**20 / 4) // world * world
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "figures.csv")
            mp.spawn(
                _rank, args=(world, "file://" + os.path.join(tmp, "rendezvous"), numel, args.repeat, out), nprocs=world, join=True
            )
            with open(out) as handle:
                for line in handle:
                    name, wall, cpu = line.strip().split(",")
                    rows.append(
                        {
                            "ranks": world,
                            "mib": args.mib,
                            "collective": name,
                            "wall_ms": round(1e3 * float(wall), 2),
                            "cpu_ms": round(1e3 * float(cpu), 2),
                        }
                    )
    for row in rows:
        print(f"{row['ranks']} ranks  {row['collective']:24s} wall {row['wall_ms']:7.2f} ms   cpu {row['cpu_ms']:7.2f} ms")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
