"""What a CPU cannot show: the cost model against one real GPU, and autopar on CUDA/NCCL.

    python benchmarks/bench_gpu.py [--quick] [--out DIR]

Three parts, each writing a CSV to ``--out`` (default ``benchmarks/results``):

* ``gpu_roofline.csv``: the device's measured dense matmul rate per dtype and its copy bandwidth,
  next to the ``h100-80g`` preset's figures (the preset is what offline plans are priced with).
* ``gpu_step.csv``: for GPT- and LLaMA-shaped models in bfloat16, the predicted time of one
  forward+backward (``autopar.plan(..., mesh=(1,))`` on the preset; with ``--profiled FILE``
  also on that ``autopar profile`` output, roofline and measured-op pricing) against the
  measured eager time on this GPU, and the predicted peak memory (parameters, gradients, AdamW state,
  activations) against ``torch.cuda.max_memory_allocated`` over a full AdamW step.
* ``gpu_compile.csv``: ``autopar.compile`` on CUDA under NCCL (world size 1): loss and gradients
  against eager in float32, then bfloat16 training steps.

Needs a CUDA device; exits with a message otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.zoo.models import GPT, LLAMA_SHAPES, Llama


def time_cuda(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def roofline(out: Path, quick: bool) -> None:
    preset = get_cluster("h100-80g")
    size = 4096 if quick else 8192
    rows = []
    for dtype, tf32 in ((torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.float32, True)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(size, size, device="cuda", dtype=dtype)
        b = torch.randn(size, size, device="cuda", dtype=dtype)
        seconds = time_cuda(lambda: a @ b)
        name = "tf32" if tf32 else str(dtype).removeprefix("torch.")
        measured = 2 * size**3 / seconds
        rows.append(
            dict(
                what=f"matmul {name} {size}^3",
                measured=measured,
                preset=preset.peak_flops.get(str(dtype).removeprefix("torch."), float("nan")),
                unit="FLOP/s",
            )
        )
    torch.backends.cuda.matmul.allow_tf32 = False
    numel = (1 << 28) if quick else (1 << 30)
    src = torch.empty(numel, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_cuda(lambda: dst.copy_(src))
    rows.append(
        dict(
            what=f"copy {numel >> 20} MiB (read + write)",
            measured=2 * numel / seconds,
            preset=preset.memory_bandwidth_bytes_per_s,
            unit="bytes/s",
        )
    )
    free, total = torch.cuda.mem_get_info()
    rows.append(dict(what="memory", measured=total, preset=preset.memory_bytes, unit="bytes"))
    write_csv(out / "gpu_roofline.csv", rows)
    for row in rows:
        print(
            f"  {row['what']:<32} measured {row['measured']:.3e} {row['unit']:<8} preset {row['preset']:.3e}"
            f"  measured/preset {row['measured'] / row['preset']:.2f}"
        )


def _models(quick: bool):
    """(name, builder, batch, seq): GPT-2 widths and LLaMA widths, few layers so they fit."""
    gpts = [
        ("gpt 12x768", dict(n_layer=12, n_head=12, n_embd=768)),
        ("gpt 24x1024", dict(n_layer=24, n_head=16, n_embd=1024)),
        ("gpt 8x2048", dict(n_layer=8, n_head=16, n_embd=2048)),
    ]
    llamas = [
        ("llama-3-8b widths, 4 layers", {**LLAMA_SHAPES["llama-3-8b"], "n_layer": 4}),
        ("llama-2-7b widths, 8 layers", {**LLAMA_SHAPES["llama-2-7b"], "n_layer": 8}),
    ]
    if quick:
        gpts, llamas = gpts[:1], llamas[:1]
    for name, cfg in gpts:
        yield name, lambda cfg=cfg: GPT(vocab_size=50304, block_size=1024, bias=False, **cfg), 8, 1024
    for name, cfg in llamas:
        yield name, lambda cfg=cfg: Llama(**cfg), 4, 2048


def step_accuracy(out: Path, quick: bool, pricings: list[tuple[str, str, str | None]]) -> None:
    """``pricings``: (label, cluster, compute) under which each model is planned and predicted."""
    rows = []
    for name, build, batch, seq in _models(quick):
        torch.manual_seed(0)
        with torch.device("meta"):
            meta_model = build().to(torch.bfloat16)
        vocab = meta_model.lm_head.weight.shape[0]
        idx_meta = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        plans = {}
        for label, cluster, compute in pricings:
            start = time.perf_counter()
            plans[label] = (
                autopar.plan(meta_model, mesh=(1,), example_inputs=(idx_meta, idx_meta), cluster=cluster, compute=compute),
                time.perf_counter() - start,
            )
        with torch.device("cuda"):
            model = build().to(torch.bfloat16)
        idx = torch.randint(0, vocab, (batch, seq), device="cuda")
        targets = torch.randint(0, vocab, (batch, seq), device="cuda")

        def fwd_bwd(model=model):  # bound now: the loop deletes `model` at its end
            model(idx, targets).backward()

        measured_s = time_cuda(fwd_bwd, warmup=2, repeat=5 if quick else 10)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        opt.step()  # allocates the optimizer state
        opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        for label, (plan, plan_s) in plans.items():
            predicted = plan.predicted
            rows.append(
                dict(
                    model=name,
                    pricing=label,
                    batch=batch,
                    seq=seq,
                    plan_s=round(plan_s, 2),
                    predicted_compute_s=predicted.compute_s,
                    measured_fwd_bwd_s=measured_s,
                    time_ratio=measured_s / predicted.compute_s,
                    predicted_peak_bytes=predicted.peak_memory_bytes,
                    measured_peak_bytes=peak,
                    memory_ratio=peak / predicted.peak_memory_bytes,
                )
            )
            print(
                f"  {name:<30} {label:<18} time measured/predicted {rows[-1]['time_ratio']:.2f} "
                f"({measured_s * 1e3:.1f} ms vs {predicted.compute_s * 1e3:.1f} ms); "
                f"peak measured/predicted {rows[-1]['memory_ratio']:.2f} "
                f"({peak / 2**30:.1f} GiB vs {predicted.peak_memory_bytes / 2**30:.1f} GiB); "
                f"planned in {plan_s:.1f} s",
                flush=True,
            )
        del model, opt
        torch.cuda.empty_cache()
    write_csv(out / "gpu_step.csv", rows)
    for label, _, _ in pricings:
        ratios = [r["time_ratio"] for r in rows if r["pricing"] == label]
        print(f"  {label}: time ratio geometric mean {math.exp(statistics.fmean(map(math.log, ratios))):.2f}")


@contextlib.contextmanager
def one_rank(device: torch.device, port: str):
    """A process group of one rank for ``device`` (NCCL on CUDA, gloo on a CPU), destroyed after."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    try:
        yield
    finally:
        dist.destroy_process_group()


