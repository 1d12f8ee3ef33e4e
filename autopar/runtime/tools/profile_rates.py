"""``autopar profile``'s measurements of what the planner prices beyond peaks (``cost.rates``).

* **Matmuls at LLM shapes**: GEMMs from a few small ones to a LLaMA-8B layer's and LM head's at
  8k tokens, each as a fraction of the spec's peak in its dtype; the saturating curve
  ``e · f / (f + h)`` is fitted by least squares on ``1/fraction = 1/e + (h/e) · 1/f``
  (``fit_saturating``), linear in ``1/f``.
* **Attention** (``torch.nn.functional.scaled_dot_product_attention``) forward + backward in three
  mask kinds: full (neither), causal (``is_causal=True``: ``causal_work`` is its time over the
  full one's) and a materialized boolean mask (its forward rate, and its backward against twice
  its forward: ``masked_backward_slowdown``).
* **A memory-bound op**: ``a + b`` into a third tensor, its bytes over time against the copy
  bandwidth that the spec holds (``memory_efficiency``).
* **Launch overhead**: a chain of tiny multiplies forward and backward, host time per kernel.
* **The host link** (``measure_host_link``): pinned host -> device and device -> host copies of
  a few sizes, an alpha-beta fit per direction (``fit_link``), the slower of the two. On a CPU
  the device is the host and a spec has no host link; the same code then times plain copies
  (what the tests run).

Every timing is the best of a few synchronized runs after warm-up (``_time``). Sizes
are small on CPU and with ``quick``, so that the whole profile stays within a minute on a GPU.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from autopar.cost.cluster import LinkSpec
from autopar.cost.rates import ComputeRates
from autopar.errors import ClusterSpecError, InternalError

# (M, N, K) GEMMs: square ones from small to large, then LLaMA-3-8B's at 8192 tokens (attention
# projections, GQA key/value, MLP up and down, a quarter of the LM head), the shapes the planner prices.
CUDA_MATMULS = (
    (512, 512, 512),
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (8192, 4096, 4096),
    (8192, 1024, 4096),
    (8192, 14336, 4096),
    (8192, 4096, 14336),
    (8192, 32064, 4096),
)
CPU_MATMULS = ((32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512))
# (batch, heads, sequence, head dim) of the attention timed.
CUDA_ATTENTION = (2, 32, 4096, 128)
CPU_ATTENTION = (1, 2, 256, 32)


def fit_saturating(flops: Sequence[float], fractions: Sequence[float]) -> tuple[float, float]:
    """(efficiency, half_flops) of ``fraction = efficiency · f / (f + half_flops)``: least squares
    on the logarithms (a GEMM 10x off counts the same at any size), ``half_flops`` searched on a
    geometric grid over the sizes measured (and 0) with the best ``efficiency`` for each in
    closed form; the efficiency is capped at 1."""
    if len(flops) != len(fractions) or len(flops) < 2:
        raise InternalError(f"fit_saturating needs two or more (flops, fraction) pairs, got {len(flops)} and {len(fractions)}")
    logs = [math.log(r) for r in fractions]
    low, high = math.log(min(flops) / 100), math.log(max(flops) * 10)
    best = None
    for half in [0.0] + [math.exp(low + (high - low) * i / 400) for i in range(401)]:
        shape = [math.log(f / (f + half)) for f in flops]
        log_e = min(0.0, statistics.fmean(r - s for r, s in zip(logs, shape)))
        error = sum((r - s - log_e) ** 2 for r, s in zip(logs, shape))
        if best is None or error < best[0] - 1e-12:
            best = (error, math.exp(log_e), half)
    return best[1], best[2]


def fit_link(sizes_bytes: Sequence[float], times_s: Sequence[float]) -> LinkSpec:
    """An alpha-beta link ``t = α + n/β`` fitted by least squares (α at least 1 µs)."""
    mean_n, mean_t = statistics.fmean(sizes_bytes), statistics.fmean(times_s)
    var = sum((n - mean_n) ** 2 for n in sizes_bytes)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes_bytes, times_s)) / var
    if slope <= 0:
        raise ClusterSpecError(f"copy times {list(times_s)} do not grow with size {list(sizes_bytes)}: measure larger sizes")
    return LinkSpec(latency_s=max(mean_t - slope * mean_n, 1e-6), bandwidth_bytes_per_s=1.0 / slope)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device, repeats: int = 5, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs, synchronized."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time(fn, device: torch.device, repeats: int = 5) -> float:
    """The best of ``repeats`` runs after warm-up: what else the host does only slows a kernel."""
    time_call(fn, device, repeats=1, warmup=1)
    return min(time_call(fn, device, repeats=1, warmup=0) for _ in range(repeats))


def measure_matmuls(device: torch.device, dtype: torch.dtype, peak: float, shapes) -> list[tuple[float, float]]:
    """(FLOPs, fraction of ``peak``) of each (M, N, K) GEMM in ``dtype``."""
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        flops = 2.0 * m * n * k
        out.append((flops, flops / _time(lambda a=a, b=b: torch.mm(a, b), device) / peak))
    return out


def measure_attention(device: torch.device, dtype: torch.dtype, peak: float, shape) -> dict[str, float]:
    """``ComputeRates``' attention fields from SDPA forward + backward in three mask kinds."""
    batch, heads, seq, head_dim = shape
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, device=device, dtype=torch.bool).tril()
    grad = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)
    flops = 4.0 * batch * heads * seq * seq * head_dim  # forward of every block: QK^T and PV

    def forward(**kw):
        return F.scaled_dot_product_attention(q, k, v, **kw)

    def both(**kw):
        forward(**kw).backward(grad)

    full = _time(lambda: both(), device)
    causal = _time(lambda: both(is_causal=True), device)
    masked_forward = _time(lambda: forward(attn_mask=mask), device)
    masked = _time(lambda: both(attn_mask=mask), device)
    return {
        "attention_efficiency": min(1.0, 3 * flops / full / peak),
        "causal_work": min(1.0, causal / full),
        "masked_attention_efficiency": min(1.0, flops / masked_forward / peak),
        "masked_backward_slowdown": max(1.0, (masked - masked_forward) / (2 * masked_forward)),
    }


