"""Mixtral-8x7B on 64 H100s: autopar's plan against the hand expert-parallel × FSDP layout.

Hugging Face's ``MixtralForCausalLM`` with Mixtral-8x7B's published config (32 layers, hidden
4096, SwiGLU 14336, 8 experts, top-2, 32 query and 8 key/value heads, vocabulary 32000), in
bfloat16 on the meta device, 64 sequences of 4096 tokens, mesh (8, 8), ``h100-80g`` (its default
memory budget). Planned by ``autopar.plan`` and, on the same traced graph and cost model, by the
hand plans ``ep_fsdp`` (experts split by expert on the inner axis, FSDP on the outer; every other
parameter FSDP) and ``fsdp`` (ZeRO-3 everywhere). Predictions only.

    python benchmarks/bench_moe.py [--layers 32] [--out benchmarks/results/moe.csv]
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch
import transformers

import autopar
from autopar.errors import InfeasibleError
from autopar.zoo.shapes import HF_MIXTRAL_8X7B

GIB = 2**30


def mixtral(num_layers: int, batch: int, seq: int) -> tuple[torch.nn.Module, dict]:
    config = transformers.MixtralConfig(**HF_MIXTRAL_8X7B, num_hidden_layers=num_layers, max_position_embeddings=seq)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def describe(plan: autopar.Plan) -> dict:
    pred = plan.predicted
    experts = sorted({" ".join(str(p) for p in spec) for fqn, spec in plan.params.items() if ".experts." in fqn})
    moe = [d for d in plan.nodes.values() if d.op == "autopar.moe_experts.default"]
    kernels = sorted({f"{d.kernel or 'none'}{list(d.kernel_axes)}" for d in moe})
    records = pred.expert_parallel or []
    return {
        "step_s": round(pred.step_time_s, 4),
        "peak_gib": round(pred.peak_memory_bytes / GIB, 2),
        "comm_gib": round(pred.comm_bytes / GIB, 2),
        "expert_specs": "; ".join(experts),
        "moe_kernel": "; ".join(kernels),
        "ep_degree": max((r["degree"] for r in records), default=1),
        "all_to_all_s": round(sum(r["all_to_all_s"] for r in records), 4),
        "moe_cost_s": round(sum(d.cost_s for d in moe), 4),
        "solver": plan.solver.status,
        "gap": plan.solver.gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "moe.csv")
    args = parser.parse_args()
    model, kwargs = mixtral(args.layers, args.batch, args.seq)
    mesh = (8, 8)
    rows = []
    for name in ("autopar", "ep_fsdp", "fsdp"):
        start = time.perf_counter()
        try:
            if name == "autopar":
                plan = autopar.plan(model, mesh, example_kwargs=kwargs, cluster="h100-80g")
            else:
                plan = autopar.hand_plan(name, model, mesh, example_kwargs=kwargs, cluster="h100-80g")
            row = {"plan": name, **describe(plan)}
        except InfeasibleError as error:
            row = {"plan": name, "step_s": "infeasible", "solver": str(error).splitlines()[0][:80]}
        row["plan_s"] = round(time.perf_counter() - start, 2)
        rows.append(row)
        print(row, flush=True)
    auto = rows[0]
    for row in rows[1:]:
        if isinstance(row.get("step_s"), float) and isinstance(auto.get("step_s"), float):
            row["autopar_over_this"] = round(auto["step_s"] / row["step_s"], 4)
    fields = [
        "plan",
        "step_s",
        "autopar_over_this",
        "peak_gib",
        "comm_gib",
        "ep_degree",
        "moe_kernel",
        "expert_specs",
        "moe_cost_s",
        "all_to_all_s",
        "solver",
        "gap",
        "plan_s",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
