"""Planning time by stage, against depth and mesh size, for GPT and LLaMA shapes on the meta device.

    python benchmarks/bench_solver.py                # depth 12-96, meshes 8-1024, and the two targets
    python benchmarks/bench_solver.py --quick        # depth 2-8, a few minutes
    python benchmarks/bench_solver.py --targets      # only LLaMA-3-8B on (8, 8) and LLaMA-2-70B on (128, 8)

Stages: trace (torch.export), build (rules: strategies and prices of every node), ilp (the
PuLP model), solve (LP relaxation, rounding, MILP if needed), plan (the Plan object). The
passes run at ``compile`` time on each rank and are not part of planning. Each stage is timed in
wall-clock seconds and in CPU seconds of this process (the CBC backend runs in a child process,
whose CPU is not counted; the default HiGHS backend runs in process). On a shared machine the
CPU column is the one to compare. ``h100-80g``, 80 GiB per device, solver "auto".
Writes ``results/solver.csv`` and ``results/solver.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.solver import plan_from_solution
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search.solving import solve_ilp
from autopar.trace import trace
from autopar.zoo.models import LLAMA_SHAPES, build_model

SHAPES = {
    # family: (builder, config, sequences, tokens per sequence)
    "gpt": ("gpt", dict(vocab_size=50304, block_size=1024, n_head=25, n_embd=1600, bias=False), 64, 1024),
    "llama": ("llama", {k: v for k, v in LLAMA_SHAPES["llama-3-8b"].items() if k != "n_layer"}, 64, 2048),
}
TARGETS = [  # (label, builder, config, batch, seq, mesh, seconds allowed)
    ("llama-3-8b", "llama", LLAMA_SHAPES["llama-3-8b"], 64, 2048, (8, 8), 20.0),
    ("llama-2-70b", "llama", LLAMA_SHAPES["llama-2-70b"], 128, 4096, (128, 8), 60.0),
]
BUDGET_BYTES = 80 * 2**30


class Stopwatch:
    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def run(self, stage: str, fn, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        self.times[f"{stage}_s"] = round(time.perf_counter() - wall, 2)
        self.times[f"{stage}_cpu_s"] = round(time.process_time() - cpu, 2)
        return result


def plan_stages(builder: str, config: dict, batch: int, seq: int, mesh: tuple[int, ...]) -> dict:
    with torch.device("meta"):
        model = build_model(builder, **config)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    cluster = get_cluster("h100-80g")
    watch = Stopwatch()
    traced = watch.run("trace", trace, model, (idx, idx))
    graph = watch.run("build", build_choice_graph, traced, mesh, cluster)
    ilp = watch.run("ilp", ShardingILP, graph, BUDGET_BYTES)
    solution = watch.run("solve", solve_ilp, ilp, 600.0)
    plan = watch.run("plan", plan_from_solution, traced, graph, solution, cluster, BUDGET_BYTES)
    stages = ("trace", "build", "ilp", "solve", "plan")
    return {
        "layers": config["n_layer"],
        "mesh": "x".join(map(str, mesh)),
        "devices": _prod(mesh),
        "graph_nodes": len(traced.gm.graph.nodes),
        "ilp_variables": solution.num_variables,
        "method": solution.method,
        "gap": solution.gap,
        **watch.times,
        "total_s": round(sum(watch.times[f"{s}_s"] for s in stages), 2),
        "total_cpu_s": round(sum(watch.times[f"{s}_cpu_s"] for s in stages), 2),
        "step_time_s": plan.predicted.step_time_s,
    }


def end_to_end_s(builder: str, config: dict, batch: int, seq: int, mesh: tuple[int, ...]) -> float:
    """Wall seconds of one ``autopar.plan`` call as a user makes it: the stages above plus the
    memory rounds of ``solver.solve`` and the explanations stored in the plan."""
    with torch.device("meta"):
        model = build_model(builder, **config)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    start = time.perf_counter()
    autopar.plan(model, mesh, example_inputs=(idx, idx), cluster="h100-80g", memory_budget=BUDGET_BYTES)
    return round(time.perf_counter() - start, 2)


def _prod(sizes) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out


def sweep(quick: bool) -> list[dict]:
    depths = (2, 4, 8) if quick else (12, 24, 48, 96)
    meshes = ((8,), (8, 8), (128, 8))
    rows = []
    for family, (builder, config, batch, seq) in SHAPES.items():
        for depth in depths:
            rows.append(
                {"sweep": "depth", "model": family, **plan_stages(builder, {**config, "n_layer": depth}, batch, seq, (8, 8))}
            )
            print(rows[-1], flush=True)
        for mesh in meshes:
            depth = depths[0]
            rows.append(
                {"sweep": "mesh", "model": family, **plan_stages(builder, {**config, "n_layer": depth}, batch, seq, mesh)}
            )
            print(rows[-1], flush=True)
    return rows


def targets() -> list[dict]:
    rows = []
    for label, builder, config, batch, seq, mesh, allowed in TARGETS:
        row = {"sweep": "target", "model": label, **plan_stages(builder, dict(config), batch, seq, mesh)}
        row["end_to_end_s"] = end_to_end_s(builder, dict(config), batch, seq, mesh)
        row["target_s"] = allowed
        rows.append(row)
        print(row, flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = ("trace", "build", "ilp", "solve", "plan")
    groups = [("depth", "gpt"), ("depth", "llama"), ("target", None)]
    fig, axes = plt.subplots(1, len(groups), figsize=(13, 3.8))
    for ax, (sweep_name, family) in zip(axes, groups):
        chosen = [r for r in rows if r["sweep"] == sweep_name and (family is None or r["model"] == family)]
        if not chosen:
            ax.set_visible(False)
            continue
        labels = [str(r["layers"]) if family else f"{r['model']}\n{r['mesh']}" for r in chosen]
        bottom = [0.0] * len(chosen)
        for stage in stages:
            values = [r[f"{stage}_cpu_s"] for r in chosen]
            ax.bar(range(len(chosen)), values, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(chosen)), labels, fontsize=8)
        ax.set_ylabel("CPU seconds")
        ax.set_title(f"{family} shape, mesh 8x8, by layers" if family else "targets (CPU s)")
    visible = [ax for ax in axes if ax.get_visible()]
    visible[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/solver.csv")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--targets", action="store_true", help="only the two target models")
    args = parser.parse_args()
    rows = ([] if args.targets else sweep(args.quick)) + ([] if args.quick else targets())
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
