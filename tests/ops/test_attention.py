"""The context-parallel attention kernel's math, per simulated rank, against eager attention.

Each simulated rank takes the query rows that ``ir.context.query_chunks`` gives it (head-tail over
all its axes), attends them to the whole K/V (what the all-gather gives), and the ranks'
K/V gradients are summed (what the backward reduce-scatter does). Real collectives are covered by
the gloo test in ``tests/runtime/test_context_parallel.py`` and the numerics guard below.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from autopar.ir.context import chunk_work, exchange_tables, is_balanced, max_work_fraction, query_chunks
from autopar.ops import get_kernel
from autopar.ops.attention import attend_chunks


def _rows(x: torch.Tensor, chunks) -> torch.Tensor:
    return torch.cat([x.narrow(-2, start, length) for start, length in chunks], -2)


@pytest.mark.parametrize("group_sizes", [(4,), (3,), (2, 2), (2, 3)])
@pytest.mark.parametrize("heads", [(4, 4, False), (4, 2, True), (6, 1, True)])
def test_simulated_ranks_equal_eager(group_sizes, heads):
    num_heads, kv_heads, gqa = heads
    seq = 24 * math.prod(group_sizes) // 2
    torch.manual_seed(0)
    q = torch.randn(2, num_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, num_heads, seq, 8, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=gqa)
    (ref * weight).sum().backward()

    out = torch.zeros_like(ref)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    covered = torch.zeros(seq, dtype=torch.int64)
    for coords in itertools.product(*(range(s) for s in group_sizes)):
        chunks = query_chunks(seq, group_sizes, coords)
        local_q = _rows(q, chunks).detach().requires_grad_()
        whole_k, whole_v = k.detach().clone().requires_grad_(), v.detach().clone().requires_grad_()
        local = attend_chunks(local_q, whole_k, whole_v, chunks, scale=0.3, enable_gqa=gqa)
        (local * _rows(weight, chunks)).sum().backward()
        row = 0
        for start, length in chunks:
            out[..., start : start + length, :] = local[..., row : row + length, :].detach()
            grads[0][..., start : start + length, :] = local_q.grad[..., row : row + length, :]
            covered[start : start + length] += 1
            row += length
        grads[1] += whole_k.grad  # the reduce-scatter's sum
        grads[2] += whole_v.grad
    assert covered.eq(1).all(), "every query row is computed by exactly one rank"
    torch.testing.assert_close(out, ref.detach())
    for got, want, name in zip(grads, (q.grad, k.grad, v.grad), "qkv"):
        torch.testing.assert_close(got, want, msg=lambda m, name=name: f"d{name}: {m}")


def test_head_tail_chunks_balance_the_causal_work():
    # 4 ranks, 16 positions: half-chunks of 2; rank 0 holds the first and the last.
    assert query_chunks(16, (4,), (0,)) == ((0, 2), (14, 2))
    assert query_chunks(16, (4,), (3,)) == ((6, 2), (8, 2))
    work = {sum(chunk_work(c) for c in query_chunks(64, (4,), (r,))) for r in range(4)}
    assert len(work) == 1, work
    assert max_work_fraction(131072, (8,)) == 1.0
    # Odd local length: no halves, the contiguous split, whose last rank does (2k-1)/k of the mean.
    assert not is_balanced(12, (4,))
    assert query_chunks(12, (4,), (3,)) == ((9, 3),)
    assert max_work_fraction(12, (4,)) == pytest.approx((9 * 3 + 6) * 4 / 78)
    # Several axes: head-tail over all their ranks together.
    assert query_chunks(32, (2, 2), (1, 0)) == ((8, 4), (20, 4))
    for sizes in ((2, 4), (8, 8), (3, 2), (2, 3, 2)):
        assert max_work_fraction(2 * 4 * math.prod(sizes), sizes) == 1.0, sizes


@pytest.mark.parametrize("group_sizes", [(4,), (3,), (2, 2), (2, 3), (3, 2), (2, 3, 2)])
def test_head_tail_route_moves_every_piece_to_its_rank(group_sizes):
    """Replaying the per-axis exchanges (as ``collectives.move_pieces`` runs them, group by
    group) takes the contiguous layout to the head-tail one, and each exchange stays inside the
    group of its axis."""
    num = math.prod(group_sizes)
    ranks = list(itertools.product(*(range(s) for s in group_sizes)))
    holding = {c: (2 * i, 2 * i + 1) for i, c in enumerate(ranks)}  # ranks in nested (flat) order
    for step in range(len(group_sizes)):
        after = {}
        for coords in ranks:
            axis, before, dest = exchange_tables(group_sizes, coords, step)
            assert before[coords[axis]] == holding[coords]
            group = {tuple(coords[:axis]) + (r,) + tuple(coords[axis + 1 :]) for r in range(group_sizes[axis])}
            assert sorted(p for c in group for p in holding[c]) == sorted(p for pieces in dest for p in pieces)
            after[coords] = dest[coords[axis]]
        holding = after
    for _index, coords in enumerate(ranks):
        chunks = query_chunks(2 * num, group_sizes, coords)
        assert holding[coords] == tuple(start for start, _ in chunks), (coords, holding[coords], chunks)


def test_kernel_without_groups_is_the_op():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    got = get_kernel("sdpa_context_parallel")(axis_groups=(), query=q, key=k, value=v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
