"""Planning time by stage against model depth, for a GPT on the meta device (nothing allocated).

    python benchmarks/bench_plan_time.py --layers 2 4 8 --mesh 2,4 --out benchmarks/results/plan_time.csv

Stages: trace (torch.export), build (strategies and prices of every node), solve (ILP build and
CBC), and plan (the Plan object). Times are wall-clock on whatever machine runs this; compare
rows of one run only. The ratio column is each depth's total over the smallest depth's.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch

from autopar.cost.cluster import get_cluster
from autopar.zoo.models import GPT
from autopar.solver import plan_from_solution
from autopar.solver.choices import build_choice_graph
from autopar.solver.ilp import ShardingILP
from autopar.solver.solving import solve_ilp
from autopar.trace import trace


def plan_stages(n_layer: int, mesh: tuple[int, ...], cluster: str, width: int, batch: int, seq: int) -> dict:
    with torch.device("meta"):
        model = GPT(vocab_size=50304, block_size=seq, n_layer=n_layer, n_head=width // 64, n_embd=width, bias=False)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    spec = get_cluster(cluster)
    times = {}
    start = time.perf_counter()
    traced = trace(model, (idx, idx))
    times["trace_s"] = time.perf_counter() - start
    start = time.perf_counter()
    graph = build_choice_graph(traced, mesh, spec)
    times["build_s"] = time.perf_counter() - start
    start = time.perf_counter()
    ilp = ShardingILP(graph)
    solution = solve_ilp(ilp, time_limit_s=600)
    times["solve_s"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = plan_from_solution(traced, graph, solution, spec, None)
    times["plan_s"] = time.perf_counter() - start
    times["total_s"] = sum(times.values())
    return {
        "layers": n_layer,
        "nodes": len(graph.order),
        "free_nodes": len(graph.free()),
        "variables": solution.num_variables,
        "status": solution.status,
        "step_time_s": plan.predicted["step_time_s"],
        **{k: round(v, 3) for k, v in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mesh", default="2,4")
    parser.add_argument("--cluster", default="h100-80g")
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/plan_time.csv")
    args = parser.parse_args()
    mesh = tuple(int(n) for n in args.mesh.split(","))
    rows = []
    for n_layer in args.layers:
        row = plan_stages(n_layer, mesh, args.cluster, args.width, args.batch, args.seq)
        row["ratio_to_smallest"] = round(row["total_s"] / rows[0]["total_s"], 2) if rows else 1.0
        rows.append(row)
        print(row, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
