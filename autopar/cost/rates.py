"""Achieved rates: what kernels reach of a device's peaks, by shape, kernel and mask.

A roofline against datasheet peaks prices every op as if it ran at the ceiling; real steps do
not (one H200 ran HF LLaMA-3-8B widths at 46% of the bf16 peak where the roofline assumed about
80%; issue 44). ``ComputeRates`` holds the coefficients of a small model of what kernels reach,
per device, in the cluster spec (``ClusterSpec.rates``), with their source, so that ``autopar
profile`` can measure and replace them. A spec without rates prices the plain roofline (the CPU
presets, and spec files written before rates existed).

With rates, one op's local forward on one rank takes

    flops_s  = work · flops / split / (peak(dtype) · efficiency)
    memory_s = bytes / split / (memory_bandwidth · memory_efficiency)
    seconds  = max(flops_s, memory_s, launch_overhead_s) · factor

* **Matmuls** (mm, bmm, addmm, linear, matmul, convolutions): ``efficiency`` saturates in the
  local GEMM's FLOPs, ``matmul_efficiency · f / (f + matmul_half_flops)``: a GEMM of
  ``matmul_half_flops`` FLOPs reaches half of the large-GEMM ceiling. Small and skinny GEMMs
  fill few waves of the device's SMs and stay far from peak; large ones approach
  ``matmul_efficiency`` (cuBLAS reaches about 70-75% of an H100's dense bf16 peak).
* **Attention** (``scaled_dot_product_attention`` and its fused kernels) by mask kind
  (``mask_kind``): "causal" (``is_causal=True``, no mask) runs the flash/cuDNN kernel, which
  skips the blocks above the diagonal, so it does ``causal_work`` (about half) of the FLOPs at
  ``attention_efficiency``; "masked" (a materialized ``attn_mask``) computes every block at
  ``masked_attention_efficiency`` and its backward takes ``masked_backward_slowdown`` times the
  unmasked backward (cuDNN's masked backward measured 3x slower on an H200; issue 43);
  "full" (neither) computes every block at ``attention_efficiency``.
* **Everything else** is memory-bound at ``memory_efficiency`` of the bandwidth (elementwise
  kernels stream at about 80-90% of HBM bandwidth).
* **Launch overhead**: each kernel takes at least ``launch_overhead_s`` (the host's dispatch time
  per eager op, autograd included), which is what makes small models host-bound. ``factor`` is
  forward + backward kernels, so an op with backward launches ``factor`` kernels.
* **Checkpoint hooks**: a checkpointed segment's ops cost the host ``checkpoint_hook_s`` each on
  top of their recompute (torch.utils.checkpoint packs and unpacks every saved tensor in Python;
  a selective segment's dispatch modes see every op, ``SELECTIVE_HOOK_FACTOR`` times that). It
  is host time: a segment's recompute takes the longer of its ops' device time and its host
  time (launches and hooks, ``recompute_s``), so it shows where the step is host-bound.
* **The optimizer step** (``optimizer_step_s``; ``cost.optimizer`` prices it in every plan): AdamW reads and writes the parameters and both
  moments and reads the gradients, memory-bound at the achieved bandwidth, one launch per tensor
  group (foreach).

The presets' coefficients are sourced in their ``rates.source``; ``autopar profile`` fits them
on the device it runs on (``runtime.tools.profile``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from autopar.errors import ClusterSpecError, InternalError

MASK_KINDS = ("causal", "masked", "full")


def _fraction(name: str, value: Any, upper: float = 1.0) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= upper:
        raise ClusterSpecError(f"ComputeRates.{name} must be a number in (0, {upper:g}], got {value!r}")


def _non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ClusterSpecError(f"ComputeRates.{name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ComputeRates:
    """Fractions of the peaks that kernels reach (module docstring). Units: FLOPs, seconds."""

    # Large GEMMs' ceiling as a fraction of ``peak_flops`` (per dtype: it scales that dtype's peak).
    matmul_efficiency: float = 1.0
    # The local GEMM FLOPs at which a matmul reaches half that ceiling (0: every GEMM at it).
    matmul_half_flops: float = 0.0
    # Fused attention (flash / cuDNN, no materialized mask), forward and backward alike.
    attention_efficiency: float = 1.0
    # The share of a full attention's FLOPs that a causal kernel computes (0.5: half the blocks).
    causal_work: float = 1.0
    # Attention with a materialized mask: the kernel that takes one, and its slower backward.
    masked_attention_efficiency: float = 1.0
    masked_backward_slowdown: float = 1.0
    # Memory-bound kernels' share of ``memory_bandwidth_bytes_per_s``.
    memory_efficiency: float = 1.0
    # The least time one kernel takes: the host's dispatch of one eager op.
    launch_overhead_s: float = 0.0
    # Host seconds per op of a checkpointed segment spent in ``torch.utils.checkpoint``'s hooks
    # (saved tensors packed in forward, packed again in the recompute, unpacked in backward).
    checkpoint_hook_s: float = 0.0
    # Where these numbers come from (datasheet, measured where, fitted from what).
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("matmul_efficiency", "attention_efficiency", "masked_attention_efficiency", "memory_efficiency"):
            _fraction(name, getattr(self, name))
        _fraction("causal_work", self.causal_work)
        _non_negative("matmul_half_flops", self.matmul_half_flops)
        _non_negative("launch_overhead_s", self.launch_overhead_s)
        _non_negative("checkpoint_hook_s", self.checkpoint_hook_s)
        slowdown = self.masked_backward_slowdown
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 1 <= slowdown < math.inf:
            raise ClusterSpecError(f"ComputeRates.masked_backward_slowdown must be a finite number >= 1, got {slowdown!r}")
        if not isinstance(self.source, str):
            raise ClusterSpecError(f"ComputeRates.source must be a string, got {self.source!r}")

    def matmul_fraction(self, local_flops: float) -> float:
        """The fraction of peak a GEMM of ``local_flops`` FLOPs reaches (saturating curve)."""
        if self.matmul_half_flops == 0 or local_flops <= 0:
            return self.matmul_efficiency
        return self.matmul_efficiency * local_flops / (local_flops + self.matmul_half_flops)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "rates") -> ComputeRates:
        """From a table of the fields; missing ones keep their defaults (the plain roofline)."""
        if not isinstance(data, Mapping):
            raise ClusterSpecError(f"{where} must be a table of ComputeRates fields, got {data!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ClusterSpecError(f"{where} has unknown keys {sorted(unknown)}; expected some of {sorted(known)}")
        return cls(**data)


def mask_kind(kw: Mapping[str, Any], example_mask: str | None = None) -> str:
    """ "causal", "masked" or "full" for an attention op's arguments (``OpInfo.kw``): a
    materialized ``attn_mask`` wins over ``is_causal`` (the kernel that takes a mask runs), except
    where the example batch makes the mask causal (``example_mask``, ``OpInfo.example_mask``),
    which the runtime attends without."""
    if example_mask == "causal":
        return "causal"
    if kw.get("attn_mask") is not None or kw.get("attn_bias") is not None:  # attn_bias: the fused kernels' name
        return "masked"
    return "causal" if kw.get("is_causal") else "full"


@dataclass(frozen=True, slots=True)
class Achieved:
    """One op's (work share, fraction of peak FLOP/s, backward multiplier) under ``ComputeRates``."""

    work: float
    efficiency: float
    backward_slowdown: float = 1.0


