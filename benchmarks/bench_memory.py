"""Step time against memory budget: what the planner adds (checkpointing, offload) as the budget
shrinks from ample to infeasible, planned and measured, with and without prefetch.

    python benchmarks/bench_memory.py                      # the sweep, results/memory.{csv,png}
    python benchmarks/bench_memory.py --fractions 1.2,0.5 --steps 2
    python benchmarks/bench_memory.py --fractions 0.3 --batch 1 --steps 9 --out benchmarks/results/memory_prefetch

A GPT (``autopar.zoo.models``, 4 layers, 384 wide, vocabulary 4,096, 8 sequences of 64 tokens, fp32,
~8.7M parameters) on mesh (1,) in this process (a world-size-1 gloo group), trained with
``autopar.optim.AdamW``. Budgets are fractions of the plan's peak without a budget. Planned on the
``cpu`` preset with its ``disk_link`` measured on the offload directory first
(``autopar.runtime.store.measure_disk_link``): the compute device is the host here, so the planner
offloads to disk. Every plan that offloads runs twice: as planned (prefetch one use ahead) and
with the same decisions but no prefetch, each with its own offload directory. Each run: two
warm-up steps, then the median of ``--steps`` timed steps (forward, backward, optimizer step);
the two variants take their timed steps in turn, so that both see the same load on a shared
machine. ``rss_growth_bytes`` is the peak resident memory of compile and the warm-up steps over
the resident memory before compile (the user's model, the process, and for the second variant
the first one), as ``tests/solver/memory_budget_run.py`` measures it.
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime
import gc
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "solver"))

from memory_budget_run import reset_peak_rss, rss_bytes  # noqa: E402

import autopar  # noqa: E402
from autopar.cost.cluster import get_cluster  # noqa: E402
from autopar.runtime.store import measure_disk_link  # noqa: E402
from autopar.zoo.models import GPT  # noqa: E402

CONFIG = dict(vocab_size=4096, block_size=64, n_layer=4, n_head=6, n_embd=384, bias=False)
BATCH, SEQ = 8, 64
FRACTIONS = (1.2, 0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1, 0.03)
WARMUP = 2  # the first steps create the offload files and AdamW's state
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _model_and_batch(batch_size: int = BATCH):
    torch.manual_seed(0)
    model = GPT(**CONFIG)
    gen = torch.Generator().manual_seed(1)
    batch = (
        torch.randint(0, CONFIG["vocab_size"], (batch_size, SEQ), generator=gen),
        torch.randint(0, CONFIG["vocab_size"], (batch_size, SEQ), generator=gen),
    )
    return model, batch


def _label(plan) -> str:
    memory = plan.memory
    if memory is None:
        return "sharding only"
    parts = []
    if memory.checkpoint:
        parts.append(f"checkpoint {len(memory.checkpoint)}")
    for kind, short in (("optimizer_state", "state"), ("grad", "grad"), ("param", "param")):
        count = len(memory.offloaded(kind))
        if count:
            parts.append(f"{short} {count}")
    return " + ".join(parts)


def _compile(model, batch, plan, offload: str):
    """Compile ``plan`` and run its warm-up steps; the peak RSS growth over the RSS before."""
    gc.collect()
    before = rss_bytes()
    reset_peak_rss()
    pm = autopar.compile(model, (1,), example_inputs=batch, plan=plan, offload=offload)
    opt = autopar.optim.AdamW(pm, lr=1e-3)
    for _ in range(WARMUP):
        _step(pm, opt, batch)
    return pm, opt, rss_bytes("VmHWM") - before


def _step(pm, opt, batch) -> float:
    start = time.perf_counter()
    loss = pm(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _close(pm) -> None:
    if pm.offloader is not None:
        pm.offloader.store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per step (fewer: offload weighs more)")
    parser.add_argument("--offload-dir", default=None, help="where disk offload files go (a temporary directory)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "memory"))
    args = parser.parse_args()
    torch.set_num_threads(1)  # two threads on a shared two-core machine spin-wait: 10x slower steps
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    directory = args.offload_dir or tempfile.mkdtemp(prefix="bench-memory-")
    link = measure_disk_link(directory)
    cluster = dataclasses.replace(get_cluster("cpu"), disk_link=link)
    print(f"disk link under {directory}: {link.bandwidth_bytes_per_s / 1e9:.2f} GB/s, {link.latency_s * 1e6:.0f} us")
    model, batch = _model_and_batch(args.batch)
    free = autopar.plan(model, (1,), example_inputs=batch, cluster=cluster)
    free_peak = free.predicted.peak_memory_bytes
    num_params = sum(p.numel() for p in model.parameters())
    print(f"{num_params / 1e6:.1f}M parameters; peak without a budget {free_peak / 2**20:.1f} MiB")
    rows = []
    for index, fraction in enumerate(float(f) for f in args.fractions.split(",")):
        budget = fraction * free_peak
        base = {"fraction": fraction, "budget_bytes": int(budget)}
        try:
            plan = autopar.plan(model, (1,), example_inputs=batch, cluster=cluster, memory_budget=budget, offload="auto")
        except autopar.InfeasibleError as error:
            minimum = re.search(r"leanest plan needs (\d+) bytes", str(error))
            rows.append({**base, "decisions": "infeasible", "min_bytes": int(minimum.group(1)) if minimum else ""})
            print(f"{fraction:5.2f}  infeasible: {str(error).splitlines()[1].strip()}")
            continue
        # Variants run their timed steps in turn, so that both see the same load on a shared machine.
        variants = [False, True] if plan.memory is not None and plan.memory.offload else [True]
        runs = []
        for prefetch in variants:
            run_plan = plan if prefetch else dataclasses.replace(plan, memory=dataclasses.replace(plan.memory, prefetch=False))
            offload = f"disk:{os.path.join(directory, f'{index}-{prefetch}')}"
            pm, opt, growth = _compile(copy.deepcopy(model), batch, run_plan, offload)  # a pm trains each copy
            runs.append((prefetch, pm, opt, growth, []))
        for _ in range(args.steps):
            for _prefetch, pm, opt, _growth, times in runs:
                times.append(_step(pm, opt, batch))
        for prefetch, pm, _opt, growth, times in runs:
            _close(pm)
            row = {
                **base,
                "decisions": _label(plan),
                "prefetch": prefetch,
                "predicted_peak_bytes": plan.predicted.peak_memory_bytes,
                "predicted_step_s": plan.predicted.step_time_s,
                "step_s": statistics.median(times),
                "rss_growth_bytes": growth,
                "saved_bytes": int(plan.memory.saved_bytes) if plan.memory else 0,
                "added_s": plan.memory.added_s if plan.memory else 0.0,
            }
            rows.append(row)
            print(
                f"{fraction:5.2f}  {_label(plan):<40} prefetch={prefetch!s:<5} step {row['step_s']:.3f} s "
                f"(predicted {row['predicted_step_s']:.3f} s)  peak {row['predicted_peak_bytes'] / 2**20:.0f} MiB "
                f"predicted, RSS +{growth / 2**20:.0f} MiB",
                flush=True,
            )
        del runs
    dist.destroy_process_group()
    if args.offload_dir is None:
        shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    fields = [
        "fraction",
        "budget_bytes",
        "decisions",
        "prefetch",
        "predicted_peak_bytes",
        "predicted_step_s",
        "step_s",
        "rss_growth_bytes",
        "saved_bytes",
        "added_s",
        "min_bytes",
    ]
    with open(args.out + ".csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, free_peak, link, args.out + ".png")
    print(f"wrote {args.out}.csv and {args.out}.png")


def _plot(rows, free_peak, link, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    ran = [r for r in rows if r["decisions"] != "infeasible"]
    for prefetch, style, color, label in (
        (True, "-o", "tab:blue", "as planned (offload prefetches one use ahead)"),
        (False, "--s", "tab:red", "same decisions, offload without prefetch"),
    ):
        points = sorted((r["budget_bytes"] / 2**20, r["step_s"]) for r in ran if r["prefetch"] == prefetch)
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, color=color, label=label)
    for r in ran:
        if r["prefetch"]:
            offloads = any(word in r["decisions"] for word in ("state", "grad", "param"))
            kind = "tab:green" if r["decisions"] == "sharding only" else ("tab:purple" if offloads else "tab:orange")
            ax.scatter([r["budget_bytes"] / 2**20], [r["step_s"]], s=90, facecolors="none", edgecolors=kind, zorder=3)
            ax.annotate(
                r["decisions"].replace(" + ", "\n+ "),
                (r["budget_bytes"] / 2**20, r["step_s"]),
                textcoords="offset points",
                xytext=(6, 4),
                fontsize=6.5,
            )
    for r in rows:
        if r["decisions"] == "infeasible":
            ax.axvline(r["budget_bytes"] / 2**20, color="gray", linestyle=":", linewidth=1)
            ax.annotate(
                "infeasible",
                (r["budget_bytes"] / 2**20, 0),
                textcoords="offset points",
                xytext=(3, 5),
                fontsize=7,
                color="gray",
                rotation=90,
            )
    ax.axvline(free_peak / 2**20, color="tab:green", linestyle=":", linewidth=1)
    ax.set_xlabel("memory_budget (MiB per device)")
    ax.set_ylabel("measured step time (s)")
    ax.set_title(
        f"GPT 8.7M on mesh (1,), CPU, offload to disk ({link.bandwidth_bytes_per_s / 1e9:.2f} GB/s measured)\n"
        "green: sharding only, orange: checkpointing, purple: offload (+ checkpointing)",
        fontsize=9,
    )
    ax.set_ylim(0, 1.3 * max((r["step_s"] for r in ran), default=1.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
