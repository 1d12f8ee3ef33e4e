"""The caching allocator model (``autopar.cost.allocator``) against hand-worked traces: each
expected figure is worked out from the rules in the module docstring, in MiB."""

from __future__ import annotations

import pytest

from autopar.cost.allocator import CachingAllocator, round_size, segment_size, simulate

MIB = 2**20


def _run(events, expandable=False, capacity=float("inf")):
    return simulate([(a, k, s * MIB if a == "malloc" else 0, st) for a, k, s, st in events], expandable, capacity)


def test_rounding_and_segment_sizes():
    assert [round_size(n) for n in (1, 512, 513, 1000, 1536)] == [512, 512, 1024, 1024, 1536]
    assert segment_size(round_size(100)) == 2 * MIB  # small pool: 2 MiB segments
    assert segment_size(MIB) == 2 * MIB  # 1 MiB is still small
    assert segment_size(MIB + 512) == 20 * MIB  # up to 10 MiB: a 20 MiB segment
    assert segment_size(10 * MIB) == 10 * MIB  # from 10 MiB: the request rounded to 2 MiB
    assert segment_size(21 * MIB + 1) == 22 * MIB


def test_small_requests_share_a_2_mib_segment():
    allocator = CachingAllocator()
    for k in range(4):
        allocator.malloc(k, 1000)  # 1024 bytes each, split off one 2 MiB segment
    peak = allocator.peak()
    assert (peak.allocated, peak.reserved) == (4 * 1024, 2 * MIB)


def test_splitting_and_best_fit_reuse_across_sizes():
    # a 3 MiB request reserves 20 MiB and splits it (17 MiB left); a 30 MiB one its own
    # segment; freed, its 30 MiB block is the best fit for 20 MiB (17 MiB is too small) and
    # splits (10 MiB left > 1 MiB); 8 MiB then fits the 10 MiB rest (2 MiB left > 1 MiB: split),
    # and 16 MiB the first segment's 17 MiB (1 MiB left, not > 1 MiB: the whole block is taken).
    peak = _run(
        [
            ("malloc", "a", 3, "s"),
            ("malloc", "b", 30, "s"),
            ("free", "b", 0, "s"),
            ("malloc", "c", 20, "s"),
            ("malloc", "d", 8, "s"),
            ("malloc", "e", 16, "s"),
        ]
    )
    assert peak.reserved == 50 * MIB  # 20 + 30: nothing more
    assert peak.allocated == (3 + 20 + 8 + 17) * MIB  # e holds all 17 MiB of its block


def test_fragmentation_reserves_more_than_is_ever_allocated():
    # Two 12 MiB blocks, the first freed: a 20 MiB request fits neither the 12 MiB hole nor
    # (there is no coalescing across segments) the two free 12 MiB segments together.
    peak = _run(
        [
            ("malloc", "a", 12, "s"),
            ("malloc", "b", 12, "s"),
            ("free", "a", 0, "s"),
            ("free", "b", 0, "s"),
            ("malloc", "c", 20, "s"),
        ]
    )
    assert peak.allocated == 24 * MIB
    assert peak.reserved == 44 * MIB


def test_a_reused_pattern_reserves_what_it_allocates():
    # The same sizes freed and allocated again, step after step: the cache serves them all.
    events = []
    for step in range(3):
        events += [("malloc", (step, k), 16, "s") for k in range(4)]
        events += [("free", (step, k), 0, "s") for k in range(4)]
    peak = _run(events)
    assert peak.allocated == peak.reserved == 64 * MIB


def test_streams_do_not_share_cached_blocks():
    # A block freed on the reduce-scatter stream is not reused by the compute stream.
    events = [("malloc", "g", 40, "rs"), ("free", "g", 0, "rs"), ("malloc", "x", 40, "compute")]
    peak = _run(events)
    assert peak.allocated == 40 * MIB and peak.reserved == 80 * MIB
    assert peak.reserved_by_stream == {"rs": 40 * MIB, "compute": 40 * MIB}
    same = _run([("malloc", "g", 40, "s"), ("free", "g", 0, "s"), ("malloc", "x", 40, "s")])
    assert same.reserved == 40 * MIB


def test_expandable_segments_grow_in_pages_and_coalesce():
    # 30 MiB maps two 20 MiB pages; 5 MiB takes 5 of the 10 left; with 30 MiB freed, 31 MiB fits
    # no free block (30 and 5) and extends the free tail (5 MiB) by 26 MiB: two more pages.
    peak = _run(
        [("malloc", "x", 30, "s"), ("malloc", "y", 5, "s"), ("free", "x", 0, "s"), ("malloc", "z", 31, "s")],
        expandable=True,
    )
    assert peak.reserved == 80 * MIB and peak.allocated == 36 * MIB
    # Where the default allocator cannot join two free segments, one expandable segment can.
    joined = _run(
        [
            ("malloc", "a", 12, "s"),
            ("malloc", "b", 12, "s"),
            ("free", "a", 0, "s"),
            ("free", "b", 0, "s"),
            ("malloc", "c", 20, "s"),
        ],
        expandable=True,
    )
    assert joined.reserved == 40 * MIB


def test_the_cache_is_given_back_before_running_out():
    # 60 MiB of device: 31 MiB does not fit beside the cached 30 MiB segment, which is given back.
    peak = _run([("malloc", "x", 30, "s"), ("free", "x", 0, "s"), ("malloc", "z", 31, "s")], capacity=60 * MIB)
    assert (peak.num_alloc_retries, peak.num_ooms, peak.reserved) == (1, 0, 32 * MIB)
    # A live block in each segment: nothing to give back, and 18 MiB is short.
    short = _run([("malloc", "x", 30, "s"), ("malloc", "z", 40, "s")], capacity=52 * MIB)
    assert (short.num_ooms, short.short) == (1, 18 * MIB)


def test_misuse_is_an_internal_error():
    allocator = CachingAllocator()
    allocator.malloc("a", 100)
    with pytest.raises(Exception, match="twice"):
        allocator.malloc("a", 100)
    allocator.malloc("zero", 0)  # CUDA gives no block for 0 bytes
    allocator.free("zero")
    assert allocator.peak().allocated == 512


def test_a_simulation_leaves_no_reference_cycles():
    import gc

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        _run([("malloc", "a", 3, "s"), ("malloc", "b", 1, "s"), ("free", "a", 0, "s")], expandable=True)
        _run([("malloc", "a", 3, "s"), ("malloc", "b", 1, "s"), ("free", "a", 0, "s")])
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
