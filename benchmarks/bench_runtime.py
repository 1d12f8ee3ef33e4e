"""Measured step time and counted bytes: autopar's compiled module against hand plans, on gloo.

    python benchmarks/bench_runtime.py               # 2 and 4 ranks, and the 1-rank overhead
    python benchmarks/bench_runtime.py --ranks 2 --steps 5

A GPT (``autopar.zoo.models``, 4 layers, 256 wide, 16 sequences of 128 tokens, fp32) trained with
AdamW for ``--steps`` steps after two warm-up steps, on this machine's CPU with gloo (one thread
per rank, spawned by ``autopar.runtime.tools.launch.run_distributed``). Every plan is compiled with
``autopar.compile(..., plan=...)`` and run; ``zero1`` and ``zero2`` run their DDP layout with
``torch.distributed.optim.ZeroRedundancyOptimizer``. Bytes are the payloads of the functional
collectives that each rank runs in one step (forward, backward), counted by a dispatch mode:
the input bytes of each ``_c10d_functional`` op. The optimizer's own traffic (ZeRO's
broadcasts) is not in that count. The 1-rank row sets eager PyTorch against autopar on mesh
(1,): ``eager_over_autopar`` is eager's step time over autopar's (target >= 0.95).
Planned for the ``cpu`` cluster preset. Writes ``results/runtime.csv`` and ``results/runtime.png``.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CONFIG = dict(vocab_size=1024, block_size=128, n_layer=4, n_head=8, n_embd=256, tied=False)
BATCH = 16
KINDS = ("autopar", "ddp", "zero1", "zero2", "fsdp", "megatron", "megatron_sp", "tp_fsdp")


class CollectiveBytes(TorchDispatchMode):
    """Sums the input bytes of every functional collective dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait_tensor"):
            for arg in torch.utils._pytree.tree_leaves((args, kwargs or {})):
                if isinstance(arg, torch.Tensor):
                    self.bytes += arg.numel() * arg.element_size()
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _model_and_batch():
    from autopar.zoo.models import build_model, example_batch

    model = build_model("gpt", seed=0, **CONFIG)
    return model, example_batch("gpt", BATCH, seed=1, **CONFIG)


def _time_steps(module, batch, optimizer, steps: int) -> tuple[list[float], int]:
    for _ in range(2):  # warm-up
        optimizer.zero_grad()
        module(*batch).backward()
        optimizer.step()
    times = []
    counted = 0
    for step in range(steps):
        optimizer.zero_grad()
        start = time.perf_counter()
        if step == 0:
            with CollectiveBytes() as counter:
                module(*batch).backward()
            counted = counter.bytes
        else:
            module(*batch).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return times, counted


def _rank(rank: int, world: int, kind: str, steps: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer

    import autopar
    from autopar.solver.planners.hand_plans import ALIASES

    model, batch = _model_and_batch()
    mesh = (world,) if world < 4 else (2, world // 2)
    if kind == "autopar":
        plan = autopar.plan(model, mesh, example_inputs=batch, cluster="cpu")
    else:
        plan = autopar.hand_plan(ALIASES.get(kind, kind), model, mesh, example_inputs=batch, cluster="cpu")
    pm = autopar.compile(model, mesh, example_inputs=batch, plan=plan)
    if kind in ("zero1", "zero2"):
        optimizer = ZeroRedundancyOptimizer(pm.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times, counted = _time_steps(pm, batch, optimizer, steps)
    gathered = [None] * world
    dist.all_gather_object(gathered, (statistics.median(times), counted))
    return {
        "step_s": max(t for t, _ in gathered),  # the step ends when the slowest rank is done
        "bytes_per_rank": max(b for _, b in gathered),
        "predicted_step_s": plan.predicted.step_time_s,
        "predicted_comm_bytes": plan.predicted.comm_bytes,
    }


def _single(rank: int, world: int, steps: int) -> dict:
    import autopar

    model, batch = _model_and_batch()
    eager_times, _ = _time_steps(model, batch, torch.optim.AdamW(model.parameters(), lr=1e-4), steps)
    model, batch = _model_and_batch()
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu")
    auto_times, counted = _time_steps(pm, batch, torch.optim.AdamW(pm.parameters(), lr=1e-4), steps)
    return {"eager_s": statistics.median(eager_times), "autopar_s": statistics.median(auto_times), "bytes": counted}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["ranks"] for r in rows if r["plan"] != "eager"})
    fig, axes = plt.subplots(1, len(worlds), figsize=(5 * len(worlds), 3.5), squeeze=False)
    for ax, world in zip(axes[0], worlds):
        chosen = [r for r in rows if r["ranks"] == world and r["plan"] != "eager" and r["step_s"] != ""]
        ax.bar(
            range(len(chosen)),
            [r["step_s"] * 1e3 for r in chosen],
            color=["tab:orange" if r["plan"] == "autopar" else "tab:blue" for r in chosen],
        )
        ax.set_xticks(range(len(chosen)), [r["plan"] for r in chosen], rotation=30, fontsize=8)
        ax.set_ylabel("measured step ms (median)")
        ax.set_title(f"{world} gloo ranks on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    from autopar.runtime.tools.launch import run_distributed

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/runtime.csv")
    parser.add_argument("--ranks", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    args = parser.parse_args()
    rows = []
    single = run_distributed(_single, 1, args.steps, timeout_s=900)[0]
    rows.append({"ranks": 1, "plan": "eager", "step_s": single["eager_s"], "bytes_per_rank": 0})
    rows.append(
        {
            "ranks": 1,
            "plan": "autopar",
            "step_s": single["autopar_s"],
            "bytes_per_rank": single["bytes"],
            "eager_over_autopar": round(single["eager_s"] / single["autopar_s"], 3),
        }
    )
    print(rows[-2:], flush=True)
    for world in args.ranks:
        for kind in args.kinds:
            try:
                result = run_distributed(_rank, world, kind, args.steps, timeout_s=900)[0]
            except Exception as error:  # a plan that cannot run here is reported, not hidden
                rows.append({"ranks": world, "plan": kind, "step_s": "", "error": f"{type(error).__name__}: {error}"[:200]})
            else:
                rows.append({"ranks": world, "plan": kind, **result})
            print(rows[-1], flush=True)
    for world in args.ranks:
        auto = next((r for r in rows if r["ranks"] == world and r["plan"] == "autopar" and r["step_s"] != ""), None)
        for row in rows:
            if row["ranks"] == world and auto and row.get("step_s"):
                row["over_autopar"] = round(row["step_s"] / auto["step_s"], 3)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(args.out, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
