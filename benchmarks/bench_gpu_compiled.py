"""autopar compiled with inductor on one GPU, against ``torch.compile(model)``, in one run.

    python benchmarks/bench_gpu_compiled.py [--quick] [--out DIR] [--trace]
    python benchmarks/bench_gpu_compiled.py --device cpu --tiny     # a dry run of the script here

One process, one device, the process group of one rank (NCCL on CUDA, gloo on CPU). For each
model, in bfloat16 (parameters, activations and AdamW state), four trainers of the same weights
take full training steps (``zero_grad``, forward, backward, ``AdamW.step``; torch's default
AdamW, ``foreach`` on CUDA):

- ``eager``: the model as it is;
- ``torch_compile``: ``torch.compile(model)``;
- ``autopar``: ``autopar.compile(model, mesh=(1,))``, op by op;
- ``autopar_compiled``: the same with ``compiler="inductor"``.

All four are built first, one after another: each one's first call's wall time (trace, plan and
compile) and its own peak memory (``torch.cuda.max_memory_allocated`` over a step, less what was
allocated before it was built) are taken then. They then take ``--repeat`` steps in turn (CUDA
events); a trainer's time is the median of its steps. The number of GPU kernels one step launches
(``torch.profiler``) shows what fusion saves. ``--optimizer fused`` makes every AdamW
``fused=True`` (torchtitan's default). ``--trace`` writes the profiler trace
of one ``autopar_compiled`` step (gzip'd Chrome trace).

The cost model's view: ``autopar.plan(..., compiler=...)`` of the same model on the ``h100-80g``
preset predicts the forward and backward for each executor; the ratio of the two predictions is
printed beside the measured ratio of the two autopar trainers.

Before timing, a float32 check on a small GPT: ``autopar.compile(..., compiler="inductor")`` and
``torch.compile(pm)`` against eager, loss and gradients, with #30's tolerances (1e-5 relative on
the loss, 1e-4 on gradients). Writes ``gpu_compiled_<optimizer>.csv`` and ``gpu_compiled_check.csv``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from bench_gpu import one_rank, time_cuda, write_csv

import autopar
from autopar.zoo.models import GPT, LLAMA_SHAPES, Llama

TRAINERS = ("eager", "torch_compile", "autopar", "autopar_compiled")
# torch's default AdamW (foreach on CUDA, the for-loop on a CPU), and fused (torchtitan's default)
OPTIMIZERS = {"default": {}, "fused": {"fused": True}}


def _models(tiny: bool, quick: bool):
    """(name, builder, batch, seq)."""
    if tiny:
        yield "gpt 2x64 (tiny)", lambda: GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, bias=False), 4, 64
        return
    yield "gpt 12x768", lambda: GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False), 8, 1024
    if not quick:
        cfg = {**LLAMA_SHAPES["llama-3-8b"], "n_layer": 2}
        yield "llama-3-8b widths, 2 layers", lambda: Llama(**cfg), 2, 2048


class Clock:
    """Step timing on ``device``: CUDA events there, the wall clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def median(self, fn, warmup: int, repeat: int) -> float:
        if self.cuda:
            return time_cuda(fn, warmup, repeat)
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeat):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
        return statistics.median(times)

    def peak(self, fn) -> int:
        if not self.cuda:
            return 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()


def _trainer(kind: str, model: torch.nn.Module, batch: tuple, cluster: str):
    """The module ``kind`` trains, built from ``model`` (which it may consume)."""
    if kind == "eager":
        return model
    if kind == "torch_compile":
        return torch.compile(model)
    compiler = "inductor" if kind == "autopar_compiled" else None
    return autopar.compile(model, mesh=(1,), example_inputs=batch, cluster=cluster, compiler=compiler)


