"""A small model of PyTorch's CUDA caching allocator: what ``torch.cuda.max_memory_reserved``
reports for a sequence of allocations and frees, beside ``max_memory_allocated``.

The rules, as ``c10/cuda/CUDACachingAllocator.cpp`` states them (facts, not its code):

* every request is rounded up to a multiple of 512 bytes (``MIN_BLOCK``);
* requests of at most 1 MiB (``SMALL_SIZE``) come from the small pool, the others from the
  large pool; each pool is kept per CUDA stream, and a block freed on one stream is reused only
  by requests on that stream;
* a request takes the smallest cached free block of its stream and pool that holds it (ties:
  the lower address); the rest of that block is split off as a free block where it is at least
  512 bytes (small pool) or more than 1 MiB (large pool), else the request keeps the whole block
  (and ``allocated`` counts all of it);
* where no cached block fits, a new segment is reserved: 2 MiB for a small request, 20 MiB for
  one under 10 MiB, else the request rounded up to 2 MiB;
* a freed block returns to the cache and merges with free neighbours of its own segment,
  never across segments; nothing is given back to the device (no ``empty_cache``);
* where a new segment would not fit the device (``capacity``), the allocator first gives back
  every cached segment that holds no live block and tries again (``num_alloc_retries``); only
  what is still short is an out-of-memory error (``num_ooms``; the model goes on, over).

With ``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) each stream
and pool has one segment that grows at its end in pages (2 MiB small, 20 MiB large) where no
free block fits, and every split leaves a free block of 512 bytes or more; giving back memory unmaps the free pages at its end (torch
also unmaps whole free pages inside it: the model's OOMs err on the safe side).

``reserved`` is the bytes of all segments (mapped pages, when expandable); ``allocated`` the
bytes of blocks in use, rounded as above. Both are peaks over the whole sequence.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

from autopar.errors import InternalError

MIN_BLOCK = 512  # every block is a multiple of it
SMALL_SIZE = 2**20  # the largest request of the small pool
SMALL_SEGMENT = 2 * 2**20  # a small pool's segment (and an expandable small pool's page)
LARGE_SEGMENT = 20 * 2**20  # a segment for a request under MIN_LARGE_ALLOC (and a large page)
MIN_LARGE_ALLOC = 10 * 2**20
ROUND_LARGE = 2 * 2**20  # larger requests get a segment of their size rounded up to this


def round_size(size: int) -> int:
    """Bytes of the block a request of ``size`` bytes takes (before any unsplit remainder)."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """Bytes of the segment reserved for a rounded request of ``size`` bytes no cached block holds."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(frozen=True, slots=True)
class AllocatorPeak:
    """Peaks of one simulated sequence, in bytes: ``allocated`` (``max_memory_allocated``),
    ``reserved`` (``max_memory_reserved``), and the reserved bytes of each stream at the end."""

    allocated: int
    reserved: int
    reserved_by_stream: Mapping[str, int] = field(default_factory=dict)
    num_alloc_retries: int = 0  # times the cache was given back to fit a segment
    num_ooms: int = 0  # requests that did not fit even then
    short: int = 0  # the most bytes one of those lacked

    def __post_init__(self) -> None:
        if not 0 <= self.allocated <= self.reserved:
            raise InternalError(f"allocated {self.allocated} must be within reserved {self.reserved}")


class _Block:
    """One block of a segment: ``offset`` and ``size`` in bytes; neighbours in address order."""

    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment: int, offset: int, size: int) -> None:
        self.segment, self.offset, self.size = segment, offset, size
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        # best fit: the smallest block, then the lowest address (segments in order of reservation)
        return (self.size, self.segment, self.offset)


class _Pool:
    """The cached free blocks of one (stream, pool), sorted for best fit, and its expandable
    segment's end where there is one."""

    __slots__ = ("free", "blocks", "tail")

    def __init__(self) -> None:
        self.free: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], _Block] = {}
        self.tail: _Block | None = None  # the last block of an expandable segment

    def add(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self.free, key)
        self.blocks[key] = block

    def remove(self, block: _Block) -> None:
        key = block.key()
        del self.free[bisect.bisect_left(self.free, key)]
        del self.blocks[key]

    def best_fit(self, size: int) -> _Block | None:
        index = bisect.bisect_left(self.free, (size, -1, -1))
        return self.blocks[self.free[index]] if index < len(self.free) else None


