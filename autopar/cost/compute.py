"""Compute cost: a roofline over FLOPs and bytes moved.

For one op and one strategy, the time on each rank is

    forward_s  = max(flops / split / peak_flops(dtype), bytes / split / memory_bandwidth) / share
    backward_s = backward_factor · forward_s     (only when requires_grad, else 0)

* ``flops`` (``node_flops``) is the FLOP count of the whole, unsharded forward: torch's
  ``flop_counter.flop_registry`` where it has the op (mm, addmm, bmm, baddbmm, convolution, the
  fused attention kernels); explicit formulas for the composite ops that training IR keeps whole
  (linear: 2·numel(x)·N; matmul; conv1d/2d/3d and their transposes; scaled_dot_product_attention:
  2·B·H·T·S·(D_qk + D_v), which is 4·B·H·T·S·D when the head dims agree, ignoring causal masks);
  0 for view ops; else one FLOP per output element, or per input element for reductions.
* ``bytes`` (``node_bytes``) is the bytes read and written: the sum of the tensor inputs' and
  outputs' sizes, 0 for view ops. Embedding reads only the rows it gathers, not its whole table.
* ``split`` is the product of the sizes of the mesh axes on which any input or output of the
  strategy is not replicated (Shard or Partial): on such an axis each rank does 1/k of the work,
  and on an axis where everything is replicated each rank does all of it (for mm,
  S(1) x S(0) → P splits the work through its Partial output).
* mixture of experts (``autopar::moe_experts``, ``trace.moe``): each of the T·k token copies
  runs one expert's gated MLP, 2·T·k·(H·2I + I·H) = 6·T·k·H·I FLOPs; the grouped expert matmul
  ``transformers::grouped_mm_fallback`` (rows [S, K] by experts [E, K, N]): 2·S·K·N.
  Under expert parallelism (a kernel of ``EXPERT_PARALLEL_KERNELS``) routing decides how many
  token copies each rank's experts get; the step waits for the busiest rank, priced as
  ``CAPACITY_FACTOR`` times the mean (GShard's and Switch's capacity factor; 1.25 by default).
* ``share`` (``ClusterSpec.compute_share``) is the fraction of a device's compute each rank
  gets: 1 unless the mesh puts more ranks on a node than it runs at once (CPU ranks on fewer
  cores, which the operating system time-slices). Measured op times (``compute="measured"``,
  timed on one process alone) are divided by it too.
* under ``cluster.executor == "inductor"`` (``executed_bytes``) a pointwise op (``POINTWISE``,
  the pointwise rule tables) is fused with its neighbours: its inputs come from the kernel it is
  fused into, so it moves only its output, not its inputs as well. A lone unary op costs half its
  eager bytes, a binary op a third; a fused chain still pays one write per op where inductor's
  kernel writes once, so long chains stay slightly overpriced. Other ops are priced as eager.
* ``backward_factor`` is 2 for the matmul family (mm, bmm, addmm, baddbmm, linear, matmul,
  convolutions, attention: a gradient for each of the two operands) and 1 for everything else.
* The context-parallel attention kernel prices its most loaded rank (causal work imbalance,
  ``ir.context.max_work_fraction``) and the forward its backward recomputes.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import conv_flop_count, flop_registry

from autopar.cost.cluster import ClusterSpec
from autopar.cost.measured import measured_seconds
from autopar.cost.rates import achieved
from autopar.ir.context import max_work_fraction
from autopar.ir.spec import VIEW_OP_NAMES, Spec, replicated_axes
from autopar.rules import pointwise
from autopar.rules.moe import EXPERT_PARALLEL_KERNELS
from autopar.rules.registry import OpInfo, Strategy, TensorArg
from autopar.trace.moe import EXPERTS_OP

# The busiest rank's share of expert work over the mean under expert parallelism (routing is
# data-dependent): 1.25, the capacity factor GShard and Switch Transformer train with.
CAPACITY_FACTOR = 1.25

aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    """The aten overload packets that exist in this torch build, by name."""
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


VIEW_OPS = _packets(*sorted(VIEW_OP_NAMES)) | {operator.getitem}

MATMUL_OPS = _packets(
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "linear",
    "matmul",
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)

REDUCTION_OPS = _packets(
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "prod",
    "var",
    "std",
    "var_mean",
    "norm",
    "linalg_vector_norm",
    "argmax",
    "argmin",
    "logsumexp",
    "any",
    "all",
)

_CONV_OPS = _packets("conv1d", "conv2d", "conv3d")

# The ops that inductor fuses into one kernel with their producers and consumers.
POINTWISE = frozenset(
    pointwise.UNARY_NONLINEAR
    + pointwise.BINARY_NONLINEAR
    + pointwise.UNARY_LINEAR
    + pointwise.CASTS
    + pointwise.ADDITIVE
    + pointwise.SCALED
    + pointwise.MULTIPLICATIVE
    + pointwise.DIVIDING
    + pointwise.SELECTING
    + pointwise.SCALAR_FILL
    + pointwise.FUSED_MULTIPLY_ADD
)
_CONV_TRANSPOSE_OPS = _packets("conv_transpose1d", "conv_transpose2d", "conv_transpose3d")


def _packet(target: Any) -> Any:
    return getattr(target, "overloadpacket", target)


def is_view(target: Any) -> bool:
    """Whether the op ``target`` (an overload or its packet) is a view: it moves no data."""
    return _packet(target) in VIEW_OPS


def _shape(arg: Any) -> tuple[int, ...]:
    assert isinstance(arg, TensorArg), f"expected a tensor argument, got {arg!r}"
    return arg.shape


def compute_dtype(info: OpInfo) -> torch.dtype:
    """The dtype an op computes in: its first floating input's, an explicit ``dtype`` argument's,
    or float32."""
    for arg in info.inputs:
        if arg.dtype.is_floating_point:
            return arg.dtype
    if isinstance(info.kw.get("dtype"), torch.dtype):
        return info.kw["dtype"]
    return torch.float32


def node_flops(info: OpInfo) -> float:
    """FLOPs of the whole (unsharded) op's forward. See the module docstring for the formulas."""
    packet = _packet(info.target)
    if packet in VIEW_OPS:
        return 0.0
    if packet is aten.linear:
        x, weight = _shape(info.kw["input"]), _shape(info.kw["weight"])
        return 2.0 * math.prod(x) * weight[0]
    if info.target is EXPERTS_OP:
        tokens, top_k = _shape(info.kw["top_k_index"])
        gate_up = _shape(info.kw["gate_up"])
        return 2.0 * tokens * top_k * 3 * gate_up[1] * gate_up[2] / 2
    if _is_grouped_mm(info):
        rows, inner = _shape(info.kw["input"])
        return 2.0 * rows * inner * _shape(info.kw["weight"])[2]
    if packet is aten.matmul:
        return _matmul_flops(_shape(info.kw["self"]), _shape(info.kw["other"]))
    if packet is aten.scaled_dot_product_attention:
        q, k, v = (_shape(info.kw[n]) for n in ("query", "key", "value"))
        batch_heads = math.prod(q[:-2])
        return 2.0 * batch_heads * q[-2] * k[-2] * (q[-1] + v[-1])
    if packet in _CONV_OPS or packet in _CONV_TRANSPOSE_OPS:
        x, weight = _shape(info.kw["input"]), _shape(info.kw["weight"])
        if len(x) == len(weight) - 1:  # unbatched input
            x = (1, *x)
        out = info.out_shape if len(info.out_shape) == len(weight) else (1, *info.out_shape)
        return float(conv_flop_count(list(x), list(weight), list(out), packet in _CONV_TRANSPOSE_OPS))
    if packet in flop_registry:
        return float(_registry_flops(info, flop_registry[packet]))
    if packet in REDUCTION_OPS:
        return float(max((math.prod(a.shape) for a in info.inputs), default=0))
    return float(sum(math.prod(shape) for shape in info.out_shapes))


