"""Planning time against model depth, end to end, for three decoder families on the meta device.

    python benchmarks/bench_plan_time.py --layers 12 48 --out benchmarks/results/plan_time.csv
    python benchmarks/bench_plan_time.py --models gpt --layers 2 12 48 96 --export

Each row is ``autopar.plan`` with its defaults (the device's memory as the budget, checkpointing
allowed where it binds), split in two: ``trace_s`` (``trace.trace_repeated``: a deep model's
graph built from a two-layer export, checked against a three-layer one) and ``plan_s``
(``api.plan_traced``: strategies and prices, the ILP, memory decisions, explanations).
``--export`` also times the full-depth ``torch.export`` (``trace.trace``, as ``compile`` runs
it) and checks that both graphs hash the same. The ratio column is each depth's total over the
smallest depth's, per model. Models:

- ``gpt``: the zoo's GPT at GPT-2 width (768, 12 heads), batch 8 × 1024, mesh (2, 4);
- ``llama``: the zoo's Llama at LLaMA-2-70B widths, batch 8 × 4096, mesh (128, 8);
- ``hf-llama``: Hugging Face ``LlamaForCausalLM`` at LLaMA-2-70B widths in bf16, batch
  8 × 4096, mesh (128, 8) (as ``bench_llm_plan.py``); ``hf-llama-128``: the same at batch
  128 × 4096. For the zoo's Llama the default budget binds at 48 layers and not at 12, so the
  two depths take different paths through the solver (a binding budget adds LP solves,
  roundings and liveness walks: ``solver.search.budget``); on the HF models it no longer binds
  (2026-11-29: ``hf-llama`` peaks at 40 and 66 GiB at 48 and 80 layers, ``hf-llama-128`` at
  69 GiB at 48, under 72; 80 not measured).

- ``gpt-oss``: a tiny Hugging Face GPT-OSS (width 64, 4 experts), batch 4 × 32, mesh (2, 2):
  ``--models gpt-oss --layers 2 --memory-budget inf --state-budget 0.6`` is issue 48's budgeted
  planning case, where no sharding fits alone (``solver.search.lean``).

``--state-budget F`` also plans each row under F × its parameter, gradient and AdamW bytes with
``offload="auto"`` (``--offload off``: checkpointing alone), from the same trace: ``budget_ratio``
(and ``budget_ratio_cpu``) is that plan's time over the row's own ``plan_s``. ``--default-budget`` does the same under the device's
default budget (issue 48's LLaMA-2-70B cases, with ``--memory-budget inf``:
``--models hf-llama hf-llama-128 llama --layers 48 80 --memory-budget inf --default-budget``).
Each row plans both once untimed first, so that neither timed plan pays the process's first run
of its path (imports, HiGHS start-up, the first Lagrangian solve) and the order of the two does
not tilt the ratio.

``--memory-budget inf`` plans without the default budget, so that every depth takes the same
path through the solver (with it, a deep model's budget may bind where a shallow one's does not).
Times are wall-clock on whatever machine runs this; compare rows of one run only. ``--repeat N``
plans each (model, depth) N times, depths interleaved, and keeps the minimum of each time column
(a shared machine only ever adds time; ``total_s`` is the fastest run's, not a sum of minima); the
ratio is taken between those minima; ``paired_ratio_median`` is the median over the repeats of
each repeat's own ratio (its rows run back to back, so a change in the machine's speed between
repeats cancels out, and a burst in one row is outvoted). ``total_cpu_s`` is the process's CPU time for the same
work (``time.process_time``), which other jobs on a loaded machine disturb far less than wall
time; ``cpu_ratio_to_smallest`` is its ratio. ``plan_hash`` is ``Plan.hash`` (the whole plan
JSON, explanations included): a change meant to make planning faster and nothing else must leave
it the same, row by row, as the code before it.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from autopar.api import plan_traced, quiet_gc  # noqa: E402
from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.ir.options import PlanOptions  # noqa: E402
from autopar.trace import trace, trace_repeated  # noqa: E402
from autopar.zoo.models import GPT, LLAMA_SHAPES, build_model  # noqa: E402

MODELS = ("gpt", "llama", "hf-llama", "hf-llama-128", "gpt-oss")
TIMES = (
    "trace_s",
    "plan_s",
    "total_s",
    "total_cpu_s",
    "export_s",
    "plan_cpu_s",
    "budgeted_plan_s",
    "budgeted_plan_cpu_s",
)  # columns --repeat keeps the minimum of


def build(name: str, layers: int):
    """(model, example args, example kwargs, mesh), built on the meta device."""
    if name == "gpt":
        with torch.device("meta"):
            model = GPT(vocab_size=50304, block_size=1024, n_layer=layers, n_head=12, n_embd=768, bias=False)
            idx = torch.zeros(8, 1024, dtype=torch.long)
        return model, (idx, idx), None, (2, 4)
    if name == "llama":
        with torch.device("meta"):
            model = build_model("llama", **{**LLAMA_SHAPES["llama-2-70b"], "n_layer": layers})
            idx = torch.zeros(8, 4096, dtype=torch.long)
        return model, (idx, idx), None, (128, 8)
    import transformers

    if name == "gpt-oss":
        return _gpt_oss(layers)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        num_hidden_layers=layers,
        use_cache=False,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        ids = torch.zeros(128 if name == "hf-llama-128" else 8, 4096, dtype=torch.long)
    return model, (), {"input_ids": ids, "labels": ids.clone()}, (128, 8)


def _gpt_oss(layers: int):
    """A tiny Hugging Face GPT-OSS (width 64, 4 experts, top 2), batch 4 x 32, mesh (2, 2): the
    budgeted case of issue 48, where no sharding fits 60% of its state alone (``--state-budget``)."""
    import transformers

    config = transformers.GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
        use_cache=False,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    ids = torch.randint(0, 256, (4, 32))
    return model, (), {"input_ids": ids, "labels": ids.clone()}, (2, 2)


def _state_bytes(model: torch.nn.Module) -> float:
    """Parameter, gradient and AdamW state bytes (four copies of the parameters)."""
    return 4.0 * sum(p.numel() * p.element_size() for p in model.parameters())


def _budgeted(traced, mesh, cluster, budget: float | None, offload: str = "auto") -> dict:
    """The same traced model planned under ``budget`` with ``offload``: its time and plan."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    plan = plan_traced(traced, mesh, cluster, PlanOptions.from_keywords(memory_budget=budget, offload=offload))
    return {
        "budgeted_plan_s": round(time.perf_counter() - start, 2),
        "budgeted_plan_cpu_s": round(time.process_time() - cpu, 2),
        "budgeted_method": plan.solver.method,
        "budgeted_step_s": plan.predicted.step_time_s,
        "budgeted_peak_bytes": plan.predicted.peak_memory_bytes,
        "budget_bytes": int(plan.solver.memory_budget_bytes or 0),
        "budgeted_plan_hash": plan.hash,
    }


