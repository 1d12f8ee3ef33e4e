"""Plan quality: autopar's predicted step time over the best hand plan's, on the same cost model.

    python benchmarks/bench_quality.py --budget-gib 80 # every cell (long: deep models, 8 plans each)
    python benchmarks/bench_quality.py --quick         # the same shapes at 4 layers
    python benchmarks/bench_quality.py --precision bf16-mixed --cells llama-3-8b:8,64 \
        llama-2-70b:64,512,1024 --out benchmarks/results/quality_bf16.csv   # issue 17's cells
    python benchmarks/bench_quality.py --precision bf16-mixed --reduce-dtype bfloat16 ...  # FSDP2's default

GPT-2-XL, LLaMA-3-8B and LLaMA-2-70B shapes (``autopar.zoo.models``) on the meta device,
``h100-80g`` at 8, 64, 512 and 1,024 devices, with the device's memory less its reserve as the
budget (``--budget-gib`` sets another), activation checkpointing allowed where the budget binds
(``autopar.plan``'s default; ``--no-checkpointing`` forbids it), and ``--precision`` as in
``autopar.plan`` ("32-true" by default). Hand plans are ``autopar.hand_plan`` kinds: parameters
(and for ``megatron_sp`` the residual stream) laid out as the technique prescribes, everything
else (checkpointing included) chosen by the solver. A ratio above 1 in any cell makes
the script exit with status 1 (above 1 + 1e-4, the MILP gap tolerance). "infeasible" means the plan does not fit the budget.

Bytes communicated per device per step (``predicted.comm_bytes``) are set against the analytic
volumes (ring collectives, P = parameter bytes, A = one layer's activation bytes B·S·H·4, L layers,
N devices, t = the inner mesh axis, d = N / t):
    DDP and ZeRO-1/2: 2(N-1)/N · P          (all-reduce, or reduce-scatter + all-gather)
    ZeRO-3 (FSDP):    3(N-1)/N · P          (all-gather forward and backward, reduce-scatter)
    Megatron TP × DP: 8(t-1)/t · A · L + 2(d-1)/d · P/t
                      (two all-reduces per layer forward and two backward, then DP on P/t)
Writes ``results/quality.csv`` and ``results/quality.png``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time

import torch

from autopar.cost.cluster import get_cluster, resolve_budget
from autopar.errors import InfeasibleError
from autopar.ir.options import PlanOptions, precision_policy
from autopar.solver import solve
from autopar.solver.planners.hand_plans import KINDS, hand_specs, zero_stage
from autopar.solver.search.backends import MIP_REL_GAP
from autopar.trace import trace_repeated
from autopar.zoo.models import LLAMA_SHAPES, build_model

MODELS = {
    # name: (builder name, config, sequences, tokens per sequence)
    "gpt2-xl": ("gpt", dict(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600, bias=False), 64, 1024),
    "llama-3-8b": ("llama", LLAMA_SHAPES["llama-3-8b"], 64, 4096),
    "llama-2-70b": ("llama", LLAMA_SHAPES["llama-2-70b"], 128, 4096),
}
MESHES = {8: (8,), 64: (8, 8), 512: (64, 8), 1024: (128, 8)}


def build(name: str, quick: bool):
    builder, config, batch, seq = MODELS[name]
    config = dict(config)
    if quick:
        config["n_layer"] = 4
    with torch.device("meta"):
        model = build_model(builder, **config)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, idx), config, batch, seq


def analytic_bytes(model, config, batch: int, seq: int, mesh: tuple[int, ...]) -> dict:
    params = 4 * sum(p.numel() for p in model.parameters())
    devices = 1
    for size in mesh:
        devices *= size
    tp = mesh[-1] if len(mesh) > 1 else devices
    dp = devices // tp
    activation = batch * seq * config["n_embd"] * 4
    return {
        "ddp_zero12_gib": 2 * (devices - 1) / devices * params / 2**30,
        "zero3_gib": 3 * (devices - 1) / devices * params / 2**30,
        "megatron_gib": (8 * (tp - 1) / tp * activation * config["n_layer"] + 2 * (dp - 1) / dp * params / tp) / 2**30,
    }


def run_cell(name: str, traced, model, config, batch, seq, devices: int, budget: float, precision, checkpointing: bool) -> dict:
    mesh = MESHES[devices]
    cluster = get_cluster("h100-80g")
    row: dict = {
        "model": name,
        "layers": config["n_layer"],
        "devices": devices,
        "mesh": "x".join(map(str, mesh)),
        "precision": precision.name if precision else "32-true",
        "budget_gib": round(budget / 2**30, 1),
    }
    options = PlanOptions.from_keywords(memory_budget=budget, precision=precision, checkpointing=checkpointing)
    start = time.perf_counter()
    try:
        auto = solve(traced, mesh, cluster, options)
    except InfeasibleError:
        auto = None
    row["plan_s"] = round(time.perf_counter() - start, 2)
    row["autopar_step_s"] = auto.predicted.step_time_s if auto else "infeasible"
    row["autopar_gap"] = auto.solver.gap if auto else ""
    row["autopar_peak_gib"] = round(auto.predicted.peak_memory_bytes / 2**30, 2) if auto else ""
    row["autopar_comm_gib"] = round(auto.predicted.comm_bytes / 2**30, 3) if auto else ""
    row["autopar_checkpointed"] = len(auto.memory.checkpoint) if auto and auto.memory else 0
    row["autopar_layout"] = layout(auto) if auto else ""
    row.update({k: round(v, 3) for k, v in analytic_bytes(model, config, batch, seq, mesh).items()})
    best = None
    for kind in KINDS:
        try:
            hand = solve(traced, mesh, cluster, options, forced=hand_specs(kind, traced, mesh), zero_stage=zero_stage(kind))
        except InfeasibleError:
            row[f"{kind}_step_s"] = "infeasible"
            continue
        row[f"{kind}_step_s"] = hand.predicted.step_time_s
        row[f"{kind}_comm_gib"] = round(hand.predicted.comm_bytes / 2**30, 3)
        if best is None or hand.predicted.step_time_s < best[1]:
            best = (kind, hand.predicted.step_time_s)
    row["best_hand"] = best[0] if best else "none feasible"
    if best and auto:
        row["ratio_to_best_hand"] = round(auto.predicted.step_time_s / best[1], 4)
    elif best:
        row["ratio_to_best_hand"] = "autopar infeasible"
    else:
        row["ratio_to_best_hand"] = ""
    return row


def layout(plan) -> str:
    """How the plan lays out the first layer's attention and MLP weights, e.g. ``wq (S(0), S(0))``:
    enough to tell FSDP (parameters split on every axis, gathered for use) from TP × FSDP."""
    names = ("attn.q_proj.weight", "self_attn.q_proj.weight", "mlp.gate.weight", "mlp.gate_proj.weight")
    picked = []
    for fqn, spec in sorted(plan.params.items()):
        if ".0." in fqn and fqn.endswith(names):
            picked.append(f"{fqn.rsplit('.', 2)[-2]} {'x'.join(str(p) for p in spec)}")
    return "; ".join(picked)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [r for r in rows if isinstance(r.get("ratio_to_best_hand"), float)]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['model']}\n{r['devices']} dev" for r in cells]
    ax.bar(range(len(cells)), [r["ratio_to_best_hand"] for r in cells], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(cells)), labels, fontsize=8)
    ax.set_ylabel("autopar / best hand plan\n(predicted step time)")
    ax.set_title("Plan quality on h100-80g, 80 GiB per device (lower is better; 1.0 = best hand plan)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/quality.csv")
    parser.add_argument(
        "--budget-gib", type=float, default=None, help="bytes per device in GiB (default: the device's memory less its reserve)"
    )
    parser.add_argument("--precision", default=None, help="32-true (default), bf16-mixed or bf16-true")
    parser.add_argument(
        "--reduce-dtype", default=None, help="replace the policy's reduce_dtype (bfloat16: FSDP2's default with bf16-mixed)"
    )
    parser.add_argument("--no-checkpointing", action="store_true", help="forbid activation checkpointing")
    parser.add_argument("--quick", action="store_true", help="4 layers per model instead of the full depth")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--devices", nargs="*", type=int, default=[8, 64, 1024])
    parser.add_argument(
        "--cells", nargs="*", default=None, help="MODEL:N,N,... (instead of --models x --devices), e.g. llama-2-70b:64,1024"
    )
    args = parser.parse_args()
    cells = {name: list(args.devices) for name in args.models}
    if args.cells:
        cells = {cell.split(":")[0]: [int(n) for n in cell.split(":")[1].split(",")] for cell in args.cells}
    cluster = get_cluster("h100-80g")
    budget = resolve_budget(None if args.budget_gib is None else args.budget_gib * 2**30, cluster)
    precision = precision_policy(args.precision)
    if args.reduce_dtype is not None:
        precision = dataclasses.replace(
            precision, reduce_dtype=args.reduce_dtype, name=f"{precision.name}+reduce-{args.reduce_dtype}"
        )
    rows = []
    for name, device_counts in cells.items():
        model, batch_inputs, config, batch, seq = build(name, args.quick)
        traced = trace_repeated(model, batch_inputs, precision=precision)
        for devices in device_counts:
            rows.append(run_cell(name, traced, model, config, batch, seq, devices, budget, precision, not args.no_checkpointing))
            print(rows[-1], flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")
    # Both sides are MILP optima to within MIP_REL_GAP, so a tie can read that much above 1.
    limit = 1.0 + MIP_REL_GAP
    worse = [r for r in rows if isinstance(r.get("ratio_to_best_hand"), float) and r["ratio_to_best_hand"] > limit]
    worse += [r for r in rows if r.get("ratio_to_best_hand") == "autopar infeasible"]
    for row in worse:
        print(
            f"FAIL: autopar is predicted slower than {row['best_hand']} on {row['model']} at {row['devices']} devices: "
            f"ratio {row['ratio_to_best_hand']}",
            file=sys.stderr,
        )
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