def _is_grouped_mm(info: OpInfo) -> bool:
    schema = getattr(info.target, "_schema", None)
    return schema is not None and schema.name == "transformers::grouped_mm_fallback"


def _matmul_flops(a: Sequence[int], b: Sequence[int]) -> float:
    """torch.matmul with broadcasting: 2·M·K·N per batch element, vectors counted as M or N = 1."""
    m = a[-2] if len(a) >= 2 else 1
    k = a[-1]
    n = b[-1] if len(b) >= 2 else 1
    batch = torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    return 2.0 * math.prod(batch) * m * k * n


def _registry_flops(info: OpInfo, formula: Any) -> int:
    """Call a ``flop_registry`` formula the way ``FlopCounterMode`` does: the op's own arguments
    (here meta tensors of the right shapes) and ``out_val``."""

    def meta(value: Any) -> Any:
        if isinstance(value, TensorArg):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, (list, tuple)):
            return type(value)(meta(v) for v in value)
        return value

    dtype = compute_dtype(info)
    outs = [torch.empty(shape, dtype=dtype, device="meta") for shape in info.out_shapes]
    out_val = tuple(outs) if info.out_is_tuple else (outs[0] if outs else None)
    args, kwargs = [], {}
    for arg in info.target._schema.arguments:
        if arg.kwarg_only:
            kwargs[arg.name] = meta(info.kw.get(arg.name))
        else:
            args.append(meta(info.kw.get(arg.name)))
    return formula(*args, out_val=out_val, **kwargs)


