"""Plan quality: autopar's predicted step time over the best hand plan's, on the same cost model.

    python benchmarks/bench_quality.py --out benchmarks/results/quality.csv

GPT-shaped models on the meta device, `h100-80g`, 80 GiB budget per device. Hand plans are
``autopar.hand_plan`` kinds (ddp, fsdp, megatron, tp_fsdp): parameters laid out as the technique
prescribes, everything else chosen by the solver. A ratio below 1 means autopar found a faster
plan; "infeasible" means the hand plan does not fit the budget. (LLaMA shapes need the Hugging
Face models; these are GPT blocks of the same widths and depths.)
"""

from __future__ import annotations

import argparse
import csv
import os
import time

import torch

from autopar.cost.cluster import get_cluster
from autopar.errors import InfeasibleError
from autopar.hand_plans import KINDS, param_specs
from autopar.models import GPT
from autopar.solver import solve
from autopar.trace import trace

MODELS = {
    # name: (layers, width, heads, vocab, sequences, tokens per sequence)
    "gpt2-xl": (48, 1600, 25, 50304, 64, 1024),
    "gpt-8b": (32, 4096, 32, 128256, 64, 4096),
    "gpt-65b": (80, 8192, 64, 32000, 128, 4096),
}
MESHES = {8: (8,), 64: (8, 8), 1024: (128, 8)}
CASES = [("gpt2-xl", 8), ("gpt2-xl", 64), ("gpt-8b", 64), ("gpt-65b", 1024)]


def run_case(name: str, devices: int, budget: float) -> dict:
    layers, width, heads, vocab, batch, seq = MODELS[name]
    with torch.device("meta"):
        model = GPT(vocab_size=vocab, block_size=seq, n_layer=layers, n_head=heads, n_embd=width, bias=False)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    mesh = MESHES[devices]
    cluster = get_cluster("h100-80g")
    traced = trace(model, (idx, idx))
    row: dict = {"model": name, "devices": devices, "mesh": "x".join(map(str, mesh))}
    start = time.perf_counter()
    auto = solve(traced, mesh, cluster, memory_budget=budget)
    row["plan_s"] = round(time.perf_counter() - start, 2)
    row["autopar_step_s"] = auto.predicted["step_time_s"]
    row["autopar_peak_gib"] = round(auto.predicted["peak_memory_bytes"] / 2**30, 2)
    best = None
    for kind in KINDS:
        try:
            hand = solve(traced, mesh, cluster, memory_budget=budget, forced=param_specs(kind, traced, mesh))
        except InfeasibleError:
            row[f"{kind}_step_s"] = "infeasible"
            continue
        row[f"{kind}_step_s"] = hand.predicted["step_time_s"]
        if best is None or hand.predicted["step_time_s"] < best[1]:
            best = (kind, hand.predicted["step_time_s"])
    row["best_hand"] = best[0] if best else "none feasible"
    row["ratio_to_best_hand"] = round(auto.predicted["step_time_s"] / best[1], 4) if best else ""
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/quality.csv")
    parser.add_argument("--budget-gib", type=float, default=80)
    args = parser.parse_args()
    rows = []
    for name, devices in CASES:
        rows.append(run_case(name, devices, args.budget_gib * 2**30))
        print(rows[-1], flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
