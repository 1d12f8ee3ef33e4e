"""Hybrid sharding (FSDP2's HSDP) on 4 gloo ranks: the step of a GPT sharded on the inner axis of
mesh (2, 2), replicated on the outer, the batch split on both; ``--layout ddp``: replicated on both
(``hand_plan("ddp")``), each gradient summed over both axes.

    torchrun --standalone --nproc-per-node 4 benchmarks/bench_hybrid_shard.py --steps 12
    torchrun --standalone --nproc-per-node 4 benchmarks/bench_hybrid_shard.py --steps 12 --layout ddp

The layout is pinned (``hand_plans.hybrid_specs``: no hand-plan kind names it yet, benchmarks/README.md),
compiled with ``autopar.compile(..., plan=...)`` and stepped with torch's AdamW; rank 0 prints the
median wall and CPU milliseconds of a step after three warm-up steps, and the last loss (the same
on every tree that runs the same plan). Run it on two trees to compare their runtimes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.options import PlanOptions
from autopar.solver.planners.hand_plans import hybrid_specs
from autopar.solver.planners.sharding import solve
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch

CONFIG = dict(vocab_size=4096, block_size=128, n_layer=4, n_head=8, n_embd=256)
MESH = (2, 2)


def hybrid_plan(model: torch.nn.Module, batch: tuple) -> autopar.Plan:
    """The layout of ``hand_plans.hybrid_specs`` on ``MESH``, the rest as the solver picks it."""
    traced = trace(model, batch)
    return solve(traced, MESH, get_cluster("cpu"), PlanOptions(), forced=hybrid_specs(traced, MESH))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layout", choices=("hybrid", "ddp"), default="hybrid")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        model = build_model("gpt", seed=0, **CONFIG)
        batch = example_batch("gpt", 16, seed=1, **CONFIG)
        if args.layout == "hybrid":
            plan = hybrid_plan(model, batch)
        else:
            plan = autopar.hand_plan("ddp", model, MESH, example_inputs=batch, cluster="cpu")
        pm = autopar.compile(model, MESH, example_inputs=batch, plan=plan, cluster="cpu")
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        wall, cpu = [], []
        for step in range(args.steps + 3):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            loss = pm(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            dist.barrier()
            if step >= 3:
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        if dist.get_rank() == 0:
            print(
                f"{args.layout} (2, 2): step {statistics.median(wall) * 1e3:.1f} ms wall, "
                f"{statistics.median(cpu) * 1e3:.1f} ms CPU (rank 0), last loss {loss.item():.6f}"
            )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
