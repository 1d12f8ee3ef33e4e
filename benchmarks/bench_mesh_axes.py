"""Planning time on 3- and 4-axis meshes against the 2-axis mesh of the same devices, in one run.

    python benchmarks/bench_mesh_axes.py                                  # LLaMA-3-8B, (8, 8) and (8, 2, 4)
    python benchmarks/bench_mesh_axes.py --model llama-2-70b --meshes 128x8 16x8x8
    python benchmarks/bench_mesh_axes.py --meshes 8x8 2x4x2x4 --seq-len 32768
    python benchmarks/bench_mesh_axes.py --devices 64                    # the mesh search, every mesh
    python benchmarks/bench_mesh_axes.py --repeat 3                       # (8, 8), (8, 2, 4), (8, 8), ... interleaved

Each row is ``autopar plan MODEL --mesh M --precision bf16-mixed`` on the meta device (a CLI
model preset, traced once; the trace is not in the row): ``plan_s`` is wall-clock,
``plan_cpu_s`` the process's CPU time for the same work (``time.process_time``), which other
jobs on a loaded machine disturb far less. ``ratio`` is each row's CPU time over the first
row's of its round (``--repeat N`` plans the meshes N rounds, interleaved; a mesh's first round
works out its 2-axis transition steps cold, ``ir.spec.steps_between`` keeps them for the next; hub tables
route their pairs in bulk each time, ``spec.routes_between``). ``strategies`` are the op strategies the rules enumerate, and ``cut`` those
``solver.problem.pruning`` removes before the ILP (impossible, dominated). ``rss_gib`` is the
process's peak resident memory after the row (``ru_maxrss``: it never goes down, so a row that
does not raise it used no more). ``--devices N`` runs the mesh search instead (one row, the
chosen mesh), and prints its table.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autopar import api  # noqa: E402
from autopar.cli.main import load_model  # noqa: E402
from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.ir.options import PlanOptions  # noqa: E402
from autopar.solver.planners.dispatch import trace_model  # noqa: E402
from autopar.solver.planners.mesh_search import mesh_search_text, search_mesh  # noqa: E402


def _mesh(text: str) -> tuple[int, ...]:
    return tuple(int(size) for size in text.split("x"))


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--meshes", nargs="+", default=["8x8", "8x2x4"])
    parser.add_argument("--devices", type=int, default=None, help="run the mesh search over this many devices")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--repeat", type=int, default=1, help="plan the meshes this many rounds, interleaved")
    args = parser.parse_args()

    model, inputs = load_model(args.model, args.batch_size, True, args.seq_len)
    options = PlanOptions.from_keywords(precision=args.precision, devices=args.devices)
    cluster = get_cluster(None)
    traced = trace_model(model, inputs, None, options.precision)
    print(
        f"{args.model}, batch {args.batch_size}, {args.precision}, cluster {cluster.name}; "
        f"{len(traced.gm.graph.nodes)} graph nodes"
    )
    print(
        f"{'mesh':<10} {'plan_s':>8} {'plan_cpu_s':>10} {'ratio':>6} {'variables':>10} {'strategies':>10} "
        f"{'cut':>16} {'step_ms':>9} {'peak_GiB':>9} {'rss_gib':>8}"
    )
    runs = [("search", None)] if args.devices else [(mesh, _mesh(mesh)) for mesh in args.meshes]
    first = None
    for index, (label, shape) in enumerate(runs * max(args.repeat, 1)):
        if index % len(runs) == 0:
            first = None  # a new round
        wall, cpu = time.perf_counter(), time.process_time()
        if shape is None:
            plan = search_mesh(
                traced,
                args.devices,
                cluster,
                options,
                api.plan_traced_unexplained,
                on_progress=lambda text: print("  " + text, flush=True),
            )
            label = "x".join(map(str, plan.mesh_shape))
        else:
            plan = api.plan_traced(traced, shape, cluster, options)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        first = first or cpu
        counts = plan.stats.get("strategies", {})
        cut = f"{counts.get('impossible', 0)} + {counts.get('dominated', 0)}"
        print(
            f"{label:<10} {wall:>8.2f} {cpu:>10.2f} {cpu / first:>6.2f} {plan.solver.num_variables:>10} "
            f"{counts.get('enumerated', 0):>10} {cut:>16} {plan.predicted.step_time_s * 1e3:>9.1f} "
            f"{plan.predicted.peak_memory_bytes / 2**30:>9.1f} {_rss_gib():>8.2f}",
            flush=True,
        )
        if "mesh_search" in plan.stats:
            print(mesh_search_text(plan.stats["mesh_search"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