def measure_memory_efficiency(device: torch.device, numel: int, copy_bandwidth: float) -> float:
    """An elementwise add's bytes/s (two reads, one write) over ``copy_bandwidth``, at most 1."""
    a, b = torch.rand(numel, device=device), torch.rand(numel, device=device)
    out = torch.empty_like(a)
    seconds = _time(lambda: torch.add(a, b, out=out), device)
    return min(1.0, 3 * numel * a.element_size() / seconds / copy_bandwidth)


def measure_launch_overhead(device: torch.device, num_ops: int = 50) -> float:
    """Host seconds per kernel of an eager chain of tiny multiplies, forward and backward."""
    x = torch.ones(8, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(num_ops):
            y = y * 1.0001
        y.sum().backward()

    return _time(chain, device) / (2 * num_ops + 2)


def measure_checkpoint_hook(device: torch.device, num_segments: int = 4, ops_per_segment: int = 15) -> float:
    """Host seconds per op that ``torch.utils.checkpoint`` (non-reentrant, as
    ``passes.memory.Checkpointed`` runs it) adds to a chain of tiny ops, besides its
    recompute: ``num_segments`` segments of ``ops_per_segment`` ops (about a transformer layer's)
    that each save a tensor, forward and backward."""
    import torch.utils.checkpoint  # only this measurement needs it

    x = torch.ones(8, device=device, requires_grad=True)

    def segment(y: torch.Tensor) -> torch.Tensor:
        for _ in range(ops_per_segment):
            y = y.sin()  # saves its input for backward, as a layer's ops do
        return y

    def plain():
        y = x
        for _ in range(num_segments):
            y = segment(y)
        y.sum().backward()

    def checkpointed():
        y = x
        for _ in range(num_segments):
            y = torch.utils.checkpoint.checkpoint(segment, y, use_reentrant=False)
        y.sum().backward()

    num_ops = num_segments * ops_per_segment
    plain_s = _time(plain, device)
    launch = plain_s / (2 * num_ops + 2)
    return max(0.0, (_time(checkpointed, device) - plain_s - num_ops * launch) / num_ops)


def measure_rates(device: torch.device, dtype: torch.dtype, peak: float, copy_bandwidth: float, quick: bool) -> ComputeRates:
    """The ``ComputeRates`` of ``device`` in ``dtype`` against the spec's ``peak`` and
    ``copy_bandwidth`` (module docstring), with what was measured in its ``source``."""
    cuda = device.type == "cuda"
    shapes = CUDA_MATMULS if cuda else CPU_MATMULS
    if quick:
        shapes = shapes[:-3] if cuda else shapes[:-1]
    samples = measure_matmuls(device, dtype, peak, shapes)
    efficiency, half_flops = fit_saturating([f for f, _ in samples], [r for _, r in samples])
    attention = measure_attention(device, dtype, peak, CUDA_ATTENTION if cuda else CPU_ATTENTION)
    memory = measure_memory_efficiency(device, (64 << 20 if cuda else 4 << 20) // (4 if quick else 1), copy_bandwidth)
    launch = measure_launch_overhead(device)
    hook = measure_checkpoint_hook(device)
    shown = ", ".join(f"{m}x{n}x{k} {r:.2f}" for (m, n, k), (_, r) in zip(shapes, samples))
    source = (
        f"Measured by autopar profile on {device.type} in {str(dtype).removeprefix('torch.')} with torch "
        f"{torch.__version__}: GEMM (MxNxK) fractions of peak {shown}, fitted e·f/(f+h); SDPA "
        f"{'x'.join(map(str, CUDA_ATTENTION if cuda else CPU_ATTENTION))} (B, H, S, D) full, causal and masked; "
        f"an elementwise add against the copy bandwidth; a chain of tiny multiplies for the launch overhead, "
        f"and a chain of tiny sines in checkpointed segments of 15 for the checkpoint hooks."
    )
    return ComputeRates(
        matmul_efficiency=efficiency,
        matmul_half_flops=half_flops,
        memory_efficiency=memory,
        launch_overhead_s=launch,
        checkpoint_hook_s=hook,
        source=source,
        **attention,
    )


def measure_host_link(device: torch.device, sizes_bytes: Sequence[int], repeats: int = 5) -> dict[str, Any]:
    """Host -> device and device -> host copies of ``sizes_bytes`` (pinned host memory on CUDA),
    an alpha-beta fit per direction, and the slower of the two as ``link``."""
    pin = device.type == "cuda"
    fits = {}
    for direction in ("host_to_device", "device_to_host"):
        times = []
        for size in sizes_bytes:
            host = torch.empty(size // 4, pin_memory=pin)
            dev = torch.empty(size // 4, device=device)
            src, dst = (host, dev) if direction == "host_to_device" else (dev, host)
            times.append(_time(lambda dst=dst, src=src: dst.copy_(src, non_blocking=pin), device, repeats))
        fits[direction] = fit_link(sizes_bytes, times)
    link = LinkSpec(
        latency_s=max(f.latency_s for f in fits.values()),
        bandwidth_bytes_per_s=min(f.bandwidth_bytes_per_s for f in fits.values()),
    )
    return {"link": link, **fits}


def host_link_sizes(device: torch.device, quick: bool) -> tuple[int, ...]:
    """Copy sizes: 1 MiB to 256 MiB on CUDA (to 64 MiB with ``quick``), to 32 MiB on CPU."""
    top = (64 if quick else 256) << 20 if device.type == "cuda" else 32 << 20
    return tuple(sorted({1 << 20, top // 16, top // 4, top}))


__all__ = [
    "time_call",
    "fit_saturating",
    "fit_link",
    "measure_matmuls",
    "measure_attention",
    "measure_memory_efficiency",
    "measure_launch_overhead",
    "measure_checkpoint_hook",
    "measure_rates",
    "measure_host_link",
    "host_link_sizes",
    "CUDA_MATMULS",
    "CPU_MATMULS",
]