class CachingAllocator:
    """The allocator of the module docstring over named tensors: ``malloc(key, bytes, stream)``
    and ``free(key)``; ``peak()`` reads the peaks so far."""

    def __init__(self, expandable_segments: bool = False, capacity: float = math.inf) -> None:
        self.expandable = expandable_segments
        self.capacity = capacity
        self.num_alloc_retries = self.num_ooms = self.short = 0
        self._pools: dict[tuple[str, bool], _Pool] = {}
        self._live: dict[Hashable, tuple[_Block, tuple[str, bool]]] = {}
        self._segments = itertools.count()
        self._reserved_by_stream: dict[str, int] = {}
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    def malloc(self, key: Hashable, size: float, stream: str = "compute") -> None:
        """Allocate ``size`` bytes for ``key`` on ``stream`` (0 bytes: nothing, as CUDA's)."""
        if key in self._live:
            raise InternalError(f"{key!r} is allocated twice")
        if size <= 0:
            return
        rounded = round_size(int(-(-size // 1)))
        small = rounded <= SMALL_SIZE
        pool = self._pools.setdefault((stream, small), _Pool())
        block = pool.best_fit(rounded)
        if block is None:
            block = self._grow(pool, stream, small, rounded)
        pool.remove(block)
        remaining = block.size - rounded
        splits = remaining >= MIN_BLOCK if small or self.expandable else remaining > SMALL_SIZE
        if splits:
            rest = _Block(block.segment, block.offset + rounded, remaining)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            if pool.tail is block:
                pool.tail = rest
            pool.add(rest)
        block.free = False
        self._live[key] = (block, (stream, small))
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """Return ``key``'s block to its stream's cache, merged with free neighbours."""
        if key not in self._live:
            return  # a tensor of 0 bytes
        block, where = self._live.pop(key)
        pool = self._pools[where]
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                pool.remove(neighbour)
                first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                if pool.tail is second:
                    pool.tail = first
                block = first
        pool.add(block)

    def _grow(self, pool: _Pool, stream: str, small: bool, rounded: int) -> _Block:
        """Reserve memory for a request no cached block holds: a new segment, or pages at the end
        of the stream's expandable segment (merged with its free last block). Returns a free
        block of the pool that holds ``rounded`` bytes."""
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        if self.reserved + self._needed(pool, page, rounded) > self.capacity:
            self.num_alloc_retries += 1
            self._give_back()
            over = self.reserved + self._needed(pool, page, rounded) - self.capacity
            if over > 0:
                self.num_ooms += 1
                self.short = max(self.short, int(over))
        added = self._needed(pool, page, rounded)
        if not self.expandable:
            block = _Block(next(self._segments), 0, added)
        else:
            tail = pool.tail
            if tail is not None and tail.free:
                pool.remove(tail)
                tail.size += added
                block = tail
            else:
                segment = tail.segment if tail is not None else next(self._segments)
                offset = tail.offset + tail.size if tail is not None else 0
                block = _Block(segment, offset, added)
                block.prev = tail
                if tail is not None:
                    tail.next = block
                pool.tail = block
        self.reserved += added
        self._reserved_by_stream[stream] = self._reserved_by_stream.get(stream, 0) + added
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        pool.add(block)
        return block

    def _needed(self, pool: _Pool, page: int, rounded: int) -> int:
        """Bytes a request of ``rounded`` bytes that no cached block holds adds to the reserve."""
        if not self.expandable:
            return segment_size(rounded)
        tail = pool.tail
        short = rounded - tail.size if tail is not None and tail.free else rounded
        return -(-short // page) * page

    def _give_back(self) -> None:
        """Release what the cache holds and no live block uses: every segment that is one free
        block, and the free last block of each expandable segment (in whole pages)."""
        for (stream, small), pool in self._pools.items():
            page = SMALL_SEGMENT if small else LARGE_SEGMENT
            for key in list(pool.free):
                block = pool.blocks.get(key)
                if block is None or block.prev is not None or block.next is not None:
                    continue
                if self.expandable and block is pool.tail:
                    pool.tail = None
                pool.remove(block)
                self._release(stream, block.size)
            tail = pool.tail
            if self.expandable and tail is not None and tail.free and tail.size >= page:
                pool.remove(tail)
                released = tail.size // page * page
                tail.size -= released
                self._release(stream, released)
                if tail.size:
                    pool.add(tail)
                else:
                    pool.tail = tail.prev
                    if tail.prev is not None:
                        tail.prev.next = None

    def _release(self, stream: str, size: int) -> None:
        self.reserved -= size
        self._reserved_by_stream[stream] -= size

    def close(self) -> None:
        """Unlink the blocks' neighbours, so that the allocator goes without a garbage collection
        (a plan's planning leaves no reference cycles: the mesh search runs none between meshes)."""
        blocks = [block for pool in self._pools.values() for block in pool.blocks.values()]
        blocks += [block for block, _ in self._live.values()]
        for block in blocks:
            block.prev = block.next = None
        for pool in self._pools.values():
            pool.tail = None

    def peak(self) -> AllocatorPeak:
        return AllocatorPeak(
            self.peak_allocated,
            self.peak_reserved,
            dict(self._reserved_by_stream),
            self.num_alloc_retries,
            self.num_ooms,
            self.short,
        )


def simulate(
    events: Iterable[tuple[str, Hashable, float, str]], expandable_segments: bool = False, capacity: float = math.inf
) -> AllocatorPeak:
    """Run ``events``, each ("malloc", key, bytes, stream) or ("free", key, 0, stream), through
    one ``CachingAllocator`` on a device of ``capacity`` bytes; its peaks."""
    allocator = CachingAllocator(expandable_segments, capacity)
    try:
        for action, key, size, stream in events:
            if action == "malloc":
                allocator.malloc(key, size, stream)
            elif action == "free":
                allocator.free(key)
            else:
                raise InternalError(f"unknown allocator event {action!r}")
        return allocator.peak()
    finally:
        allocator.close()


__all__ = ["AllocatorPeak", "CachingAllocator", "round_size", "segment_size", "simulate"]
