"""One training step on one GPU: eager, ``torch.compile``, ``autopar.compile`` and autopar with
inductor, time and peak memory, against the targets of issue #43.

    python benchmarks/bench_gpu_step.py                      # one GPU, at most about 8 minutes
    python benchmarks/bench_gpu_step.py --device cpu --tiny  # a dry run of the script's logic here

Models (bf16 weights and AdamW state, torch's default AdamW: ``foreach`` on CUDA):

- ``hf-llama``: Hugging Face ``LlamaForCausalLM`` from a config at LLaMA-3-8B widths (hidden 4096,
  MLP 14336, 32 heads, 8 KV heads, vocabulary 128256), 4 layers, ``attn_implementation="sdpa"``,
  batch 2 x 4096, ``labels=input_ids`` (a copy of them: export would merge one tensor passed twice);
- ``gpt``: ``autopar.zoo``'s GPT, 12 layers x 768, vocabulary 50304, batch 8 x 1024.

Trainers, built one at a time from the same seed so that only one is resident: ``eager``,
``torch_compile`` (``torch.compile(model)``), ``autopar`` (``autopar.compile(model, mesh=(1,))``,
op by op) and ``autopar_inductor`` (the same with ``compiler="inductor"``). Each takes 3 warm-up
steps (``zero_grad``, forward, backward, ``AdamW.step``), then ``--steps`` (8) timed steps with CUDA
events; its time is their median. Its peak is ``torch.cuda.max_memory_allocated`` over one more
step, the counter reset before it, less what was allocated before the trainer was built (on a CPU:
the host allocator's peak from the profiler's memory events). For autopar's graph the number of
``scaled_dot_product_attention`` calls that carry a mask is printed (eager HF passes none).

Writes ``results/gpu_step_<model>.csv`` after each model and prints each ratio beside its target:
HF LLaMA: autopar <= 1.00x eager, its peak <= eager's + 5%, autopar_inductor <= 0.95x torch.compile;
GPT: autopar <= 1.05x eager, autopar_inductor <= 1.00x torch.compile. ``--minutes`` (8) bounds the
run: a trainer that would start after it is skipped and reported.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from bench_gpu import one_rank

import autopar

TRAINERS = ("eager", "torch_compile", "autopar", "autopar_inductor")


@dataclass(frozen=True)
class Case:
    """A model, its batch on a device (a dict goes in by keyword) and its targets."""

    name: str
    build: Callable[[], torch.nn.Module]
    batch: Callable[[torch.device], tuple | dict]
    targets: tuple[tuple[str, str, float], ...]  # (ratio, against, at most)


def _hf_llama(tiny: bool) -> Case:
    import transformers

    widths = (
        dict(hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
        if tiny
        else dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    )
    rows, seq = (2, 64) if tiny else (2, 4096)
    config = transformers.LlamaConfig(
        **widths, num_hidden_layers=2 if tiny else 4, max_position_embeddings=seq, attn_implementation="sdpa", use_cache=False
    )

    def batch(device):
        ids = torch.randint(0, widths["vocab_size"], (rows, seq), device=device, generator=_generator(device))
        return dict(input_ids=ids, labels=ids.clone())

    return Case(
        "hf-llama",
        lambda: transformers.LlamaForCausalLM(config),
        batch,
        (("autopar", "eager", 1.00), ("autopar_peak", "eager_peak", 1.05), ("autopar_inductor", "torch_compile", 0.95)),
    )


def _gpt(tiny: bool) -> Case:
    from autopar.zoo.models import GPT

    config = (
        dict(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64, bias=False)
        if tiny
        else dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False)
    )
    rows = 4 if tiny else 8

    def batch(device):
        generator = _generator(device)
        shape = (rows, config["block_size"])
        return tuple(torch.randint(0, config["vocab_size"], shape, device=device, generator=generator) for _ in range(2))

    return Case("gpt", lambda: GPT(**config), batch, (("autopar", "eager", 1.05), ("autopar_inductor", "torch_compile", 1.00)))


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(1)


def _call(module, batch):
    if isinstance(batch, dict):
        return module(**batch).loss
    return module(*batch)


def _trainer(kind: str, model: torch.nn.Module, batch) -> torch.nn.Module:
    if kind == "eager":
        return model
    if kind == "torch_compile":
        return torch.compile(model)
    args, kwargs = ((), batch) if isinstance(batch, dict) else (batch, None)
    compiler = "inductor" if kind == "autopar_inductor" else None
    return autopar.compile(model, mesh=(1,), example_inputs=args, example_kwargs=kwargs, compiler=compiler)


def masked_sdpa_calls(module) -> tuple[int, int]:
    """(attention calls that carry a mask, all attention calls) in autopar's graph: the
    ``scaled_dot_product`` ops, their ``attn_mask`` or ``attn_bias`` argument read by name."""
    graph = getattr(module, "graph_module", None)
    if graph is None:
        return 0, 0
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    masked = 0
    for node in calls:
        schema = getattr(node.target, "_schema", None)
        names = [argument.name for argument in schema.arguments] if schema is not None else []
        given = {**dict(zip(names, node.args)), **node.kwargs}
        masked += any(given.get(name) is not None for name in ("attn_mask", "attn_bias"))
    return masked, len(calls)


class Meter:
    """Step times and peak memory on ``device``: CUDA events and the caching allocator's counters,
    or on a CPU the wall clock and the host allocator's peak from the profiler."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def allocated(self) -> int:
        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    def seconds(self, step) -> float:
        if not self.cuda:
            begin = time.perf_counter()
            step()
            return time.perf_counter() - begin
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3

    def peak(self, step) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
        held = top = 0
        for event in events:
            held += event.nbytes()
            top = max(top, held)
        return top