def _kernels(step, device: torch.device) -> int:
    """GPU kernels (CPU ops on a CPU) one ``step`` launches."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wanted = "cuda" if device.type == "cuda" else "cpu"
    return sum(1 for event in prof.events() if str(event.device_type).lower().endswith(wanted))


def _write_trace(step, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    raw = path.with_suffix("")
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(path, "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()


def _build(kind, base, batch, args, clock):
    """Trainer ``kind`` warmed up: its step, first-call seconds, own peak bytes and first loss."""
    gc.collect()  # what earlier trainers left to the collector is not this one's
    before = torch.cuda.memory_allocated() if clock.cuda else 0
    begin = time.perf_counter()
    # nothing else holds the model: autopar's module keeps its own copy of the weights, and a
    # caller's model kept alive beside it would count twice
    module = _trainer(kind, copy.deepcopy(base), batch, args.cluster)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4, **OPTIMIZERS[args.optimizer])
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = module(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    step()
    clock.sync()
    first_s = time.perf_counter() - begin
    for _ in range(args.warmup):
        step()
    own_peak = clock.peak(step) - before  # the trainers built before it stay resident in ``before``
    return step, module, first_s, own_peak, losses[0].float().item()


def measure(name, build, batch_rows, seq, args, device, clock) -> list[dict]:
    torch.manual_seed(0)
    with torch.device(device):
        base = build().to(torch.bfloat16)
    vocab = base.lm_head.weight.shape[0]
    idx = torch.randint(0, vocab, (batch_rows, seq), device=device)
    targets = torch.randint(0, vocab, (batch_rows, seq), device=device)
    batch = (idx, targets)
    predicted = {}
    with torch.device("meta"):
        meta = build().to(torch.bfloat16)
    meta_batch = tuple(t.to("meta") for t in batch)
    for compiler in (None, "inductor"):
        plan = autopar.plan(meta, mesh=(1,), example_inputs=meta_batch, cluster="h100-80g", compiler=compiler)
        predicted[compiler] = plan.predicted.compute_s
    built = {kind: _build(kind, base, batch, args, clock) for kind in TRAINERS}
    times = {kind: [] for kind in TRAINERS}
    for _ in range(args.repeat):  # step by step in turn, so that drift falls on all alike
        for kind, (step, *_) in built.items():
            times[kind].append(clock.median(step, 0, 1))
    rows = []
    for kind, (step, _module, first_s, peak, first_loss) in built.items():
        step_s = statistics.median(times[kind])
        kernels = _kernels(step, device)
        if args.trace and kind == "autopar_compiled" and device.type == "cuda":
            _write_trace(step, Path(args.out) / f"trace_{name.split()[0]}_{args.optimizer}_autopar_compiled.json.gz")
        rows.append(
            dict(
                model=name,
                optimizer=args.optimizer,
                trainer=kind,
                step_ms=round(step_s * 1e3, 3),
                first_call_s=round(first_s, 1),
                own_peak_gib=round(peak / 2**30, 2),
                kernels_per_step=kernels,
                first_loss=round(first_loss, 4),
            )
        )
        print(
            f"  {name:<28} {kind:<17} step {step_s * 1e3:8.2f} ms  first call {first_s:6.1f} s  "
            f"own peak {peak / 2**30:6.2f} GiB  kernels {kernels:5d}  loss {first_loss:.4f}",
            flush=True,
        )
    del built
    if device.type == "cuda":
        torch.cuda.empty_cache()
    by = {row["trainer"]: row["step_ms"] for row in rows}
    print(
        f"  {name}: autopar compiled / torch.compile {by['autopar_compiled'] / by['torch_compile']:.3f}, "
        f"autopar compiled / autopar {by['autopar_compiled'] / by['autopar']:.3f} (predicted fwd+bwd inductor/eager "
        f"{predicted['inductor'] / predicted[None]:.3f}), torch.compile / eager {by['torch_compile'] / by['eager']:.3f}",
        flush=True,
    )
    for row in rows:
        row["over_torch_compile"] = round(row["step_ms"] / by["torch_compile"], 3)
        row["predicted_fwd_bwd_ms"] = round(predicted["inductor" if row["trainer"] == "autopar_compiled" else None] * 1e3, 3)
    return rows


def check_float32(device: torch.device) -> list[dict]:
    """autopar compiled and ``torch.compile(pm)`` against eager on a small GPT in float32."""
    cfg = dict(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128, bias=False)
    torch.manual_seed(0)
    with torch.device(device):
        eager = GPT(**cfg)
    idx = torch.randint(0, 512, (8, 128), device=device)
    targets = torch.randint(0, 512, (8, 128), device=device)
    ref = eager(idx, targets)
    ref.backward()
    rows = []
    for label in ("autopar inductor", "torch.compile(autopar)"):
        model = GPT(**cfg).to(device)
        model.load_state_dict(eager.state_dict())
        compiler = "inductor" if label == "autopar inductor" else None
        pm = autopar.compile(model, mesh=(1,), example_inputs=(idx, targets), cluster="h100-80g", compiler=compiler)
        runner = pm if compiler else torch.compile(pm)
        loss = runner(idx, targets)
        loss.backward()
        grads = pm.full_grads()
        worst = max((grads[n] - p.grad).norm().item() / p.grad.norm().item() for n, p in eager.named_parameters())
        loss_rel = abs(loss.item() - ref.item()) / abs(ref.item())
        ok = loss_rel <= 1e-5 and worst <= 1e-4
        rows.append(dict(check=label, loss_rel=loss_rel, worst_grad_rel=worst, within_tolerance=ok))
        print(f"  {label:<24} loss rel {loss_rel:.2e}  worst grad rel (norm) {worst:.2e}  {'ok' if ok else 'OFF'}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="one tiny GPT (a dry run of the script)")
    parser.add_argument("--quick", action="store_true", help="GPT-2 small only")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--optimizer", default="default", choices=sorted(OPTIMIZERS), help="AdamW's implementation")
    parser.add_argument("--trace", action="store_true", help="write one autopar_compiled step's profiler trace")
    parser.add_argument("--cluster", default="h100-80g", help="the preset autopar.compile prices with")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_compiled.py needs a CUDA device (or --device cpu --tiny for a dry run)", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(0)
        print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    out = Path(args.out)
    clock = Clock(device)
    failed = False
    with one_rank(device, "29541"):
        print("float32 against eager:", flush=True)
        try:
            write_csv(out / "gpu_compiled_check.csv", check_float32(device))
        except Exception:  # one device run is all there may be: report and go on to the timings
            traceback.print_exc()
            failed = True
        print("bf16 training steps:", flush=True)
        rows = []
        for name, build, batch_rows, seq in _models(args.tiny, args.quick):
            try:
                rows += measure(name, build, batch_rows, seq, args, device, clock)
            except Exception:
                traceback.print_exc()
                failed = True
            if rows:
                write_csv(out / f"gpu_compiled_{args.optimizer}.csv", rows)  # after each model, in case a later one fails
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
