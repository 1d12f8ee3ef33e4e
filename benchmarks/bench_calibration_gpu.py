"""Fill the calibration table's measured column on one GPU (issue 44), in one go, within 8 minutes.

    python benchmarks/bench_calibration_gpu.py [--quick] [--out DIR]      # needs CUDA
    python benchmarks/bench_calibration_gpu.py --device cpu --tiny         # a dry run of the same code

Four parts, each writing to ``--out`` (default ``benchmarks/results``):

1. ``autopar profile`` of this device (``runtime.tools.profile.run_profile``: peaks, achieved rates,
   host link) into ``calibration_profiled.json``.
2. ``bench_calibration.py`` on the single-GPU rows, priced on that profiled spec
   (``calibration_profiled.csv``; the preset's pricing is ``calibration.csv``).
3. The same jobs measured here (``calibration_measured.csv``): eager training steps in bf16
   (forward, backward, foreach AdamW; median of timed steps after warm-up, CUDA events) and
   ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``), next to the step and peaks
   each spec predicts.
4. Offload (``calibration_offload.csv``): the zoo GPT under a memory budget that needs offload
   (``offload="auto"``: pinned host memory on a GPU), compiled and stepped with
   ``autopar.optim.AdamW``, against the same model without a budget stepped with torch's AdamW:
   the plan's predicted step against the measured one (and ``memory.added_s`` against the extra),
   on the preset and on the profiled spec, with each run's forward + backward and optimizer
   seconds, and the runs that split the extra (the free plan under ``autopar.optim.AdamW``, the
   budget plan with only its checkpoints and with only its offload).
"""

from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_calibration as calibration  # noqa: E402

import autopar  # noqa: E402
from autopar.cost.cluster import ClusterSpec, get_cluster  # noqa: E402
from autopar.runtime.tools.profile import run_profile  # noqa: E402

GIB = 2**30
SINGLE_GPU_ROWS = ("hf-llama-3-8b 4L 2x4096 eager", "gpt 12x768 8x1024 eager", "zoo llama-3-8b 2L 2x2048 eager")
BUDGET_FRACTIONS = (0.6, 0.75, 0.9)  # of the unbounded plan's predicted peak
TINY = calibration.Row("gpt 2x64 (tiny)", "dry run", "gpt:2:64:4", 2, 64, (1,), "plan", "h200-141g", 141 * GIB)


def _write(path: Path, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}", flush=True)


class Clock:
    """Step timing on the device: CUDA events on a GPU, ``perf_counter`` on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def median(self, fn, warmup: int, repeat: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
        return statistics.median(times)

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / GIB if self.device.type == "cuda" else None

    def reserved_gib(self) -> float | None:
        """The caching allocator's peak (issue 44: ``predicted.allocator_peak_bytes["reserved"]``)."""
        return torch.cuda.max_memory_reserved() / GIB if self.device.type == "cuda" else None


