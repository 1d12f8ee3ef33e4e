"""Activation checkpointing policies on one device: predicted against measured step and peak.

    python benchmarks/bench_selective_ac.py            # on a GPU: issue #48's LLaMA-3-8B-wide job
    python benchmarks/bench_selective_ac.py --tiny     # on a CPU: a small LLaMA, to check it runs

The job (issue #48 item 2): a LLaMA with LLaMA-3-8B widths and 4 layers, bfloat16, batch
2 × 4096, one GPU, mesh (1,), priced on ``--cluster`` (default ``h100-80g``). Cases:

* ``none``, ``selective``, ``selective-op``, ``full``: ``checkpointing=`` that policy on every
  layer, no budget;
* ``budget_25GiB``: the planner chooses per layer (none / selective / selective-op / full) under 25 GiB, where
  HF's whole-layer checkpointing measured 24.95 GiB and 191.8 ms;
* ``budget_19.3GiB``: as above with ``offload="auto"``, where today's plan measured 459 ms.

Each case plans, compiles, runs 2 warm-up and 5 timed AdamW steps (``autopar.optim.AdamW`` when
the plan offloads), and records the median step, ``torch.cuda.max_memory_allocated``, the
plan's predicted step and peak, and the policy of each checkpointed layer. Writes
``benchmarks/results/selective_ac_<device>.json``. About 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import autopar  # noqa: E402
from autopar.zoo.models import LLAMA_SHAPES, Llama  # noqa: E402

GIB = 2**30


def _job(tiny: bool, device: torch.device):
    torch.manual_seed(0)
    if tiny:
        config, batch, seq = dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=128, hidden=256), 4, 256
    else:
        config, batch, seq = {**LLAMA_SHAPES["llama-3-8b"], "n_layer": 4}, 2, 4096
    with device:
        model = Llama(**config).to(torch.bfloat16)
    idx = torch.randint(0, config["vocab_size"], (batch, seq), device=device)
    return model, (idx, idx)


def _cases(tiny: bool, free_peak: float) -> dict[str, dict]:
    cases = {
        "none": dict(checkpointing=False, memory_budget=float("inf")),
        "selective": dict(checkpointing="selective", memory_budget=float("inf")),
        "selective-op": dict(checkpointing="selective-op", memory_budget=float("inf")),
        "full": dict(checkpointing="full", memory_budget=float("inf")),
    }
    # On a CPU the budgets mean nothing: the same fractions of the unbudgeted peak.
    tight, tighter = (0.9 * free_peak, 0.7 * free_peak) if tiny else (25 * GIB, 19.3 * GIB)
    cases[f"budget_{tight / GIB:.3g}GiB"] = dict(memory_budget=tight)
    cases[f"budget_{tighter / GIB:.3g}GiB"] = dict(memory_budget=tighter, offload="auto")
    return cases


def _measure(pm, batch, offloads: bool, device: torch.device, steps: int) -> tuple[float, float]:
    """(median step seconds, peak bytes allocated) over ``steps`` AdamW steps after 2 warm-ups."""
    opt = autopar.optim.AdamW(pm, lr=1e-5) if offloads else torch.optim.AdamW(pm.parameters(), lr=1e-5)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(2 + steps):
        sync()
        start = time.perf_counter()
        pm(*batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if step >= 2:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def run(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cluster = "cpu" if args.tiny else args.cluster
    model, batch = _job(args.tiny, device)
    free = autopar.plan(model, (1,), example_inputs=batch, cluster=cluster, memory_budget=float("inf"), checkpointing=False)
    rows = []
    for name, options in _cases(args.tiny, free.predicted.peak_memory_bytes).items():
        start = time.perf_counter()
        plan = autopar.plan(model, (1,), example_inputs=batch, cluster=cluster, **options)
        memory = plan.memory
        offloads = memory is not None and bool(memory.offload or memory.offload_activations)
        target = f"disk:{args.offload_dir}" if offloads and device.type == "cpu" else options.get("offload", "off")
        # a copy per case: a compiled model whose pm trained past it cannot be compiled again
        pm = autopar.compile(copy.deepcopy(model), (1,), example_inputs=batch, plan=plan, offload=target)
        step_s, peak = _measure(pm, batch, offloads, device, args.steps)
        policies = Counter(s.policy for s in memory.checkpoint) if memory is not None else Counter()
        row = dict(
            case=name,
            budget_gib=options["memory_budget"] / GIB,
            policies=dict(policies),
            offloaded=len(memory.offload) + len(memory.offload_activations) if memory is not None else 0,
            predicted_step_ms=plan.predicted.step_time_s * 1e3,
            measured_step_ms=step_s * 1e3,
            predicted_peak_gib=plan.predicted.peak_memory_bytes / GIB,
            measured_peak_gib=peak / GIB,
            seconds=time.perf_counter() - start,
        )
        rows.append(row)
        print(
            f"{name:>16}  {str(row['policies']):<34} step {row['measured_step_ms']:8.1f} ms "
            f"(predicted {row['predicted_step_ms']:8.1f})  peak {row['measured_peak_gib']:6.2f} GiB "
            f"(predicted {row['predicted_peak_gib']:6.2f})",
            flush=True,
        )
        del pm, plan
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a small LLaMA on the CPU (checks that the script runs)")
    parser.add_argument("--cluster", default="h100-80g", help="the preset or spec file plans are priced on")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--offload-dir", default="/tmp/autopar-bench-offload", help="the disk store on a CPU")
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        print("bench_selective_ac: no CUDA device; run with --tiny on a CPU", file=sys.stderr)
        return 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29541")
    backend = "gloo" if args.tiny else "nccl"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    try:
        rows = run(args)
    finally:
        dist.destroy_process_group()
    name = "cpu" if args.tiny else torch.cuda.get_device_name().replace(" ", "_")
    out = Path(args.out) / f"selective_ac_{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "cluster": "cpu" if args.tiny else args.cluster, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
