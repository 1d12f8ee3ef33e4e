"""The budget run of tests/solver/test_memory.py, in a fresh process so that its resident memory is its own.

``python tests/solver/memory_budget_run.py OUT.json [--steps N] [--budget-fraction F] [--offload auto]``

Builds a GPT-style model of about 84M parameters (the user's model), reads the process's
resident memory (the baseline: the interpreter, torch, the model and its batch), then resets the
kernel's peak-RSS mark and compiles the model on mesh (1,) under a ``memory_budget`` of
``F`` times its parameter + gradient + AdamW-state bytes and trains ``N`` steps with
``autopar.optim.AdamW``. The peak resident memory of that phase, less the baseline, is the growth
the test bounds. Only then does it train an eager copy (built again from the same seed) with
``torch.optim.AdamW`` and compare losses and updated weights. Writes the numbers as JSON.

The model is float64 (``--dtype``): a plan that outlines layers (checkpointing, offloaded
activations) sums some gradients in another order, and in float32 AdamW's first step turns
those rounding-level differences into steps of ±lr in different directions (see
tests/runtime/test_module.py); in float64 the comparison measures the offload, not the rounding.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time

import torch
import torch.distributed as dist

import autopar
from autopar.zoo.models import GPT

CONFIG = dict(vocab_size=8192, block_size=64, n_layer=11, n_head=12, n_embd=768, bias=False)
BATCH, SEQ = 1, 16
LR = 1e-3


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """Make VmHWM (the peak RSS) start again from the current RSS (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen),
            torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=gen),
        )
        for _ in range(steps)
    ]


def build(dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    return GPT(**CONFIG).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--budget-fraction", type=float, default=1 / 3)
    parser.add_argument("--offload", default="auto")
    parser.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)  # two threads on a shared two-core machine spin-wait: 10x slower steps
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    model = build(dtype)
    data = batches(args.steps)
    num_params = sum(p.numel() for p in model.parameters())
    state_bytes = 4 * num_params * dtype.itemsize  # parameter + gradient + AdamW's two states
    budget = args.budget_fraction * state_bytes
    gc.collect()
    baseline = rss_bytes()
    reset_peak_rss()
    start = time.perf_counter()
    pm = autopar.compile(model, (1,), example_inputs=data[0], cluster="cpu", memory_budget=budget, offload=args.offload)
    compile_s = time.perf_counter() - start
    opt = autopar.optim.AdamW(pm, lr=LR)
    losses, step_s = [], []
    for idx, targets in data:
        start = time.perf_counter()
        loss = pm(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_s.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = rss_bytes("VmHWM")
    after = pm.full_state_dict()
    memory = pm.plan.memory
    result = {
        "num_params": num_params,
        "state_bytes": state_bytes,
        "budget_bytes": budget,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "growth_bytes": peak - baseline,
        "predicted_peak_bytes": pm.plan.predicted.peak_memory_bytes,
        "compile_s": compile_s,
        "step_s": step_s,
        "losses": losses,
        "dtype": args.dtype,
        "decisions": None
        if memory is None
        else {
            "target": memory.target,
            "checkpoint": len(memory.checkpoint),
            "offload_activations": len(memory.offload_activations),
            "offload": {kind: len(memory.offloaded(kind)) for kind in ("param", "grad", "optimizer_state")},
        },
    }
    del pm, opt
    gc.collect()
    eager = build(dtype)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=LR)
    eager_losses = []
    for idx, targets in data:
        loss = eager(idx, targets)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        eager_losses.append(loss.item())
    want = eager.state_dict()
    result["eager_losses"] = eager_losses
    result["max_weight_diff"] = max((after[k] - want[k]).abs().max().item() for k in want)
    dist.destroy_process_group()
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
