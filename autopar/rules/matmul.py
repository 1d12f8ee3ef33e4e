"""Sharding rules for the matmul family: mm, bmm, addmm, linear, matmul, baddbmm, outer.

Each row is Megatron's algebra on one mesh axis: shard the rows of the left operand (output
rows sharded), shard the columns of the right operand (output columns sharded), or shard the
contracted dim of both (every rank holds a partial sum of the output). ``linear`` and ``addmm``
also shard the output columns by blocks (``spec.SS``), for fused projections.
"""

from __future__ import annotations

import torch

from autopar.ir.spec import SS, P, R, S
from autopar.rules.pointwise import broadcast_shard, is_tensor
from autopar.rules.registry import OpInfo, Row, TensorArg, register, replicate_row, strided_blocks

aten = torch.ops.aten


@register(aten.mm.default)
def mm_rule(info: OpInfo) -> list[Row]:
    # a[M, K] @ b[K, N]
    return [
        Row((R, R), R),
        Row((S(0), R), S(0)),
        Row((R, S(1)), S(1)),
        Row((S(1), S(0)), P),
        Row((P, R), P),
        Row((R, P), P),
    ]


@register(aten.bmm.default)
def bmm_rule(info: OpInfo) -> list[Row]:
    # a[B, M, K] @ b[B, K, N]
    return [
        Row((R, R), R),
        Row((S(0), S(0)), S(0)),
        Row((S(1), R), S(1)),
        Row((R, S(2)), S(2)),
        Row((S(2), S(1)), P),
        Row((P, R), P),
        Row((R, P), P),
    ]


@register(aten.outer.default)
def outer_rule(info: OpInfo) -> list[Row]:
    # a[M] outer b[N] -> [M, N]; linear in each operand alone
    return [Row((R, R), R), Row((S(0), R), S(0)), Row((R, S(0)), S(1)), Row((P, R), P), Row((R, P), P)]


@register(aten.addmm.default)
def addmm_rule(info: OpInfo) -> list[Row]:
    # beta * bias + alpha * (a[M, K] @ b[K, N]); bias broadcasts to [M, N]
    bias = info.kw["self"]
    out_shape = info.out_shape
    return [
        Row((R, R, R), R),
        Row((broadcast_shard(bias, out_shape, 0), S(0), R), S(0)),
        Row((broadcast_shard(bias, out_shape, 1), R, S(1)), S(1)),
        *(Row((_strided_bias(bias, out_shape, n), R, SS(1, n)), SS(1, n)) for n in strided_blocks()),
        # Each rank adds beta * bias / k, so the partial sums add up to the biased result; the
        # bias gradient comes out whole on every rank (kernels.ops._ShareBias).
        Row((R, S(1), S(0)), P, kernel="addmm_bias_split", whole_grad=(0,)),
        Row((P, S(1), S(0)), P),
        Row((P, P, R), P),
        Row((P, R, P), P),
    ]


def _strided_bias(bias: TensorArg, out_shape, blocks: int):
    """The bias of a block-strided addmm: strided like the output columns, R if broadcast."""
    placement = broadcast_shard(bias, out_shape, 1)
    return SS(placement.dim, blocks) if placement != R else R


@register(aten.linear.default)
def linear_rule(info: OpInfo) -> list[Row]:
    # x[..., K] @ weight[N, K]^T + bias[N]
    x, weight = info.kw["input"], info.kw["weight"]
    has_bias = is_tensor(info, "bias")
    if weight.ndim != 2 or x.ndim < 1:
        return [replicate_row(info)]
    out_last = info.out_ndim - 1

    def row(x_p, w_p, b_p, out, kernel=None) -> Row:
        whole = (2,) if kernel else ()  # the bias-split kernel leaves the bias gradient whole
        return Row((x_p, w_p, b_p) if has_bias else (x_p, w_p), out, kernel, whole)

    rows = [row(R, R, R, R)]
    rows += [row(S(d), R, R, S(d)) for d in range(x.ndim - 1)]  # data parallel / sequence
    rows.append(row(R, S(0), S(0), S(out_last)))  # column parallel
    # Column parallel by blocks: a fused projection cut so that each rank holds its chunk of
    # every block (its own heads' q, k and v); the output columns come out in the same layout.
    rows += [row(R, SS(0, n), SS(0, n), SS(out_last, n)) for n in strided_blocks()]
    # Row parallel: each rank holds a partial sum; a bias is added as bias / k on each rank.
    rows.append(row(S(x.ndim - 1), S(1), R, P, "linear_bias_split" if has_bias else None))
    rows.append(row(S(x.ndim - 1), S(1), P, P))
    rows.append(row(P, R, P, P))
    rows.append(row(R, P, P, P))
    return rows


def _batched_matmul_rows(info: OpInfo, a: TensorArg, b: TensorArg, bias: TensorArg | None = None) -> list[Row]:
    """Rows for a[..., M, K] @ b[..., K, N] with broadcast batch dims (both at least 2-D).

    ``bias`` (an optional TensorArg, placed first) broadcasts to the output; the K-sharded
    row is only offered when the bias is Partial too, since R would be added k times."""
    out_shape = info.out_shape
    out_ndim = len(out_shape)

    def row(bias_p, a_p, b_p, out) -> Row:
        return Row(((bias_p,) if bias is not None else ()) + (a_p, b_p), out)

    rows = [row(R, R, R, R)]
    for out_dim in range(out_ndim - 2):
        a_p = broadcast_shard(a, out_shape, out_dim)
        b_p = broadcast_shard(b, out_shape, out_dim)
        bias_p = broadcast_shard(bias, out_shape, out_dim) if bias is not None else R
        rows.append(row(bias_p, a_p, b_p, S(out_dim)))
    m_bias = broadcast_shard(bias, out_shape, out_ndim - 2) if bias is not None else R
    n_bias = broadcast_shard(bias, out_shape, out_ndim - 1) if bias is not None else R
    rows.append(row(m_bias, S(a.ndim - 2), R, S(out_ndim - 2)))
    rows.append(row(n_bias, R, S(b.ndim - 1), S(out_ndim - 1)))
    if bias is None:
        rows.append(row(R, S(a.ndim - 1), S(b.ndim - 2), P))
        rows.append(row(R, P, R, P))
        rows.append(row(R, R, P, P))
    else:
        rows.append(row(P, S(a.ndim - 1), S(b.ndim - 2), P))
        rows.append(row(P, P, R, P))
        rows.append(row(P, R, P, P))
    return rows


@register(aten.matmul.default)
def matmul_rule(info: OpInfo) -> list[Row]:
    a, b = info.kw["self"], info.kw["other"]
    if a.ndim < 2 or b.ndim < 2:
        # Vector operands squeeze dims out of the result; linear in each operand alone.
        return [Row((R, R), R), Row((P, R), P), Row((R, P), P)]
    return _batched_matmul_rows(info, a, b)


@register(aten.baddbmm.default)
def baddbmm_rule(info: OpInfo) -> list[Row]:
    # beta * bias + alpha * (a[B, M, K] @ b[B, K, N]); bias broadcasts to [B, M, N]
    return _batched_matmul_rows(info, info.kw["batch1"], info.kw["batch2"], bias=info.kw["self"])