def plan_row(
    name: str,
    layers: int,
    export: bool,
    memory_budget: float | None = None,
    state_budget: float | None = None,
    default_budget: bool = False,
    offload: str = "auto",
) -> dict:
    model, args, kwargs, mesh = build(name, layers)
    cluster = get_cluster("h100-80g")
    # The last row's model and plan are garbage now: collect them before the clock starts, so
    # that a full collection of one row's leftovers does not land in the next row's time.
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    with quiet_gc():  # as ``autopar.plan`` traces (``api._trace``); ``plan_traced`` runs under it itself
        traced = trace_repeated(model, args, kwargs)
    trace_s, trace_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    budgeted = state_budget is not None or default_budget
    budget = None if default_budget or not budgeted else state_budget * _state_bytes(model)
    if budgeted:  # a warm-up of both: the ratio compares warm plans, neither paying its path's first run
        plan_traced(traced, mesh, cluster, PlanOptions.from_keywords(memory_budget=memory_budget))
        _budgeted(traced, mesh, cluster, budget, offload)
        gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    plan = plan_traced(traced, mesh, cluster, PlanOptions.from_keywords(memory_budget=memory_budget))
    plan_s, plan_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    row = {
        "model": name,
        "layers": layers,
        "mesh": "x".join(map(str, mesh)),
        "nodes": len(plan.nodes),
        "variables": plan.solver.num_variables,
        "method": plan.solver.method,
        "peak_gib": round(plan.predicted.peak_memory_bytes / 2**30, 1),
        "step_s": round(plan.predicted.step_time_s, 4),
        "objective_s": plan.solver.objective_s,
        "plan_hash": plan.hash,  # of the whole plan JSON, explanations included
        "trace_s": round(trace_s, 2),
        "plan_s": round(plan_s, 2),
        "total_s": round(trace_s + plan_s, 2),
        "total_cpu_s": round(trace_cpu_s + plan_cpu_s, 2),
        "plan_cpu_s": round(plan_cpu_s, 2),
    }
    if budgeted:  # the plan above against one under a budget
        row.update(_budgeted(traced, mesh, cluster, budget, offload), offload=offload)
        row["budget_ratio"] = round(row["budgeted_plan_s"] / plan_s, 2)
        row["budget_ratio_cpu"] = round(row["budgeted_plan_cpu_s"] / plan_cpu_s, 2)
    if export:
        start = time.perf_counter()
        with quiet_gc():  # as ``compile`` exports
            real = trace(model, args, kwargs)
        row["export_s"] = round(time.perf_counter() - start, 2)
        row["same_graph"] = real.graph_hash == traced.graph_hash
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS[:3]), choices=MODELS)
    parser.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    parser.add_argument("--export", action="store_true", help="also time the full-depth export and compare hashes")
    parser.add_argument("--out", default="benchmarks/results/plan_time.csv")
    parser.add_argument("--append", action="store_true", help="add rows to --out (same columns) instead of replacing it")
    parser.add_argument("--repeat", type=int, default=1, help="plan each row this many times; keep the fastest")
    parser.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="bytes per device (default: the device's memory less its reserve; inf: none)",
    )
    parser.add_argument(
        "--state-budget",
        type=float,
        default=None,
        help="also plan each row under this share of its parameter, gradient and AdamW bytes with "
        'offload="auto" (with --memory-budget inf: budgeted against unbounded, budget_ratio)',
    )
    parser.add_argument(
        "--default-budget",
        action="store_true",
        help='also plan each row under the default budget with offload="auto" (budget_ratio, as --state-budget)',
    )
    parser.add_argument(
        "--offload",
        default="auto",
        choices=("auto", "off", "cpu", "disk"),
        help="the budgeted plans' offload (default auto; off: checkpointing alone)",
    )
    args = parser.parse_args()
    rows = []
    for name in args.models:
        best: dict[int, dict] = {}
        totals: dict[int, list[float]] = {layers: [] for layers in args.layers}  # per repeat
        for _ in range(args.repeat):
            for layers in args.layers:
                row = plan_row(
                    name, layers, args.export, args.memory_budget, args.state_budget, args.default_budget, args.offload
                )
                print(row, flush=True)
                totals[layers].append(row["total_s"])
                if layers in best:  # the first repeat's plan; a time-limited MILP may differ
                    same = all(row[k] == best[layers][k] for k in ("method", "peak_gib", "step_s", "objective_s", "plan_hash"))
                    row = {k: min(v, row[k]) if k in TIMES else v for k, v in best[layers].items()}
                    row["same_plan"] = row.get("same_plan", True) and same
                best[layers] = row
        first = first_cpu = None
        for layers in args.layers:
            row = best[layers]
            first = first or row["total_s"]
            row["ratio_to_smallest"] = round(row["total_s"] / first, 2)
            first_cpu = first_cpu or row["total_cpu_s"]
            row["cpu_ratio_to_smallest"] = round(row["total_cpu_s"] / first_cpu, 2)
            # Each repeat plans the depths back to back: the ratio within a repeat sees the
            # machine at one speed, and the median over repeats ignores a burst in either row.
            paired = [total / smallest for total, smallest in zip(totals[layers], totals[args.layers[0]])]
            row["paired_ratio_median"] = round(statistics.median(paired), 2)
            if "budgeted_plan_s" in row:  # of the minima, as the ratios above
                row["budget_ratio"] = round(row["budgeted_plan_s"] / row["plan_s"], 2)
                row["budget_ratio_cpu"] = round(row["budgeted_plan_cpu_s"] / row["plan_cpu_s"], 2)
            row["repeats"] = args.repeat
            rows.append(row)
            print("min:", row, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a" if args.append else "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        if not args.append:
            writer.writeheader()
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
