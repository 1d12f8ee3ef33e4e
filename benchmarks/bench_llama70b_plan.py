"""Plan a LLaMA-2-70B-shaped model for 1,024 H100s offline, and print what the plan predicts.

    python benchmarks/bench_llama70b_plan.py --layers 80 --out benchmarks/results/llama70b_plan.csv

The model is ``build_model("llama", **LLAMA_SHAPES["llama-2-70b"])`` built on the meta device in
bfloat16 (no memory, no process group), planned with ``autopar.plan`` on mesh (128, 8) of the
``h100-80g`` preset under an 80 GiB budget per device. ``--layers`` cuts the depth (repeated
layers share one choice, so the ILP does not grow; tracing and pricing do). Prints the head of
``plan.summary()``: predicted step time, peak memory per device (and when it is reached), and
bytes sent per device on each mesh axis.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.zoo.models import LLAMA_SHAPES, build_model, example_batch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--batch", type=int, default=128, help="sequences per step (global; 128 × 4096 tokens)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--mesh", default="128x8")
    parser.add_argument("--budget-gib", type=float, default=80.0)
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    mesh = tuple(int(n) for n in args.mesh.split("x"))
    shapes = {**LLAMA_SHAPES["llama-2-70b"], "n_layer": args.layers}
    started = time.perf_counter()
    with torch.device("meta"):
        model = build_model("llama", **shapes).to(torch.bfloat16)  # trained in bf16
        inputs = example_batch(
            "llama", args.batch, seq_len=args.seq_len, **{k: v for k, v in shapes.items() if k in ("vocab_size",)}
        )
    inputs = tuple(t.to("meta") for t in inputs)
    plan = autopar.plan(
        model,
        mesh,
        example_inputs=inputs,
        cluster="h100-80g",
        memory_budget=args.budget_gib * 2**30,
        time_limit_s=args.time_limit,
    )
    elapsed = time.perf_counter() - started
    print("\n".join(plan.summary().splitlines()[:7]))
    print(f"planned {args.layers} layers on mesh {mesh} in {elapsed:.1f} s")
    if args.out:
        pred = plan.predicted
        row = {
            "layers": args.layers,
            "mesh": args.mesh,
            "batch": args.batch,
            "seq_len": args.seq_len,
            "plan_s": round(elapsed, 1),
            "solver": plan.solver.status,
            "step_time_s": pred.step_time_s,
            "peak_memory_gib": pred.peak_memory_bytes / 2**30,
            "peak_at": pred.peak_memory_at or "",
            **{f"sent_axis{i}_gib": b / 2**30 for i, b in enumerate(pred.comm_bytes_per_axis or ())},
        }
        new = not os.path.exists(args.out)
        with open(args.out, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(row))
            if new:
                writer.writeheader()
            writer.writerow(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