def achieved(
    rates: ComputeRates, kind: str, local_flops: float, kw: Mapping[str, Any], example_mask: str | None = None
) -> Achieved:
    """What an op of ``kind`` ("matmul", "attention" or "other") reaches; ``local_flops`` is its
    FLOPs on one rank, ``kw`` its arguments and ``example_mask`` (``mask_kind``) for the
    attention mask."""
    if kind == "matmul":
        return Achieved(1.0, rates.matmul_fraction(local_flops))
    if kind == "attention":
        mask = mask_kind(kw, example_mask)
        if mask == "causal":
            return Achieved(rates.causal_work, rates.attention_efficiency)
        if mask == "masked":
            return Achieved(1.0, rates.masked_attention_efficiency, rates.masked_backward_slowdown)
        return Achieved(1.0, rates.attention_efficiency)
    return Achieved(1.0, 1.0)


# Checkpoint-hook cost of a selective segment's op against a full one's: torch's selective
# checkpoint runs every op of the segment through a Python dispatch mode in forward and again in
# the recompute. Measured on 2 CPU cores, torch 2.13, a 12-layer GPT's runtime graph, host-bound:
# full checkpointing of every layer added 8.6 ms of hooks to a 10.7 ms step, selective 22 ms.
SELECTIVE_HOOK_FACTOR = 2.5


