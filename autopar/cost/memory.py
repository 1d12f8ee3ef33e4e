"""Memory cost: bytes per device of tensors, parameter state, and what backward keeps alive.

The solver sums these over a liveness walk of the graph. This module gives the pieces:

* ``tensor_bytes`` / ``local_bytes``: a whole tensor, and the shard one rank holds.
* ``param_state_bytes``: a parameter's local shard, its gradient (same dtype and sharding), and
  the optimizer's state, which follows the parameter's sharding (ZeRO for free) and is kept in
  float32: adam/adamw keep 2 states per element (exp_avg, exp_avg_sq), sgd with momentum 1,
  plain sgd none.
* ``SAVES_INPUTS`` / ``saves_output``: which activations an op keeps for its backward.
  An op in ``SAVES_INPUTS`` keeps its tensor inputs (the activation ones: parameters are alive
  anyway and are counted by ``param_state_bytes``). An op for which ``saves_output`` is true keeps
  its output, because its derivative is written in terms of the result (relu, sigmoid, tanh, exp,
  softmax, ...); dropout is listed there too, since its mask has the output's shape. Ops in
  neither (add, views, sum, ...) keep nothing. This follows ``derivatives.yaml`` roughly and is
  deliberately simple: it ignores small saved statistics (a norm's mean and rstd) and the fact
  that a fused kernel may save less.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autopar.ir.options import parse_optimizer
from autopar.ir.spec import Spec, local_shape
from autopar.trace.moe import EXPERTS_OP

aten = torch.ops.aten

# Optimizer kind (``ir.options.OPTIMIZER_KINDS``) → float32 state tensors kept per parameter element.
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "adamw-amsgrad": 3, "adam-amsgrad": 3, "sgd": 0, "sgd-momentum": 1}


def optimizer_kind(optimizer: str) -> str:
    """The kind of ``optimizer`` as a plan names it (``PlanOptions.optimizer``: ``"adamw"`` or
    ``"adamw:fused"``, the implementation after the colon): its key of ``OPTIMIZER_STATES``."""
    return parse_optimizer(optimizer)[0]


_STATE_DTYPE = torch.float32


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a whole tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize


def local_bytes(shape: Sequence[int], dtype: torch.dtype, spec: Spec, mesh_shape: Sequence[int]) -> int:
    """Bytes of the shard that each rank holds of a ``shape`` tensor placed as ``spec``.

    A Partial tensor is whole on every rank, so only Shard placements divide it."""
    return tensor_bytes(local_shape(shape, spec, mesh_shape), dtype)


def param_state_bytes(
    shape: Sequence[int],
    dtype: torch.dtype,
    spec: Spec,
    mesh_shape: Sequence[int],
    optimizer: str = "adamw",
) -> int:
    """Local parameter + gradient + optimizer state, in bytes on one rank. (ZeRO-1/2 hand plans
    split state and gradients in the liveness walk: ``liveness.build_timeline(zero_stage=)``.)"""
    local = local_shape(shape, spec, mesh_shape)
    param_bytes = tensor_bytes(local, dtype)
    state_bytes = OPTIMIZER_STATES[optimizer_kind(optimizer)] * tensor_bytes(local, _STATE_DTYPE)
    return 2 * param_bytes + state_bytes


def _overloads(*names: str) -> frozenset:
    """Every overload of the named aten ops that exist in this torch build."""
    found = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            found.add(getattr(packet, overload))
    return frozenset(found)


SAVES_INPUTS: frozenset = _overloads(
    # matmul family: each operand's gradient needs the other operand
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "linear",
    "matmul",
    "einsum",
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    # attention: q, k, v (the fused kernels also save their output and logsumexp)
    "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    # products and nonlinear pointwise ops whose derivative needs the input
    "mul",
    "div",
    "pow",
    "gelu",
    "silu",
    "mish",
    "softplus",
    "elu",
    "leaky_relu",
    "hardswish",
    "hardsigmoid",
    "log",
    "log1p",
    "sin",
    "cos",
    "erf",
    "reciprocal",
    "abs",
    "clamp",
    "where",
    "maximum",
    "minimum",
    # norms: the input (and weight) to recompute the normalized value
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "_fused_rms_norm",
    "group_norm",
    "native_group_norm",
    "batch_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_batch_norm_with_update",
    # losses: logits and targets
    "cross_entropy_loss",
    "nll_loss",
    "nll_loss_forward",
    "nll_loss2d_forward",
    "mse_loss",
    "binary_cross_entropy_with_logits",
    # pooling: the input (max pooling also its indices)
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "max_pool2d_with_indices",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "adaptive_avg_pool2d",
    "_adaptive_avg_pool2d",
    # embedding: the indices (the table is a parameter)
    "embedding",
    # reductions whose backward needs the input (the position of the max, the mean)
    "amax",
    "amin",
    "var",
    "std",
    "var_mean",
    "norm",
    "linalg_vector_norm",
    "prod",
) - _overloads("mul", "div").difference(
    # x * scalar and x / scalar need no saved tensor; only the Tensor-by-Tensor forms do
    {aten.mul.Tensor, aten.div.Tensor, aten.div.Tensor_mode}
)

# A mixture-of-experts layer (``trace.moe``) keeps its tokens and routing, and intermediates
# (``internal_saved_factor``).
SAVES_INPUTS = SAVES_INPUTS | {EXPERTS_OP}


def internal_saved_factor(target: Any, kw: dict[str, Any]) -> float:
    """Bytes an op keeps for backward beyond its inputs and output, over its output's bytes.

    A mixture-of-experts layer (``trace.moe``, output [T, H]) keeps, for each of its T·k token
    copies, the copy (H), the gate and up projections, the activation and their product (4·I)
    and the expert output (H), which is k·(2·H + 4·I)/H times its output. This is the mean over
    ranks: under expert parallelism the busiest rank keeps more, and over replicated tokens
    (``moe_experts_local``) each rank keeps only its experts' share, which this overstates."""
    if target is not EXPERTS_OP:
        return 0.0
    top_k = kw["top_k_index"].shape[1]
    gate_up = kw["gate_up"].shape
    hidden = kw["hidden"].shape[1]
    inter = gate_up[1] * gate_up[2] // hidden // 2
    return top_k * (2 * hidden + 4 * inter) / hidden