def _tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def node_bytes(info: OpInfo) -> float:
    """Bytes read and written by the whole op: inputs plus outputs, 0 for view ops.

    Outputs are taken to have ``compute_dtype(info)``. Embedding reads the rows it gathers
    (one output's worth) and its indices, not the whole table.
    """
    packet = _packet(info.target)
    if packet in VIEW_OPS:
        return 0.0
    out_dtype = compute_dtype(info)
    out_bytes = sum(_tensor_bytes(shape, out_dtype) for shape in info.out_shapes)
    if packet is aten.embedding:
        indices = info.kw["indices"]
        return float(_tensor_bytes(indices.shape, indices.dtype) + 2 * out_bytes)
    in_bytes = sum(_tensor_bytes(a.shape, a.dtype) for a in info.inputs)
    return float(in_bytes + out_bytes)


def executed_bytes(info: OpInfo, executor: str) -> float:
    """``node_bytes`` as ``executor`` runs the op: under "inductor" a pointwise op moves only its
    output (module docstring)."""
    if executor == "inductor" and info.target in POINTWISE:
        return float(sum(_tensor_bytes(shape, compute_dtype(info)) for shape in info.out_shapes))
    return node_bytes(info)


def work_split(strategy: Strategy, mesh_shape: Sequence[int], replicated: Callable[[Spec], int] = replicated_axes) -> int:
    """Product of the mesh axes on which some input or output is not replicated (``replicated``:
    ``spec.replicated_axes``, or a cache of it)."""
    split_axes = 0
    for spec in strategy.ins + strategy.outs:
        split_axes |= ~replicated(spec)
    return math.prod(size for axis, size in enumerate(mesh_shape) if split_axes >> axis & 1)


def backward_factor(info: OpInfo) -> float:
    """Backward time as a multiple of forward time: 2 for the matmul family, else 1."""
    matmuls = _packet(info.target) in MATMUL_OPS or info.target is EXPERTS_OP or _is_grouped_mm(info)
    return 2.0 if matmuls else 1.0


def roofline_terms(
    info: OpInfo,
    strategy: Strategy,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    requires_grad: bool,
) -> tuple[float, float, float]:
    """(FLOP-bound seconds, memory-bound seconds, forward+backward factor) of the local op: its
    time is ``max(flops_s, bytes_s) · factor`` (``compute_cost_s``).

    With ``cluster.compute == "measured"`` an op that ``autopar.cost.measured`` can time gives
    ``(measured seconds / share / factor, 0, factor)``, so that the same product is its measured
    time at this rank's share of the device (``ClusterSpec.compute_share``)."""
    return roofline_terms_each(info, [strategy], mesh_shape, cluster, requires_grad)[0]


def roofline_terms_each(
    info: OpInfo,
    strategies: Sequence[Strategy],
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    requires_grad: bool,
    replicated: Callable[[Spec], int] = replicated_axes,
) -> list[tuple[float, float, float]]:
    """``roofline_terms`` of each of one op's ``strategies``: the op's FLOPs and bytes are
    counted once, and each (work split, kernel, kernel axes), all that the roofline reads of a
    strategy, is priced once (``replicated``: as ``work_split`` takes it)."""
    factor = 1.0 + backward_factor(info) if requires_grad else 1.0
    share = cluster.compute_share(mesh_shape)
    measured = cluster.compute == "measured" and _packet(info.target) not in VIEW_OPS
    flops = moved = peak = None
    found: dict[tuple, tuple[float, float, float]] = {}
    terms = []
    for strategy in strategies:
        if measured:
            seconds = measured_seconds(info, strategy, mesh_shape, requires_grad)
            if seconds is not None:
                terms.append((seconds / share / factor, 0.0, factor))
                continue
        split = work_split(strategy, mesh_shape, replicated)
        key = (split, strategy.kernel, strategy.kernel_axes)
        found_terms = found.get(key)
        if found_terms is None:
            if flops is None:
                flops, moved = node_flops(info), executed_bytes(info, cluster.executor)
                peak = cluster.peak_flops_for(compute_dtype(info))
            if strategy.kernel in EXPERT_PARALLEL_KERNELS:
                split /= CAPACITY_FACTOR
            if cluster.rates is None:
                flops_s = flops / split / share / peak
                memory_s = moved / split / share / cluster.memory_bandwidth_bytes_per_s
                strategy_factor = factor
            else:
                flops_s, memory_s, strategy_factor = _achieved_terms(info, flops, moved, split / share, peak, cluster, factor)
            if strategy.kernel == "sdpa_context_parallel":
                flops_s, strategy_factor = _context_parallel_terms(info, strategy, mesh_shape, flops_s, factor, requires_grad)
            found_terms = found[key] = (flops_s, memory_s, strategy_factor)
        terms.append(found_terms)
    return terms