def measure_row(row: calibration.Row, device: torch.device, clock: Clock, steps: int) -> dict:
    """One eager training step of ``row``'s model on ``device``: seconds and peak GiB."""
    torch.manual_seed(0)
    model = calibration.build_model(row.model, getattr(torch, row.dtype), device)
    vocab = model.get_output_embeddings().weight.shape[0] if hasattr(model, "get_output_embeddings") else 50304
    ids = torch.randint(0, min(vocab, 50304), (row.batch, row.seq), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

    def step():
        out = model(input_ids=ids, labels=ids) if row.model.startswith("hf-") else model(ids, ids)
        loss = out.loss if hasattr(out, "loss") else out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    seconds = clock.median(step, warmup=3, repeat=steps)
    peak, reserved = clock.peak_gib(), clock.reserved_gib()
    # the AdamW step alone, on one backward's gradients (what the plan's optimizer_s prices)
    out = model(input_ids=ids, labels=ids) if row.model.startswith("hf-") else model(ids, ids)
    (out.loss if hasattr(out, "loss") else out).backward()
    optimizer_s = clock.median(opt.step, warmup=1, repeat=steps)
    return {
        "row": row.name,
        "measured_step_s": seconds,
        "measured_peak_gib": peak,
        "measured_reserved_gib": reserved,
        "measured_optimizer_s": optimizer_s,
    }


class PhaseClock(Clock):
    """Median seconds of a training step and of its two phases, forward + backward and the
    optimizer step (CUDA events on a GPU, ``perf_counter`` on CPU)."""

    def phases(self, forward_backward, optimizer_step, warmup: int, repeat: int) -> dict[str, float]:
        for _ in range(warmup):
            forward_backward()
            optimizer_step()
        spans: dict[str, list[float]] = {"step_s": [], "forward_backward_s": [], "optimizer_s": []}
        for _ in range(repeat):
            marks = [self._mark()]
            forward_backward()
            marks.append(self._mark())
            optimizer_step()
            marks.append(self._mark())
            first, middle, last = self._seconds(marks)
            spans["forward_backward_s"].append(middle - first)
            spans["optimizer_s"].append(last - middle)
            spans["step_s"].append(last - first)
        return {key: statistics.median(values) for key, values in spans.items()}

    def _mark(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, marks) -> list[float]:
        if self.device.type != "cuda":
            return marks
        torch.cuda.synchronize()
        return [marks[0].elapsed_time(mark) / 1e3 for mark in marks]


def _variants(free, tight) -> dict[str, tuple]:
    """The runs that split the offload plan's extra seconds into their parts: (plan, optimizer kind).
    ``free`` steps torch's AdamW (foreach on CUDA: what the plan prices); ``free_forloop`` the same
    plan with ``autopar.optim.AdamW`` (the per-parameter step an offload plan needs); ``checkpoint``
    the offload plan without its offload, ``offload`` without its checkpoints."""
    memory = tight.memory
    return {
        "free": (free, "torch"),
        "free_forloop": (free, "autopar"),
        "checkpoint": (
            dataclasses.replace(tight, memory=dataclasses.replace(memory, offload=(), offload_activations=())),
            "torch",
        ),
        "offload": (dataclasses.replace(tight, memory=dataclasses.replace(memory, checkpoint=())), "autopar"),
        "tight": (tight, "autopar"),
    }


def offload_run(device: torch.device, clock: PhaseClock, tiny: bool, specs: dict[str, ClusterSpec], steps: int) -> list[dict]:
    """The zoo GPT with and without a budget that needs offload: the plan's predicted step
    against the measured one, and the measured parts of the extra seconds (``_variants``)."""
    row = TINY if tiny else calibration.Row("gpt 12x768", "", "gpt:12:768:12", 8, 1024, (1,), "plan", "h200-141g", 141 * GIB)
    torch.manual_seed(0)
    model = calibration.build_model(row.model, torch.bfloat16, device)
    ids = torch.randint(0, 50304 if not tiny else 256, (row.batch, row.seq), device=device)
    # Planned without a precision policy, as the first H200 run was. That run's plan priced fp32
    # AdamW moments; plans now price them in the parameters' bf16, as torch's and autopar's AdamW
    # keep them, so the budget search below goes lower before a plan needs offload.
    precision = None
    out = []
    measured_once: dict[str, dict[str, float]] = {}
    for label, spec in specs.items():
        free = autopar.plan(model, (1,), example_inputs=(ids, ids), cluster=spec, precision=precision)
        tight = budget = None
        for fraction in BUDGET_FRACTIONS:  # the tightest budget that a plan with offload meets
            budget = fraction * free.predicted.peak_memory_bytes
            try:
                tight = autopar.plan(
                    model,
                    (1,),
                    example_inputs=(ids, ids),
                    cluster=spec,
                    memory_budget=budget,
                    offload="auto",
                    precision=precision,
                )
                break
            except autopar.InfeasibleError:
                continue
        if tight is None or tight.memory is None or not tight.memory.offload:
            out.append({"spec": label, "budget_gib": budget / GIB, "decisions": "no feasible budget needs offload"})
            continue
        # The variants' runs do not depend on the spec when its plans are the same: measured once.
        key = (free.hash, tight.hash)
        if key not in measured_once:
            measured_once[key] = {}
            for name, (plan, kind) in _variants(free, tight).items():
                for part, seconds in _measure_plan(model, ids, plan, kind, clock, steps).items():
                    measured_once[key][f"{name}_{part}"] = seconds
        measured = measured_once[key]
        memory = tight.memory
        out.append(
            {
                "spec": label,
                "budget_gib": budget / GIB,
                "decisions": f"{len(memory.offload)} offloaded to {memory.target}, {len(memory.checkpoint)} checkpointed",
                "predicted_free_step_s": free.predicted.step_time_s,
                "measured_free_step_s": measured["free_step_s"],
                "predicted_offload_step_s": tight.predicted.step_time_s,
                "measured_offload_step_s": measured["tight_step_s"],
                "step_ratio": tight.predicted.step_time_s / measured["tight_step_s"],
                "predicted_added_s": memory.added_s,
                "measured_added_s": measured["tight_step_s"] - measured["free_step_s"],
                "predicted_recompute_s": sum(segment.cost_s for segment in memory.checkpoint),
                "predicted_optimizer_s": free.predicted.optimizer_s,
                **measured,
            }
        )
    return out


def _measure_plan(model, ids, plan, kind: str, clock: PhaseClock, steps: int) -> dict[str, float]:
    """Compile ``plan`` and time its steps with torch's AdamW ("torch") or autopar's ("autopar")."""
    # a copy per plan: a compiled model whose pm trained past it cannot be compiled again
    pm = autopar.compile(copy.deepcopy(model), (1,), example_inputs=(ids, ids), plan=plan)
    opt = autopar.optim.AdamW(pm, lr=1e-5) if kind == "autopar" else torch.optim.AdamW(pm.parameters(), lr=1e-5)

    def forward_backward():
        pm(ids, ids).backward()

    def optimizer_step():
        opt.step()
        opt.zero_grad()

    try:
        return clock.phases(forward_backward, optimizer_step, warmup=2, repeat=steps)
    finally:
        if pm.offloader is not None:
            pm.offloader.store.close()
        if ids.is_cuda:  # this run's module goes with the frame; its cached blocks go now
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT only: a dry run of the code on CPU")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_calibration_gpu needs CUDA (or --device cpu --tiny for a dry run)")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    steps = 3 if args.tiny else 10
    clock = PhaseClock(device)
    # 1. the profile (on CPU it writes a CPU spec: the dry run still exercises the rates' code)
    profiled = run_profile(str(out / "calibration_profiled.json"), None, False, quick=args.quick or args.tiny)
    if device.type != "cuda":
        from autopar.runtime.tools.profile import measure_device  # the CPU variant of the GPU's rates

        rates = measure_device("cpu", quick=True, rates=True)["rates"]
        profiled = dataclasses.replace(profiled, rates=rates)
    print(f"profile: {time.perf_counter() - start:.0f} s; rates {profiled.rates}", flush=True)
    # 2. and 3. the single-GPU rows priced on the preset and on the profile, and measured
    rows = [TINY] if args.tiny else [r for r in calibration.ROWS if r.name in SINGLE_GPU_ROWS]
    results = []
    for row in rows:
        predicted = {label: calibration.evaluate(row, spec) for label, spec in (("preset", None), ("profiled", profiled))}
        measured = measure_row(row, device, clock, steps)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the row's model is gone with measure_row's frame
        results.append(
            {
                **measured,
                **{f"{label}_step_s": p.get("predicted_step_s") for label, p in predicted.items()},
                **{f"{label}_optimizer_s": p.get("predicted_optimizer_s") for label, p in predicted.items()},
                **{f"{label}_peak_gib": p.get("predicted_peak_gib") for label, p in predicted.items()},
                **{f"{label}_reserved_gib": p.get("predicted_reserved_gib") for label, p in predicted.items()},
            }
        )
        print(results[-1], f"{time.perf_counter() - start:.0f} s", flush=True)
    _write(out / "calibration_measured.csv", results)
    # 4. offload on a live (single-rank) process group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    try:
        specs = {"preset": get_cluster("h200-141g"), "profiled": profiled}
        _write(out / "calibration_offload.csv", offload_run(device, clock, args.tiny, specs, steps))
    finally:
        dist.destroy_process_group()
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
