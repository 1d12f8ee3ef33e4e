"""Context-parallel causal attention: ``scaled_dot_product_attention(is_causal=True)`` with the
query, key and value all split along the sequence on the kernel's mesh axes.

Each rank all-gathers K and V along the sequence (innermost axis first, so the nested shards
come back in order), and attends its own query rows to the keys their causal mask needs: a
chunk of rows at global positions ``s .. s+n`` reads keys ``0 .. s+n`` under a lower-right
causal mask (``torch.nn.attention.bias.causal_lower_right``), so blocks past the diagonal are
never computed. The query rows are first exchanged into head-tail order (``autopar.ir.context``:
one all-to-all per mesh axis): over ``K`` ranks the rank of flat index ``f`` attends half-chunks
``f`` and ``2K-1-f``, so all do the same causal work; the output rows go back to the contiguous
layout the rest of the plan uses.

Under the replicated-loss convention (``collectives``) a rank's gradient for the gathered K/V
holds only its own queries' contributions, so backward reduce-scatters it along the sequence.
The kernel saves only its local q, k and v and gathers K/V again in backward (as activation
checkpointing of the gather would), so it keeps no whole-sequence K/V alive between forward
and backward. That recomputation is why the rule offers the kernel only without dropout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from autopar.errors import InternalError
from autopar.ir.context import Chunk, exchange_tables, is_balanced, query_chunks
from autopar.ops import collectives
from autopar.ops.kernels import register_kernel

aten = torch.ops.aten


def attend_chunks(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunks: Sequence[Chunk],
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal attention of query rows whose global positions are ``chunks`` (in row order along
    dim -2) over the whole-sequence ``key`` and ``value``: row at position ``t`` attends keys
    ``0 .. t``. The kernel's math on one rank; tests call it per simulated rank."""
    outs, row = [], 0
    for start, length in chunks:
        end = start + length
        rows = query.narrow(-2, row, length)
        outs.append(
            F.scaled_dot_product_attention(
                rows,
                key.narrow(-2, 0, end),
                value.narrow(-2, 0, end),
                attn_mask=causal_lower_right(length, end),
                scale=scale,
                enable_gqa=enable_gqa,
            )
        )
        row += length
    return outs[0] if len(outs) == 1 else torch.cat(outs, -2)


def _gather_sequence(x: torch.Tensor, groups: Sequence[str]) -> torch.Tensor:
    for group in reversed(groups):  # innermost first: nested shards come back in order
        x = collectives.no_grad_all_gather(x, x.ndim - 2, group)
    return x


def _scatter_sequence(x: torch.Tensor, groups: Sequence[str]) -> torch.Tensor:
    for group in groups:  # outermost first: the inverse nesting of ``_gather_sequence``
        x = collectives.no_grad_reduce_scatter(x, x.ndim - 2, group)
    return x


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, groups, chunks, scale, enable_gqa):
        ctx.groups, ctx.chunks, ctx.scale, ctx.enable_gqa = groups, chunks, scale, enable_gqa
        ctx.save_for_backward(query, key, value)
        with torch.no_grad():
            whole_key, whole_value = _gather_sequence(key, groups), _gather_sequence(value, groups)
            return attend_chunks(query, whole_key, whole_value, chunks, scale, enable_gqa)

    @staticmethod
    def backward(ctx, grad):
        collectives.refuse_double_backward(grad, saves_inputs=True)  # recomputed on detached inputs
        query, key, value = ctx.saved_tensors
        with torch.no_grad():
            whole_key, whole_value = _gather_sequence(key, ctx.groups), _gather_sequence(value, ctx.groups)
        with torch.enable_grad():
            inputs = tuple(t.detach().requires_grad_() for t in (query, whole_key, whole_value))
            out = attend_chunks(*inputs, ctx.chunks, ctx.scale, ctx.enable_gqa)
            grad_query, grad_key, grad_value = torch.autograd.grad(out, inputs, grad)
        return (
            grad_query,
            _scatter_sequence(grad_key, ctx.groups),
            _scatter_sequence(grad_value, ctx.groups),
            None,
            None,
            None,
            None,
        )


@register_kernel("sdpa_context_parallel")
def sdpa_context_parallel(
    *,
    axis_groups: Sequence[str],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **_: Any,
) -> torch.Tensor:
    """Causal self-attention with q, k and v split along the sequence (dim -2) on ``axis_groups``
    (outermost first); the output is split the same way, in the contiguous layout."""
    if not axis_groups:
        return aten.scaled_dot_product_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if not is_causal or attn_mask is not None or dropout_p:
        raise InternalError(
            "sdpa_context_parallel runs causal self-attention without an explicit mask or dropout, got "
            f"is_causal={is_causal}, attn_mask={'a tensor' if attn_mask is not None else None}, "
            f"dropout_p={dropout_p}: re-plan (the rule offers this kernel only for that case)"
        )
    sizes = tuple(collectives.group_size(g) for g in axis_groups)
    coords = tuple(collectives.group_rank(g) for g in axis_groups)
    seq_len = query.shape[-2] * math.prod(sizes)
    chunks = query_chunks(seq_len, sizes, coords)
    groups = tuple(axis_groups)
    if not is_balanced(seq_len, sizes):
        return _ContextParallelAttention.apply(query, key, value, groups, chunks, scale, enable_gqa)
    half, dim = query.shape[-2] // 2, query.ndim - 2
    for step in range(len(groups)):  # innermost axis first (``ir.context.head_tail_route``)
        axis, before, after = exchange_tables(sizes, coords, step)
        query = collectives.move_pieces(query, dim, groups[axis], before, after, half)
    out = _ContextParallelAttention.apply(query, key, value, groups, chunks, scale, enable_gqa)
    for step in reversed(range(len(groups))):
        axis, before, after = exchange_tables(sizes, coords, step)
        out = collectives.move_pieces(out, dim, groups[axis], after, before, half)
    return out