def measure(kind: str, case: Case, device: torch.device, meter: Meter, args) -> dict:
    """One trainer of ``case``: built, warmed up, timed, its peak taken, then freed."""
    before = meter.allocated()
    torch.manual_seed(0)
    with torch.device(device):
        model = case.build().to(torch.bfloat16).train()
    batch = case.batch(device)
    begin = time.perf_counter()
    module = _trainer(kind, model, batch)
    del model
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    losses = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = _call(module, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    for _ in range(args.warmup):
        step()
    first_s = time.perf_counter() - begin
    times = [meter.seconds(step) for _ in range(args.steps)]
    peak = meter.peak(step) - (before if meter.cuda else 0)
    if args.profile:
        write_profile(Path(args.profile) / f"profile_{case.name}.txt", f"{case.name} {kind}", step, meter.cuda)
    masked, calls = masked_sdpa_calls(module)
    row = dict(
        model=case.name,
        trainer=kind,
        step_ms=round(1e3 * statistics.median(times), 3),
        peak_gib=round(peak / 2**30, 3),
        peak_bytes=peak,
        first_steps_s=round(first_s, 1),
        first_loss=round(losses[0].float().item(), 4),
        sdpa_masked=f"{masked}/{calls}" if calls else "",
    )
    print(
        f"  {case.name:<9} {kind:<17} {row['step_ms']:9.2f} ms  peak {row['peak_gib']:7.3f} GiB  "
        f"warm-up {row['first_steps_s']:6.1f} s  loss {row['first_loss']:.4f}  masked sdpa {row['sdpa_masked']}",
        flush=True,
    )
    return row  # the trainer is freed with this frame, before the next one is built


def write_profile(path: Path, title: str, step, cuda: bool) -> None:
    """Append the ops of one profiled ``step`` to ``path``: the top by device time and by host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(f"\n=== {title}\n")
        if cuda:
            handle.write(table.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
        handle.write(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def verdicts(case: Case, rows: list[dict]) -> list[dict]:
    """Each target of ``case``: the measured ratio, the bound and whether it holds."""
    values = {row["trainer"]: row["step_ms"] for row in rows}
    values.update({f"{row['trainer']}_peak": row["peak_bytes"] for row in rows})
    out = []
    for ours, theirs, bound in case.targets:
        if ours in values and theirs in values and values[theirs]:
            ratio = values[ours] / values[theirs]
            out.append(dict(model=case.name, ratio=f"{ours} / {theirs}", value=round(ratio, 3), target=bound, met=ratio <= bound))
    return out


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="tiny models (a dry run of the logic)")
    parser.add_argument("--models", nargs="*", default=["gpt", "hf-llama"], choices=["gpt", "hf-llama"])
    parser.add_argument("--trainers", nargs="*", default=list(TRAINERS), choices=list(TRAINERS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=8.0, help="no trainer starts after this")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--profile", metavar="DIR", help="write each trainer's profiled step to DIR/profile_<model>.txt")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_step.py needs a CUDA device (or --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(0)
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    meter, start, failed = Meter(device), time.perf_counter(), False
    builders = {"gpt": _gpt, "hf-llama": _hf_llama}
    with one_rank(device, os.environ.get("MASTER_PORT", "29543")):
        for name in args.models:
            case, rows = builders[name](args.tiny), []
            for kind in args.trainers:
                if time.perf_counter() - start > 60 * args.minutes:
                    print(f"  {name} {kind}: skipped, past --minutes {args.minutes}", flush=True)
                    failed = True
                    continue
                try:
                    rows.append(measure(kind, case, device, meter, args))
                except Exception:  # one device run is all there may be: report and go on
                    traceback.print_exc()
                    failed = True
            if not rows:
                continue
            checks = verdicts(case, rows)
            for check in checks:
                print(
                    f"  {name}: {check['ratio']} = {check['value']:.3f} (target <= {check['target']:.2f}) "
                    f"{'met' if check['met'] else 'NOT met'}",
                    flush=True,
                )
            suffix = "_tiny" if args.tiny else ""
            write_csv(Path(args.out) / f"gpu_step_{name}{suffix}.csv", rows + [{**c, "trainer": "target"} for c in checks])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
