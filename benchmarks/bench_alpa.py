"""Alpa's published GPT pipeline plans against autopar's stage planner, on one cost model.

    python benchmarks/bench_alpa.py                      # the three Alpa cases, results/alpa.csv
    python benchmarks/bench_alpa.py --cases 6.7B         # one case
    python benchmarks/bench_alpa.py --timing             # plan an 80-layer model on 64 devices, timed
    python benchmarks/bench_alpa.py --timing --mesh 8x8  # the same on a fixed mesh (stages cut axis 0)

Alpa (OSDI'22, Fig. 7 and ``benchmark/alpa/suite_auto_gpt.py``) trained GPT-3-shaped models on
AWS p3.16xlarge (8 × V100 16 GB per node, NVLink, 25 Gbps between nodes; our ``v100-16g``
preset), global batch 1,024 sequences of 1,024 tokens, fp16, with rematerialisation. The plans
its search found and published:

    6.7B on 16 GPUs:  64 microbatches, 2 stages of 8 GPUs, each a (2, 4) data × tensor mesh
    15B  on 32 GPUs: 128 microbatches, 4 stages of 8 GPUs, each (2, 4)
    39B  on 64 GPUs: 1,024 microbatches, 16 stages of 4 GPUs, each 4-way tensor parallel

For each case autopar's planner (``autopar.solver.planners.stages.search_stages``, ``num_stages="auto"``,
any stage mesh of N / S devices with up to two axes) runs against Alpa's plan priced by the same
machinery: the same stage count, stage mesh and layer split (equal transformer layers per stage,
embedding in the first stage, head and loss in the last), with the intra-stage plan chosen by
the same candidates. The model is traced on the meta device at one microbatch with 3 blocks of
the real widths; the DP prices ``--layers`` blocks from it (interior blocks are identical, so this
is exact; ``stages.py``). Memory budget: 16 GiB per device.

Columns: stages × stage mesh, layers per stage, predicted step time, sequences per second,
model TFLOP/s per GPU (72·B·s·l·h²·(1 + s/6h + V/12lh), no recomputation counted, as Megatron
counts model FLOPs), peak memory of the fullest stage, stages that recompute, and planning time.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.solver.planners.stages import StageSettings, search_stages  # noqa: E402
from autopar.trace import trace  # noqa: E402
from autopar.zoo.models import LLAMA_SHAPES, build_model  # noqa: E402

GLOBAL_BATCH = 1024
SEQ = 1024
VOCAB = 51200
# name: (hidden, layers, heads, devices, microbatches, Alpa's stage count, Alpa's stage mesh)
CASES = {
    "6.7B": (4096, 32, 32, 16, 64, 2, (2, 4)),
    "15B": (5120, 48, 40, 32, 128, 4, (2, 4)),
    "39B": (8192, 48, 64, 64, 1024, 16, (4,)),
}
PROBE_LAYERS = 3


def probe(hidden: int, heads: int, microbatch: int, seq: int = SEQ, vocab: int = VOCAB):
    with torch.device("meta"):
        model = build_model("gpt", vocab_size=vocab, block_size=seq, n_layer=PROBE_LAYERS, n_head=heads, n_embd=hidden).to(
            torch.float16
        )
        idx = torch.zeros(microbatch, seq, dtype=torch.long)
    return trace(model, (idx, idx))


def model_tflops(step_s: float, hidden: int, layers: int, devices: int) -> float:
    flops = 72 * GLOBAL_BATCH * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (12 * layers * hidden))
    return flops / step_s / devices / 1e12


LAYOUT_PARAMS = {"q": "attn.q_proj.weight", "o": "attn.c_proj.weight", "fc1": "mlp.c_fc.weight", "fc2": "mlp.c_proj.weight"}


def layouts(traced, search, costs) -> str:
    """The placements of an interior block's weights (traced block 1) in each candidate the
    stages use, such as ``c0[q:RS(0) o:RS(1) ...]`` per candidate (weights are (out, in))."""
    from autopar.ir.spec import format_spec

    placeholder = {i.fqn: i.name for i in traced.inputs if i.kind == "param"}
    mesh_costs = costs[search.stage_mesh]
    out = []
    for index in sorted({s.candidate for s in search.stages}):
        choice = mesh_costs.candidates[index].solution.choice
        specs = []
        for label, suffix in LAYOUT_PARAMS.items():
            name = placeholder[f"transformer.h.1.{suffix}"]
            strategy = mesh_costs.graph.choices[name].strategies[choice[name]]
            specs.append(f"{label}:{''.join(format_spec(strategy.outs[0]))}")
        out.append(f"c{index}[{' '.join(specs)}]")
    return " ".join(out)


def row_of(name, who, search, hidden, layers, devices, plan_s, traced=None, costs=None) -> dict:
    stages = search.stages
    return {
        "model": name,
        "plan": who,
        "devices": devices,
        "microbatches": search.num_microbatches,
        "stages": search.num_stages,
        "stage_mesh": "x".join(map(str, search.stage_mesh)),
        "layers_per_stage": "/".join(str(s.layers[1] - s.layers[0]) for s in stages),
        "step_s": round(search.step_time_s, 3),
        "seq_per_s": round(GLOBAL_BATCH / search.step_time_s, 1),
        "tflops_per_gpu": round(model_tflops(search.step_time_s, hidden, layers, devices), 2),
        "slowest_stage_ms": round(max(s.time_s for s in stages) * 1e3, 2),
        "bubble": round(search.bubble_fraction, 3),
        "grad_sync_s": round(max(s.sync_s for s in stages), 3),
        "peak_gib": round(max(s.memory_bytes for s in stages) / 2**30, 2),
        "recompute": sum(s.remat for s in stages),
        "candidates_used": "/".join(str(s.candidate) for s in stages),
        "layer_weights": layouts(traced, search, costs) if costs else "",
        "plan_s": round(plan_s, 1),
    }


def run_case(name: str, budget: float, time_limit: float, candidates: str) -> list[dict]:
    hidden, layers, heads, devices, micro, alpa_stages, alpa_mesh = CASES[name]
    cluster = get_cluster("v100-16g")
    start = time.perf_counter()
    traced = probe(hidden, heads, GLOBAL_BATCH // micro)
    trace_s = time.perf_counter() - start
    common = dict(
        num_microbatches=micro,
        memory_budget=budget,
        time_limit_s=time_limit,
        devices=devices,
        num_layers=layers,
        remat=True,
        candidates=candidates,
    )
    start = time.perf_counter()
    ours, costs = search_stages(traced, None, cluster, StageSettings(num_stages="auto", **common))
    ours_s = time.perf_counter() - start
    per = layers // alpa_stages
    bounds = [i * per for i in range(alpa_stages)] + [layers]
    alpa, alpa_costs = search_stages(
        traced, None, cluster, StageSettings(num_stages=alpa_stages, stage_meshes=[alpa_mesh], forced_layers=bounds, **common)
    )
    print(f"{name}: trace {trace_s:.1f} s, search {ours_s:.1f} s, {ours.ilp_solves} ILP solves")
    rows = [
        row_of(name, f"autopar ({candidates})", ours, hidden, layers, devices, ours_s + trace_s, traced, costs),
        row_of(name, "alpa", alpa, hidden, layers, devices, 0.0, traced, alpa_costs),
    ]
    for row in ours.rows[:8]:
        print("   ", row)
    return rows


def timing(
    family: str, budget_gib: float, time_limit: float, mesh: tuple[int, ...] | None, candidates: str = "lagrangian"
) -> dict:
    """An 80-layer model on 64 H100s (128 × 4096 tokens per step in 32 microbatches): trace
    (3 blocks) and stage planning, timed in wall-clock and CPU seconds. ``family`` "llama" is
    LLaMA-2-70B's shape; "gpt" is a GPT of the 39B case's widths (8192, 64 heads) and 80 layers.
    ``mesh`` fixes the full mesh, else the planner also picks each stage's mesh."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.device("meta"):
        if family == "llama":
            model = build_model("llama", **{**LLAMA_SHAPES["llama-2-70b"], "n_layer": PROBE_LAYERS}).to(torch.bfloat16)
        else:
            model = build_model("gpt", vocab_size=VOCAB, block_size=4096, n_layer=PROBE_LAYERS, n_head=64, n_embd=8192).to(
                torch.bfloat16
            )
        idx = torch.zeros(4, 4096, dtype=torch.long)
    traced = trace(model, (idx, idx))
    trace_s, trace_cpu = time.perf_counter() - start, time.process_time() - cpu
    start, cpu = time.perf_counter(), time.process_time()
    where = dict(devices=64) if mesh is None else dict()
    search, _ = search_stages(
        traced,
        mesh,
        get_cluster("h100-80g"),
        StageSettings(
            num_stages="auto",
            num_microbatches=32,
            memory_budget=budget_gib * 2**30,
            time_limit_s=time_limit,
            num_layers=80,
            remat=True,
            candidates=candidates,
            **where,
        ),
    )
    plan_s, plan_cpu = time.perf_counter() - start, time.process_time() - cpu
    row = {
        "model": f"{family}-80-layers",
        "mesh": "any" if mesh is None else "x".join(map(str, mesh)),
        "candidates": candidates,
        "trace_s": round(trace_s, 1),
        "trace_cpu_s": round(trace_cpu, 1),
        "plan_s": round(plan_s, 1),
        "plan_cpu_s": round(plan_cpu, 1),
        "ilp_solves": search.ilp_solves,
        "pipelines": len(search.rows),
        "stages": search.num_stages,
        "stage_mesh": "x".join(map(str, search.stage_mesh)),
        "layers_per_stage": "/".join(str(s.layers[1] - s.layers[0]) for s in search.stages),
        "step_s": round(search.step_time_s, 3),
        "peak_gib": round(max(s.memory_bytes for s in search.stages) / 2**30, 1),
    }
    print(row, flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--budget-gib", type=float, default=16.0)
    parser.add_argument("--time-limit", type=float, default=60.0)
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--mesh", default="", help="with --timing: a full mesh such as 8x8 (default: any)")
    parser.add_argument("--family", default="llama", choices=("llama", "gpt"), help="with --timing")
    parser.add_argument("--candidates", default="lagrangian", choices=("lagrangian", "budget", "both"))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "alpa.csv"))
    args = parser.parse_args()
    if args.timing:
        mesh = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else None
        row = timing(args.family, 80.0, args.time_limit, mesh, args.candidates)
        path = os.path.join(os.path.dirname(__file__), "results", "alpa_timing.csv")
        new = not os.path.exists(path)
        with open(path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
        return 0
    rows = []
    for name in args.cases:
        rows += run_case(name, args.budget_gib * 2**30, args.time_limit, args.candidates)
    for row in rows:
        print(row)
    worse = [a for a, b in zip(rows[::2], rows[1::2]) if a["step_s"] > b["step_s"] * (1 + 1e-9)]
    if args.out:
        with open(args.out, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    if worse:
        print("autopar's plan is predicted slower than Alpa's in:", [r["model"] for r in worse])
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
