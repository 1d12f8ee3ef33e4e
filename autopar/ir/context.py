"""Context parallelism for causal attention: which query rows each rank computes.

The plan keeps a sequence-split activation in the contiguous layout ``S(seq)`` everywhere
(token-wise ops, position embeddings and the loss never see a permutation). The context-parallel
attention kernel (``autopar.ops.attention``) balances the causal work inside itself: over its
``K`` ranks (the product of its mesh axes, nested as ``spec.shard_tensor`` nests them) it cuts the
sequence into ``2K`` half-chunks and gives the rank of flat index ``f`` half-chunks ``f`` and
``2K - 1 - f`` (torchtitan's head-tail, or "zig-zag", order), exchanging query rows before
attending and output rows after. Query row ``t`` attends keys ``0 .. t``: a chunk of ``n`` rows
starting at ``s`` does ``n·s + n(n+1)/2`` score entries, so every rank does the same work.

The exchange runs one all-to-all per mesh axis (``head_tail_route``), innermost first: each
moves every half-chunk to the rank whose coordinate on that axis is its destination's, inside
the process group of that axis, so no group spanning several axes is needed.

When a rank's slice has an odd length there are no halves: the kernel attends the contiguous
split, whose last rank does the most work; ``max_work_fraction`` prices that, and the kernel and
the cost model both read these functions, so what is priced is what runs.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

from autopar.errors import InternalError

Chunk = tuple[int, int]  # (start, length) of global sequence positions


def is_balanced(seq_len: int, group_sizes: Sequence[int]) -> bool:
    """Whether the kernel exchanges rows head-tail: each rank's slice splits into two halves."""
    return (seq_len // math.prod(group_sizes)) % 2 == 0


def zigzag_halves(index: int, num: int) -> tuple[int, int]:
    """The half-chunks (of ``2 * num``) that the rank of flat index ``index`` attends for."""
    return index, 2 * num - 1 - index


def _flat(coords: Sequence[int], group_sizes: Sequence[int]) -> int:
    index = 0
    for size, coord in zip(group_sizes, coords):
        index = index * size + coord
    return index


def _coords(index: int, group_sizes: Sequence[int]) -> tuple[int, ...]:
    coords = []
    for size in reversed(group_sizes):
        index, coord = divmod(index, size)
        coords.append(coord)
    return tuple(reversed(coords))


Pieces = tuple[tuple[int, ...], ...]  # per rank of one group: the half-chunk ids it holds, in order


@functools.lru_cache(maxsize=256)
def head_tail_route(group_sizes: tuple[int, ...]) -> tuple[dict[tuple[int, ...], tuple[int, ...]], ...]:
    """The half-chunks every rank holds before each exchange and after the last: a tuple of
    ``len(group_sizes) + 1`` maps from a rank's coordinates to its half-chunk ids (ascending).

    Stage 0 is the contiguous split (flat rank ``f`` holds ``2f`` and ``2f + 1``); exchange ``i``
    (innermost axis first) moves each half-chunk along axis ``len - 1 - i`` to the rank whose
    coordinate there is its destination's; the last stage is the head-tail layout."""
    num = math.prod(group_sizes)
    dest = {piece: _coords(piece if piece < num else 2 * num - 1 - piece, group_sizes) for piece in range(2 * num)}
    ranks = list(itertools.product(*(range(size) for size in group_sizes)))
    holding = {coords: (2 * _flat(coords, group_sizes), 2 * _flat(coords, group_sizes) + 1) for coords in ranks}
    stages = [holding]
    for axis in reversed(range(len(group_sizes))):
        moved: dict[tuple[int, ...], list[int]] = {coords: [] for coords in ranks}
        for coords, pieces in holding.items():
            for piece in pieces:
                target = coords[:axis] + (dest[piece][axis],) + coords[axis + 1 :]
                moved[target].append(piece)
        holding = {coords: tuple(sorted(pieces)) for coords, pieces in moved.items()}
        stages.append(holding)
    assert all(holding[c] == zigzag_halves(_flat(c, group_sizes), num) for c in ranks)
    return tuple(stages)


def exchange_tables(group_sizes: tuple[int, ...], coords: Sequence[int], step: int) -> tuple[int, Pieces, Pieces]:
    """(axis position, before, after) of exchange ``step`` (0: the innermost axis) for the group
    of that axis holding the rank at ``coords``: per group rank, the half-chunks it holds."""
    stages = head_tail_route(group_sizes)
    axis = len(group_sizes) - 1 - step

    def group(stage: dict) -> Pieces:
        return tuple(stage[tuple(coords[:axis]) + (r,) + tuple(coords[axis + 1 :])] for r in range(group_sizes[axis]))

    return axis, group(stages[step]), group(stages[step + 1])


def query_chunks(seq_len: int, group_sizes: Sequence[int], coords: Sequence[int]) -> tuple[Chunk, ...]:
    """The global positions of the query rows a rank computes, in its local row order.

    ``group_sizes`` and ``coords`` are the kernel's mesh axes, outermost first; the sequence is
    sharded contiguously and nested over them (``spec.shard_tensor``)."""
    if len(group_sizes) != len(coords) or not group_sizes:
        raise InternalError(f"need one coordinate per kernel axis, got sizes {group_sizes} and coords {coords}")
    num = math.prod(group_sizes)
    if seq_len % num:
        raise InternalError(f"sequence of {seq_len} does not split evenly over {num} ranks")
    local = seq_len // num
    index = _flat(coords, group_sizes)
    if not is_balanced(seq_len, group_sizes):
        return ((index * local, local),)
    half = local // 2
    return tuple((h * half, half) for h in zigzag_halves(index, num))


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


__all__ = [
    "Chunk",
    "Pieces",
    "is_balanced",
    "zigzag_halves",
    "head_tail_route",
    "exchange_tables",
    "query_chunks",
    "chunk_work",
    "max_work_fraction",
]
