"""Context parallelism for causal attention: which query rows each rank computes.

The plan keeps a sequence-split activation in the contiguous layout ``S(seq)`` everywhere
(token-wise ops, position embeddings and the loss never see a permutation). The context-parallel
attention kernel (``autopar.ops.attention``) balances the causal work inside itself: on the
innermost of its mesh axes, with ``k`` ranks, it cuts the ranks' region of the sequence into
``2k`` half-chunks and gives rank ``j`` half-chunks ``j`` and ``2k - 1 - j`` (torchtitan's
head-tail, or "zig-zag", order), exchanging query rows before attending and output rows after.
Query row ``t`` then attends keys ``0 .. t``: a chunk of ``n`` rows starting at ``s`` does
``n·s + n(n+1)/2`` score entries, so each rank of a group does the same work.

On the outer kernel axes the ranks' regions stay contiguous (one all-to-all group spans one axis),
so a rank of a later region does more work; ``max_work_fraction`` prices that, and the kernel and
the cost model both read these functions, so what is priced is what runs.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Sequence

Chunk = tuple[int, int]  # (start, length) of global sequence positions


def is_balanced(seq_len: int, group_sizes: Sequence[int]) -> bool:
    """Whether the kernel exchanges rows head-tail: each rank's slice splits into two halves."""
    local = seq_len // math.prod(group_sizes)
    return local % 2 == 0 and group_sizes[-1] > 1


def zigzag_halves(rank: int, size: int) -> tuple[int, int]:
    """The half-chunks (of ``2 * size`` in the group's region) that ``rank`` attends for."""
    return rank, 2 * size - 1 - rank


def query_chunks(seq_len: int, group_sizes: Sequence[int], coords: Sequence[int]) -> tuple[Chunk, ...]:
    """The global positions of the query rows a rank computes, in its local row order.

    ``group_sizes`` and ``coords`` are the kernel's mesh axes, outermost first; the sequence is
    sharded contiguously and nested over them (``spec.shard_tensor``)."""
    if len(group_sizes) != len(coords) or not group_sizes:
        raise ValueError(f"need one coordinate per kernel axis, got sizes {group_sizes} and coords {coords}")
    num = math.prod(group_sizes)
    if seq_len % num:
        raise ValueError(f"sequence of {seq_len} does not split evenly over {num} ranks")
    local = seq_len // num
    index = 0
    for size, coord in zip(group_sizes, coords):
        index = index * size + coord
    if not is_balanced(seq_len, group_sizes):
        return ((index * local, local),)
    inner = group_sizes[-1]
    region = (index - coords[-1]) * local  # start of the inner group's region
    half = local // 2
    return tuple((region + h * half, half) for h in zigzag_halves(coords[-1], inner))


def chunk_work(chunk: Chunk) -> int:
    """Score entries a causal chunk computes: row ``s + i`` attends ``s + i + 1`` keys."""
    start, length = chunk
    return length * start + length * (length + 1) // 2


@functools.lru_cache(maxsize=1024)
def max_work_fraction(seq_len: int, group_sizes: tuple[int, ...]) -> float:
    """The most loaded rank's causal work over the mean rank's (1.0: perfectly balanced)."""
    num = math.prod(group_sizes)
    total = seq_len * (seq_len + 1) // 2
    most = max(
        sum(chunk_work(c) for c in query_chunks(seq_len, group_sizes, coords))
        for coords in itertools.product(*(range(size) for size in group_sizes))
    )
    return most * num / total


__all__ = ["Chunk", "is_balanced", "zigzag_halves", "query_chunks", "chunk_work", "max_work_fraction"]