SAVES_OUTPUT: frozenset = _overloads(
    "relu",
    "sigmoid",
    "tanh",
    "exp",
    "sqrt",
    "rsqrt",
    "_softmax",
    "softmax",
    "_log_softmax",
    "log_softmax",
    "dropout",
    "native_dropout",
)


# Ops kept whole in the graph whose backward materializes an intermediate gradient the size of
# their first input, alive while their backward runs: cross-entropy's backward is nll_loss's
# (a gradient of the log-probabilities, the logits' size), then log_softmax's (another one).
BACKWARD_TEMPORARIES: dict[Any, float] = {op: 1.0 for op in _overloads("cross_entropy_loss")}


def backward_temporary_factor(target: Any) -> float:
    """How many copies of its first input ``target``'s backward keeps as temporaries."""
    return BACKWARD_TEMPORARIES.get(target, 0.0)


def saves_inputs(target: Any) -> bool:
    """True when ``target``'s backward needs its tensor inputs kept."""
    return target in SAVES_INPUTS


def saves_output(target: Any) -> bool:
    """True when ``target``'s backward needs its output kept (see the module docstring)."""
    return target in SAVES_OUTPUT


__all__ = [
    "internal_saved_factor",
    "tensor_bytes",
    "local_bytes",
    "param_state_bytes",
    "OPTIMIZER_STATES",
    "optimizer_kind",
    "SAVES_INPUTS",
    "SAVES_OUTPUT",
    "saves_inputs",
    "saves_output",
    "BACKWARD_TEMPORARIES",
    "backward_temporary_factor",
]