ATTENTION_OPS = _packets(
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def rate_kind(info: OpInfo) -> str:
    """Which achieved rate prices an op (``cost.rates``): "attention", "matmul" or "other"."""
    packet = _packet(info.target)
    if packet in ATTENTION_OPS:
        return "attention"
    if packet in MATMUL_OPS or info.target is EXPERTS_OP or _is_grouped_mm(info):
        return "matmul"
    return "other"


def _achieved_terms(info, flops, moved, split, peak, cluster, factor) -> tuple[float, float, float]:
    """The roofline terms at the rates kernels reach (``cost.rates``): ``split`` is the work
    split over the rank's compute share. Each of the ``factor`` kernels (forward, backward)
    takes at least the launch overhead."""
    rates = cluster.rates
    # under inductor the graph is traced without the batch's values: the mask's kernel runs
    example_mask = info.example_mask if cluster.executor != "inductor" else None
    got = achieved(rates, rate_kind(info), flops / split, info.kw, example_mask)
    flops_s = got.work * flops / split / (peak * got.efficiency)
    memory_s = moved / split / (cluster.memory_bandwidth_bytes_per_s * rates.memory_efficiency)
    if factor > 1 and got.backward_slowdown != 1:
        factor = 1.0 + backward_factor(info) * got.backward_slowdown
    # a view launches nothing, nor does a pointwise op that inductor fuses into its neighbour's kernel
    fused = cluster.executor == "inductor" and info.target in POINTWISE
    floor = rates.launch_overhead_s if (flops or moved) and not fused else 0.0
    return max(flops_s, floor), max(memory_s, floor), factor


def _context_parallel_terms(info, strategy, mesh_shape, flops_s, factor, requires_grad) -> tuple[float, float]:
    """The context-parallel attention kernel (``ops.attention``): its most loaded rank does
    ``ir.context.max_work_fraction`` times the mean rank's causal work (1.0 when head-tail
    balanced, i.e. when a rank's slice has two halves), and its backward recomputes the forward
    once (it saves only its local q, k and v), so forward + backward is ``1 + backward_factor + 1``
    forwards (measured 1.26x of plain autograd on an H100 against 1.33x here:
    benchmarks/README.md)."""
    sizes = tuple(mesh_shape[axis] for axis in strategy.kernel_axes)
    flops_s *= max_work_fraction(_shape(info.kw["query"])[-2], sizes)
    return flops_s, factor + 1.0 if requires_grad else factor


def compute_cost_s(
    info: OpInfo,
    strategy: Strategy,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    requires_grad: bool,
) -> float:
    """Forward plus backward seconds of the local op on one rank (the module docstring's
    roofline); the backward term is counted only when ``requires_grad``."""
    flops_s, memory_s, factor = roofline_terms(info, strategy, mesh_shape, cluster, requires_grad)
    return max(flops_s, memory_s) * factor


__all__ = [
    "node_flops",
    "node_bytes",
    "executed_bytes",
    "POINTWISE",
    "compute_cost_s",
    "roofline_terms",
    "roofline_terms_each",
    "compute_dtype",
    "work_split",
    "backward_factor",
    "CAPACITY_FACTOR",
    "EXPERT_PARALLEL_KERNELS",
    "VIEW_OPS",
    "MATMUL_OPS",
    "ATTENTION_OPS",
    "REDUCTION_OPS",
    "rate_kind",
]
