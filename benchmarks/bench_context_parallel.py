"""Context parallelism at 128k tokens: LLaMA-3-8B on 64 H100s, autopar's plan against
torchtitan's CP x FSDP layout (issue 19). Predicted figures (offline planning, meta tensors).

    python benchmarks/bench_context_parallel.py                  # every case, 32 layers
    python benchmarks/bench_context_parallel.py --layers 2       # the same at another depth

The model is ``autopar.zoo.Llama`` with LLaMA-3-8B's published shapes (``LLAMA_SHAPES``): causal
``scaled_dot_product_attention(is_causal=True)`` with repeated key/value heads, as torchtitan's
and Hugging Face's SDPA paths run it. Mesh (8, 8) on the ``h100-80g`` preset (axis 0 across the
8 nodes, axis 1 the 8 GPUs of a node), ``precision="bf16-mixed"``, the default memory budget.

Layouts (``case``):

- ``autopar``: what ``autopar.plan`` does given the mesh, the cluster and the precision.
- ``autopar-no-cp``: the same, with the context-parallel row taken out of the attention rule
  (an ablation: what the solver could do before this work).
- ``torchtitan-cp8-fsdp8``: torchtitan's layout pinned (``forced``), everything else solved:
  context parallelism of degree 8 inside a node (``parallelism.context_parallel_degree = 8``,
  torchtitan's default head-tail load balancer), the batch split over the 8 nodes
  (``data_parallel_shard_degree = -1``: the remaining 8), and FSDP2 sharding every parameter over
  the flattened dp_shard x cp mesh of 64 (torchtitan applies ``fully_shard`` on ``dp_shard_cp``):
  attention (S(0), S(2)), every parameter (S(0), S(0)). With one sequence (batch 1) there is no
  batch to split: context parallelism of degree 64 over both axes, attention (S(2), S(2)).
  The layout is torchtitan's; its price is autopar's cost model running autopar's kernel
  (all-gathered K/V, head-tail balanced over all its ranks, recomputed in backward), not
  torchtitan's ring attention.

``batch`` is sequences per step: 8 (one per data-parallel rank, torchtitan's local batch 1) and 1
(a single 128k sequence over all 64 GPUs).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.ir.options import (
    PlanOptions,  # noqa: E402
    precision_policy,  # noqa: E402
)
from autopar.ir.spec import S, parse_spec  # noqa: E402
from autopar.rules import registry  # noqa: E402
from autopar.solver import solve  # noqa: E402
from autopar.trace import trace  # noqa: E402
from autopar.zoo.models import LLAMA_SHAPES, Llama  # noqa: E402

SDPA = torch.ops.aten.scaled_dot_product_attention.default
MESH = (8, 8)
SEQ = 131072


def _forced_torchtitan(traced, batch: int) -> dict:
    forced = {}
    attention = (S(0), S(2)) if batch > 1 else (S(2), S(2))
    for node in traced.gm.graph.nodes:
        if node.target is SDPA:
            forced[node.name] = attention
    for graph_input in traced.placeholders("param"):
        forced[graph_input.name] = parse_spec(["S(0)", "S(0)"])
    return forced


class _WithoutContextParallel:
    """Take the context-parallel row out of the attention rule while planning (the ablation)."""

    def __enter__(self):
        self.rule = registry.RULES[SDPA]
        registry.RULES[SDPA] = lambda info: [r for r in self.rule(info) if r.kernel != "sdpa_context_parallel"]

    def __exit__(self, *exc):
        registry.RULES[SDPA] = self.rule


def plan_case(case: str, batch: int, layers: int) -> dict:
    shapes = dict(LLAMA_SHAPES["llama-3-8b"], n_layer=layers)
    with torch.device("meta"):
        model = Llama(**shapes)
    idx = torch.zeros(batch, SEQ, dtype=torch.long, device="meta")
    start = time.perf_counter()
    # What autopar.plan does (api.plan_traced), with the option of pinned specs.
    policy = precision_policy("bf16-mixed")
    cluster = get_cluster("h100-80g")
    traced = trace(model, (idx, idx), None, policy)
    forced = _forced_torchtitan(traced, batch) if case == "torchtitan-cp8-fsdp8" else None
    context = _WithoutContextParallel() if case == "autopar-no-cp" else contextlib.nullcontext()
    with context:
        plan = solve(traced, MESH, cluster, PlanOptions.from_keywords(checkpointing=True, precision=policy), forced=forced)
    seconds = time.perf_counter() - start
    attention = [node for node in plan.nodes.values() if node.op == str(SDPA)]
    first = attention[0]
    pred, solver = plan.predicted, plan.solver
    return {
        "case": case,
        "layers": layers,
        "mesh": "x".join(map(str, MESH)),
        "batch": batch,
        "seq": SEQ,
        "attention": "(" + ", ".join(map(str, first.outs[0])) + ")" + (" cp" if first.kernel else ""),
        "attention_ms": round(first.cost_s * 1e3, 3),
        "step_s": round(pred.step_time_s, 3),
        "peak_gib": round(pred.peak_memory_bytes / 2**30, 1),
        "budget_gib": round(solver.memory_budget_bytes / 2**30, 1),
        "comm_gib": round((pred.comm_bytes or 0.0) / 2**30, 1),
        "checkpointed": len(plan.memory.checkpoint) if plan.memory else 0,
        "solver": solver.method,
        "plan_s": round(seconds, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=["autopar", "autopar-no-cp", "torchtitan-cp8-fsdp8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[8, 1])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for batch in args.batches:
        for case in args.cases:
            row = plan_case(case, batch, args.layers)
            print(row, flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