def compile_on_cuda(out: Path) -> None:
    rows = []
    with one_rank(torch.device("cuda"), "29533"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = GPT(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128, bias=False)
        idx = torch.randint(0, 512, (8, 128), device="cuda")
        targets = torch.randint(0, 512, (8, 128), device="cuda")
        eager = GPT(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128, bias=False).cuda()
        eager.load_state_dict(model.state_dict())
        pm = autopar.compile(model, mesh=(1,), example_inputs=(idx, targets), cluster="h100-80g")
        loss = pm(idx, targets)
        loss.backward()
        ref = eager(idx, targets)
        ref.backward()
        grads = pm.full_grads()
        worst = max(
            (grads[n] - p.grad).abs().max().item() / max(p.grad.abs().max().item(), 1e-12) for n, p in eager.named_parameters()
        )
        rows.append(dict(check="float32 loss rel diff", value=abs(loss.item() - ref.item()) / abs(ref.item())))
        rows.append(dict(check="float32 worst grad rel diff (max-norm)", value=worst))
        pm16 = autopar.compile(eager.to(torch.bfloat16), mesh=(1,), example_inputs=(idx, targets), cluster="h100-80g")
        opt = torch.optim.AdamW(pm16.parameters(), lr=1e-3)
        losses = []
        for _ in range(5):
            opt.zero_grad()
            step_loss = pm16(idx, targets)
            step_loss.backward()
            opt.step()
            losses.append(step_loss.item())
        rows.append(dict(check="bfloat16 loss first step", value=losses[0]))
        rows.append(dict(check="bfloat16 loss after 5 AdamW steps", value=losses[-1]))
        rows.append(
            dict(
                check="collectives in the graph",
                value=sum(1 for n in pm16.graph.nodes if "autopar" in str(n.target) or "c10d" in str(n.target)),
            )
        )
    write_csv(out / "gpu_compile.csv", rows)
    for row in rows:
        print(f"  {row['check']:<40} {row['value']:.3g}")


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer models")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the CSVs")
    parser.add_argument("--parts", default="roofline,step,compile", help="comma-separated parts to run")
    parser.add_argument(
        "--profiled",
        default=None,
        help="also price with this ClusterSpec file (from `autopar profile`) and with measured compute",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device; none is visible here", file=sys.stderr)
        return 2
    out = Path(args.out)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    parts = set(args.parts.split(","))
    if "roofline" in parts:
        print("roofline:")
        roofline(out, args.quick)
    if "step" in parts:
        print("one step, predicted against measured (bfloat16, eager, mesh (1,)):")
        pricings = [("h100-80g preset", "h100-80g", None)]
        if args.profiled:
            pricings += [("profiled roofline", args.profiled, "roofline"), ("measured ops", args.profiled, "measured")]
        step_accuracy(out, args.quick, pricings)
    if "compile" in parts:
        print("autopar.compile on CUDA with NCCL:")
        compile_on_cuda(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