def recompute_s(rates: ComputeRates | None, forward_s: float, num_ops: int, policy: str) -> float:
    """Seconds a checkpointed segment adds: its recomputed ops' ``forward_s`` (each at least a
    launch), or, where the host is slower, its ``num_ops`` launches plus ``torch.utils.checkpoint``'s
    hooks under ``policy`` ("full", or a selective one, whose dispatch mode sees every op):
    host time hides behind device time."""
    if rates is None:
        return forward_s
    hooks = num_ops * rates.checkpoint_hook_s * (SELECTIVE_HOOK_FACTOR if policy != "full" else 1.0)
    return max(forward_s, num_ops * rates.launch_overhead_s + hooks)


# Tensor passes over HBM per AdamW step, relative to the fused kernel's 7 (read param, grad and
# both moments; write param and both moments): torch's foreach AdamW runs one kernel per
# operation, each reading and writing whole tensors: weight decay mul_ (2 passes), lerp_ (3),
# mul_ (2), addcmul_ (4: the gradient is read as both factors), sqrt (2), div_ (2), add_ (2),
# addcdiv_ (4), 21 passes. On one H200 the foreach step of a 1.5 B-parameter bf16 model took
# 10.5 ms more than the fused one (results/gpu_compiled_*.csv: 62.5 against 52.0 ms), where
# 14 bytes per parameter at 0.8 of 4.8 TB/s make the fused step 5.4 ms: foreach 2.9 times it.
OPTIMIZER_TRAFFIC = {"fused": 1.0, "foreach": 21 / 7}


def optimizer_step_s(
    param_elements: float,
    param_itemsize: int,
    state_itemsize: int,
    num_tensors: int,
    memory_bandwidth_bytes_per_s: float,
    rates: ComputeRates | None,
    implementation: str = "foreach",
) -> float:
    """Seconds of one AdamW step over ``param_elements`` local elements in ``num_tensors``
    tensors: memory-bound (parameter and gradient in ``param_itemsize``, both moments in
    ``state_itemsize``) at the achieved bandwidth, ``OPTIMIZER_TRAFFIC`` times the fused
    kernel's bytes for ``implementation``, and at least one launch per tensor for "foreach"
    (its kernels take lists, but each list op is launched per chunk of tensors) or per step."""
    if implementation not in OPTIMIZER_TRAFFIC:
        raise InternalError(f"optimizer implementation must be one of {sorted(OPTIMIZER_TRAFFIC)}, got {implementation!r}")
    # fused: reads param, grad, exp_avg, exp_avg_sq; writes param, exp_avg, exp_avg_sq
    moved = param_elements * (3 * param_itemsize + 4 * state_itemsize) * OPTIMIZER_TRAFFIC[implementation]
    efficiency = rates.memory_efficiency if rates is not None else 1.0
    launch = rates.launch_overhead_s if rates is not None else 0.0
    launches = num_tensors if implementation == "foreach" else 1
    return max(moved / (memory_bandwidth_bytes_per_s * efficiency), launches * launch)


__all__ = [
    "ComputeRates",
    "Achieved",
    "achieved",
    "mask_kind",
    "optimizer_step_s",
    "recompute_s",
    "OPTIMIZER_TRAFFIC",
    "SELECTIVE_HOOK_FACTOR",
    "MASK_KINDS",
]
