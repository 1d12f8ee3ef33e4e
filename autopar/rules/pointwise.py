"""Sharding rules for pointwise ops, as tables grouped by algebraic property.

Every pointwise op may shard any output dim: an input that has that dim at full size is sharded
along it, and an input broadcast along it (size 1, or the dim missing) stays replicated
(``shard_rows``). The tables differ only in how Partial passes: a map that is linear in its
Partial operands keeps the output Partial, anything else never takes Partial.

In-place variants (``add_``, ``mul_``, ...) get the rows of their functional op that leave
``self`` where it is: the output is written into ``self``'s buffer, so its placement must be
``self``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from autopar.errors import InternalError
from autopar.ir.spec import P, Placement, R, S
from autopar.rules.registry import OpInfo, Row, TensorArg, register, replicate_row

aten = torch.ops.aten


# --------------------------------------------------------------------------------------------
# Shared helpers (also used by matmul, reductions and nn_ops)


def broadcast_shard(arg: TensorArg, out_shape: Sequence[int], out_dim: int) -> Placement:
    """The placement of ``arg`` when output dim ``out_dim`` is sharded: the aligned dim of
    ``arg`` (numpy broadcasting aligns trailing dims) if it has the full size, else R."""
    dim = out_dim - (len(out_shape) - arg.ndim)
    if dim >= 0 and arg.shape[dim] == out_shape[out_dim]:
        return S(dim)
    return R


def out_placement(info: OpInfo, placement: Placement) -> Placement | tuple[Placement, ...]:
    """``placement`` for every output of the op (a tuple for tuple-returning ops)."""
    if info.out_is_tuple:
        return (placement,) * len(info.out_shapes)
    return placement


def row_by_name(info: OpInfo, placements: dict[str, Placement], out: Any) -> Row:
    """A row from placements of named tensor arguments; unnamed tensor inputs are R."""
    ins: list[Placement] = [R] * len(info.inputs)
    for name, placement in placements.items():
        arg = info.kw.get(name)
        if not isinstance(arg, TensorArg):
            raise InternalError(f"{name!r} is not a tensor argument of {info.describe()}")
        ins[arg.index] = placement
    return Row(tuple(ins), out)


def is_tensor(info: OpInfo, name: str) -> bool:
    return isinstance(info.kw.get(name), TensorArg)


def shard_rows(info: OpInfo) -> list[Row]:
    """The all-R row, and one row per output dim with inputs sharded or broadcast along it."""
    rows = [replicate_row(info)]
    if not info.out_shapes:
        return rows
    out_shape = info.out_shape
    for out_dim in range(len(out_shape)):
        ins = tuple(broadcast_shard(arg, out_shape, out_dim) for arg in info.inputs)
        rows.append(Row(ins, out_placement(info, S(out_dim))))
    return rows


def _same_named_inplace(ops: Iterable[Any]) -> list[Any]:
    """``aten.add_.Tensor`` for ``aten.add.Tensor``, where such an overload exists."""
    found = []
    for op in ops:
        packet = getattr(aten, op._schema.name.split("::")[1] + "_", None)
        overload = getattr(packet, op._overloadname, None) if packet is not None else None
        if overload is not None:
            found.append(overload)
    return found


def _pointwise(functional: Sequence[Any], extra_inplace: Sequence[Any] = ()) -> Callable:
    """Register a rule for ``functional`` ops and their in-place variants."""
    inplace = set(_same_named_inplace(functional)) | set(extra_inplace)

    def wrap(partial_rows: Callable[[OpInfo], list[Row]]) -> Callable[[OpInfo], list[Row]]:
        def rule(info: OpInfo) -> list[Row]:
            rows = shard_rows(info) + partial_rows(info)
            if info.target in inplace:
                rows = [row for row in rows if row.outs[0] == row.ins[0]]
            return rows

        rule.__name__ = rule.__qualname__ = partial_rows.__name__
        register(*functional, *sorted(inplace, key=str))(rule)
        return rule

    return wrap


# --------------------------------------------------------------------------------------------
# The tables

# Nonlinear (or affine, like x + 1) in the tensor input, so Partial never passes.
UNARY_NONLINEAR = (
    aten.relu.default,
    aten.gelu.default,
    aten.silu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.exp.default,
    aten.exp2.default,
    aten.expm1.default,
    aten.log.default,
    aten.log1p.default,
    aten.log2.default,
    aten.log10.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.abs.default,
    aten.sin.default,
    aten.cos.default,
    aten.tan.default,
    aten.asin.default,
    aten.acos.default,
    aten.atan.default,
    aten.sinh.default,
    aten.cosh.default,
    aten.asinh.default,
    aten.acosh.default,
    aten.atanh.default,
    aten.erf.default,
    aten.erfc.default,
    aten.erfinv.default,
    aten.reciprocal.default,
    aten.sign.default,
    aten.sgn.default,
    aten.signbit.default,
    aten.floor.default,
    aten.ceil.default,
    aten.round.default,
    aten.round.decimals,
    aten.trunc.default,
    aten.frac.default,
    aten.square.default,
    aten.mish.default,
    aten.hardswish.default,
    aten.hardsigmoid.default,
    aten.hardtanh.default,
    aten.leaky_relu.default,
    aten.elu.default,
    aten.celu.default,
    aten.selu.default,
    aten.softplus.default,
    aten.logit.default,
    aten.relu6.default,
    aten.threshold.default,
    aten.hardshrink.default,
    aten.softshrink.default,
    aten.lgamma.default,
    aten.digamma.default,
    aten.nan_to_num.default,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten.isnan.default,
    aten.isinf.default,
    aten.isfinite.default,
    aten.pow.Tensor_Scalar,
    aten.clamp.default,
    aten.clamp_min.default,
    aten.clamp_max.default,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.rsub.Scalar,
    aten.div.Scalar_mode,
    aten.fmod.Scalar,
    aten.remainder.Scalar,
    aten.floor_divide.Scalar,
    aten.xlogy.Scalar_Other,
    aten.float_power.Tensor_Scalar,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.lt.Scalar,
    aten.le.Scalar,
    aten.gt.Scalar,
    aten.ge.Scalar,
    aten.bitwise_and.Scalar,
    aten.bitwise_or.Scalar,
    aten.bitwise_xor.Scalar,
)

# Nonlinear in the pair of tensor inputs (products, comparisons, extrema), so no Partial.
BINARY_NONLINEAR = (
    aten.pow.Tensor_Tensor,
    aten.pow.Scalar,
    aten.maximum.default,
    aten.minimum.default,
    aten.atan2.default,
    aten.hypot.default,
    aten.fmod.Tensor,
    aten.remainder.Tensor,
    aten.div.Tensor_mode,
    aten.floor_divide.default,
    aten.xlogy.Tensor,
    aten.float_power.Tensor_Tensor,
    aten.clamp.Tensor,
    aten.clamp_min.Tensor,
    aten.clamp_max.Tensor,
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.lt.Tensor,
    aten.le.Tensor,
    aten.gt.Tensor,
    aten.ge.Tensor,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_xor.default,
    aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor,
    aten.bitwise_xor.Tensor,
    aten.masked_fill.Tensor,
    aten.lerp.Scalar,
    aten.lerp.Tensor,
    aten.__and__.Tensor,
    aten.__or__.Tensor,
    aten.__xor__.Tensor,
)

# Copies or sign flips of the input: linear, so Partial passes (P → P).
UNARY_LINEAR = (
    aten.neg.default,
    aten.positive.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.contiguous.default,
    aten.lift_fresh_copy.default,
)

# Dtype casts: linear between floating dtypes (rounding aside); a cast to an integer or bool
# truncates each rank's summand, so Partial passes only into a floating dtype.
CASTS = (aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device)

# Sum or difference of two tensors: linear in the pair, so P ± P → P (P ± R would add R k times).
ADDITIVE = (aten.add.Tensor, aten.sub.Tensor, aten.rsub.Tensor)

# Scaling by a python number: linear, so P → P.
SCALED = (aten.mul.Scalar, aten.div.Scalar)

# Product: linear in each factor alone, so P * R → P and R * P → P (never P * P).
MULTIPLICATIVE = (aten.mul.Tensor,)

# Quotient: linear in the numerator only, so P / R → P.
DIVIDING = (aten.div.Tensor,)

# Selection between two tensors by a fixed condition: linear in the pair, so where(R, P, P) → P.
SELECTING = (aten.where.self,)

# Replacing masked positions by a scalar: linear only when that scalar is 0 (else each rank
# would contribute it once).
SCALAR_FILL = (aten.where.ScalarOther, aten.where.ScalarSelf, aten.masked_fill.Scalar)

# self + value * t1 * t2 (or t1 / t2): linear in (self, one factor) jointly.
FUSED_MULTIPLY_ADD = (aten.addcmul.default, aten.addcdiv.default)

# The result overwrites self with src: linear in src (P → P when self and src are both P).
COPYING = (aten.copy.default,)

# Values come from the shape only (constants, or RNG draws): a chunk of the result is the
# result on the chunk, so S and R pass; Partial never (ones_like of P sums to k).
# rand_like / randn_like draw per rank, so their values are not bitwise equal to eager's.
LIKE = (
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
    aten.fill.Scalar,
    aten.zero.default,
)


@_pointwise(UNARY_NONLINEAR + BINARY_NONLINEAR, extra_inplace=(aten.pow_.Scalar, aten.pow_.Tensor))
def nonlinear_rule(info: OpInfo) -> list[Row]:
    return []


@_pointwise(UNARY_LINEAR, extra_inplace=(aten.neg_.default, aten.detach_.default))
def unary_linear_rule(info: OpInfo) -> list[Row]:
    return [Row((P,), P)]


@_pointwise(CASTS)
def cast_rule(info: OpInfo) -> list[Row]:
    src = info.inputs[0].dtype
    dst = info.kw.get("dtype") or src
    if dst.is_floating_point and (src.is_floating_point or src == dst):
        return [Row((P,), P)]
    if dst == src and not src.is_complex and src != torch.bool:
        return [Row((P,), P)]
    return []


@_pointwise(ADDITIVE)
def additive_rule(info: OpInfo) -> list[Row]:
    if is_tensor(info, "self") and is_tensor(info, "other"):
        return [Row((P, P), P)]
    return []


@_pointwise(SCALED)
def scaled_rule(info: OpInfo) -> list[Row]:
    return [Row((P,), P)]


@_pointwise(MULTIPLICATIVE)
def multiplicative_rule(info: OpInfo) -> list[Row]:
    if not is_tensor(info, "other"):
        return [Row((P,), P)]
    return [Row((P, R), P), Row((R, P), P)]


@_pointwise(DIVIDING)
def dividing_rule(info: OpInfo) -> list[Row]:
    if not is_tensor(info, "other"):
        return [Row((P,), P)]
    return [Row((P, R), P)]


@_pointwise(SELECTING)
def selecting_rule(info: OpInfo) -> list[Row]:
    return [row_by_name(info, {"condition": R, "self": P, "other": P}, P)]


@_pointwise(SCALAR_FILL)
def scalar_fill_rule(info: OpInfo) -> list[Row]:
    if info.target is aten.masked_fill.Scalar:
        value, filled = info.kw["value"], "self"
    elif info.target is aten.where.ScalarOther:
        value, filled = info.kw["other"], "self"
    else:
        value, filled = info.kw["self"], "other"
    if isinstance(value, (int, float, bool)) and value == 0:
        return [row_by_name(info, {filled: P}, P)]
    return []


@_pointwise(FUSED_MULTIPLY_ADD)
def fused_multiply_add_rule(info: OpInfo) -> list[Row]:
    rows = [row_by_name(info, {"self": P, "tensor1": P}, P)]
    if info.target is aten.addcmul.default:
        rows.append(row_by_name(info, {"self": P, "tensor2": P}, P))
    return rows


@_pointwise(COPYING, extra_inplace=(aten.copy_.default,))
def copying_rule(info: OpInfo) -> list[Row]:
    return [row_by_name(info, {"self": P, "src": P}, P)]


@_pointwise(LIKE, extra_inplace=(aten.fill_.Scalar, aten.zero_.default))
def like_rule(info: OpInfo) -> list[Row]:
    return []


# Zeroing the entries above or below a diagonal of the last two dims: a fixed mask, so linear
# (P → P); those two dims hold the positions the mask depends on, so only leading dims shard.
POSITIONAL_MASK = (aten.triu.default, aten.tril.default)


@register(*POSITIONAL_MASK, aten.triu_.default, aten.tril_.default)
def positional_mask_rule(info: OpInfo) -> list[Row]:
    ndim = info.inputs[0].ndim
    return [replicate_row(info)] + [Row((S(d),), S(d)) for d in range(ndim - 2)] + [Row((P,), P)]


@register(aten.type_as.default)
def type_as_rule(info: OpInfo) -> list[Row]:
    """``self`` cast to ``other``'s dtype: ``other`` gives only its dtype, so it may stay R or
    keep ``self``'s placement when the shapes match (no gather just to read a dtype)."""
    self_arg, other = info.kw["self"], info.kw["other"]
    src, dst = self_arg.dtype, other.dtype
    placements = [R] + [S(d) for d in range(self_arg.ndim)]
    if dst.is_floating_point and (src.is_floating_point or src == dst):
        placements.append(P)
    rows = []
    for placement in placements:
        rows.append(Row((placement, R), placement))
        if other.shape == self_arg.shape:
            rows.append(Row((placement, placement), placement))
    return rows


@register(aten._assert_tensor_metadata.default)
def assert_metadata_rule(info: OpInfo) -> list[Row]:
    """A metadata check with no output. Dtype, device and layout hold for any shard; a size or
    stride check would see the local shape, so then only R."""
    if info.kw.get("size") is not None or info.kw.get("stride") is not None:
        return [Row((R,), ())]
    arg = info.inputs[0]
    return [Row((placement,), ()) for placement in [R, P] + [S(d) for d in range(arg.ndim)]]


__all__ = [
    "broadcast_shard",
    "out_placement",
    "row_by_name",
    "is_tensor",
    "shard_rows",
]
