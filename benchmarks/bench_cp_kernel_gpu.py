"""The context-parallel attention kernel's per-rank work on one GPU: does head-tail balance it?

    python benchmarks/bench_cp_kernel_gpu.py [--out results/cp_kernel_gpu.csv]

Simulates the 8 ranks of a context-parallel group one after another on one GPU: each rank's
query rows (``ir.context.query_chunks``: head-tail, or the contiguous split for comparison)
attend the whole K/V with ``ops.attention.attend_chunks`` (the kernel's math without its
collectives), forward and backward, in bfloat16 at LLaMA-3-8B's attention shapes (32 query
heads, 8 key/value heads, head dim 128) and 131,072 tokens. Printed per layout: each rank's
milliseconds, the most loaded rank over the mean (the cost model predicts it with
``ir.context.max_work_fraction``), and the whole causal attention in one call for reference.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autopar.ir.context import max_work_fraction, query_chunks  # noqa: E402
from autopar.ops.attention import attend_chunks  # noqa: E402

SEQ, RANKS, HEADS, KV_HEADS, HEAD_DIM = 131072, 8, 32, 8, 128


def _time(fn, repeats: int = 3) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_cp_kernel_gpu.py needs a CUDA device; none is visible here", file=sys.stderr)
        return 1
    kw = dict(device="cuda", dtype=torch.bfloat16)
    key = torch.randn(1, KV_HEADS, SEQ, HEAD_DIM, **kw, requires_grad=True)
    value = torch.randn(1, KV_HEADS, SEQ, HEAD_DIM, **kw, requires_grad=True)
    local = SEQ // RANKS
    rows = []
    for layout in ("contiguous", "head-tail"):
        times = []
        for rank in range(RANKS):
            chunks = ((rank * local, local),) if layout == "contiguous" else query_chunks(SEQ, (RANKS,), (rank,))
            query = torch.randn(1, HEADS, local, HEAD_DIM, **kw, requires_grad=True)
            grad = torch.randn_like(query)
            times.append(_time(lambda: attend_chunks(query, key, value, chunks, enable_gqa=True).backward(grad)))
        predicted = max_work_fraction(SEQ, (RANKS,)) if layout == "head-tail" else (2 * RANKS - 1) / RANKS
        row = {
            "layout": layout,
            **{f"rank{r}_ms": round(t, 1) for r, t in enumerate(times)},
            "max_over_mean": round(max(times) / (sum(times) / RANKS), 3),
            "predicted_max_over_mean": round(predicted, 3),
        }
        print(row, flush=True)
        rows.append(row)
    query = torch.randn(1, HEADS, SEQ, HEAD_DIM, **kw, requires_grad=True)
    grad = torch.randn_like(query)
    whole = _time(
        lambda: torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True).backward(
            grad
        ),
        repeats=2,
    )
    print(f"whole causal attention, one call, forward + backward: {whole:.1f} ms ({whole / RANKS:.1f} ms / {RANKS})")
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) + ["whole_ms"])
            writer.writeheader()
            writer.writerows({**row, "whole_ms": round(whole, 1)} for row in rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
