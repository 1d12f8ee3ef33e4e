"""Step time of "bf16-mixed" and "bf16-reduce" against "32-true", one plan kind, in one run, on gloo.

    python benchmarks/bench_precision.py                 # 4 ranks, ddp and fsdp, 6 steps
    python benchmarks/bench_precision.py --ranks 2 --steps 4 --kinds ddp

bench_runtime.py's GPT (4 layers, 256 wide, 16 sequences of 128 tokens) with fp32 weights,
compiled on mesh (ranks,) under a hand plan (``autopar.hand_plan(kind, ..., precision=p)``) for
each precision, and trained with ``torch.optim.AdamW`` over ``pm.parameters()`` (fp32 masters
in all) for ``--steps`` steps after two warm-up steps. "bf16-reduce" is FSDP2's default policy,
``MixedPrecision("bfloat16", "bfloat16", "float32")``: "bf16-mixed" with gradients reduced in
bf16. The precisions run one after the other in the same spawned ranks, so the ratio compares
like with like on this machine (the CPU's
bf16 matmuls: AMX where it has them). Rank 0's median step time is reported. Writes
``results/precision_gloo.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch

CONFIG = dict(vocab_size=1024, block_size=128, n_layer=4, n_head=8, n_embd=256, tied=False)
BATCH = 16
# FSDP2's default policy: bf16 gradient reductions into the fp32 masters.
BF16_REDUCE = dict(param_dtype="bfloat16", reduce_dtype="bfloat16", master_dtype="float32", name="bf16-reduce")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-reduce")


def _rank(rank: int, world: int, kinds: list[str], steps: int) -> list[dict]:
    import autopar
    from autopar.zoo.models import build_model, example_batch

    torch.set_num_threads(1)
    rows = []
    for kind in kinds:
        for name in PRECISIONS:
            precision = autopar.MixedPrecision(**BF16_REDUCE) if name == "bf16-reduce" else name
            model = build_model("gpt", seed=0, **CONFIG)
            batch = example_batch("gpt", BATCH, seed=1, **CONFIG)
            plan = autopar.hand_plan(kind, model, (world,), example_inputs=batch, cluster="cpu", precision=precision)
            pm = autopar.compile(model, (world,), example_inputs=batch, plan=plan)
            optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
            times = []
            for step in range(steps + 2):
                start = time.perf_counter()
                optimizer.zero_grad()
                pm(*batch).backward()
                optimizer.step()
                torch.distributed.barrier()
                if step >= 2:  # two warm-up steps
                    times.append(time.perf_counter() - start)
            rows.append(
                {
                    "kind": kind,
                    "precision": name,
                    "ranks": world,
                    "step_s": statistics.median(times),
                    "loss": float(pm(*batch).item()),
                    "predicted_step_s": plan.predicted.step_time_s,
                    "predicted_comm_bytes": plan.predicted.comm_bytes,
                }
            )
    return rows


def main() -> None:
    from autopar.runtime.tools.launch import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kinds", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "precision_gloo.csv"))
    args = parser.parse_args()
    rows = run_distributed(_rank, args.ranks, args.kinds, args.steps, timeout_s=1800)[0]
    base = {row["kind"]: row["step_s"] for row in rows if row["precision"] == "32-true"}
    for row in rows:
        row["over_32_true"] = row["step_s"] / base[row["kind"]]
        print(
            f"{row['kind']:6s} {row['precision']:10s} {row['ranks']} ranks: {row['step_s'] * 1e3:8.1f} ms/step "
            f"({row['over_32_true']:.2f}x 32-true)  loss {row['loss']:.4f}"
        )
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
