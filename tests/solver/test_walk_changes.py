"""Which decisions a step of the memory planner re-prices (autopar/solver/planners/walk_changes.py). That the
re-priced curves equal the full walk is tests/solver/test_memory_walk.py's; these pin the neighbour rules."""

from __future__ import annotations

from autopar.solver.planners.walk_changes import BySegment, affected_keys, fetch_neighbours, moved_before

# Fetches in graph order: (time of the use, parameter).
FETCHES = [(1, "a"), (2, "b"), (3, "a"), (5, "c"), (7, "d")]
SEGMENTS = [("layers.0", 0, 3), ("layers.1", 4, 7), ("layers.2", 8, 11), ("layers.3", 12, 15)]


def test_fetch_neighbours_are_the_offloaded_fetches_on_either_side():
    assert fetch_neighbours(FETCHES, {"a", "b", "c", "d"}, {"b"}) == {"a"}
    assert fetch_neighbours(FETCHES, {"a", "c", "d"}, {"a"}) == {"c"}  # b is not offloaded: a's next is c
    assert fetch_neighbours(FETCHES, {"b", "d"}, {"d"}) == {"b"}
    assert fetch_neighbours(FETCHES, {"b", "d"}, {"a"}) == set()  # a is not offloaded here


def test_moved_before_is_the_previous_moved_layer():
    assert moved_before(SEGMENTS, {"0", "2", "3"}, {"2"}) == {"0"}
    assert moved_before(SEGMENTS, {"0", "2", "3"}, {"0"}) == set()
    assert moved_before(SEGMENTS, {"1", "3"}, {"3", "1"}) == set()  # changed ones are re-priced anyway


def test_affected_keys_with_and_without_prefetch():
    before = frozenset({("param", "a"), ("param", "d"), ("activations", "0"), ("checkpoint", "1")})
    after = before | {("param", "c"), ("activations", "2")}
    changed = {("param", "c"), ("activations", "2")}
    assert affected_keys(before, after, FETCHES, SEGMENTS, prefetch=False) == changed
    # c's fetch sits between a's second and d's; layer 2 is read back after layer 0
    want = changed | {("param", "a"), ("param", "d"), ("activations", "0")}
    assert affected_keys(before, after, FETCHES, SEGMENTS, prefetch=True) == want
    assert affected_keys(after, before, FETCHES, SEGMENTS, prefetch=True) == want  # dropping them: the same


def test_by_segment_reads_as_a_dict_over_its_segments_times():
    segment_at = {time: index for index, (_, first, last) in enumerate(SEGMENTS) for time in range(first, last + 1)}
    lookup = BySegment(segment_at, {1: "one"}, only=frozenset({5, 6, 9}))
    assert [time for time in range(16) if time in lookup] == [5, 6]
    assert lookup[5] == lookup.get(6) == "one" and lookup.get(7) is None and lookup.get(9, "x") == "x"
    assert not BySegment(segment_at, {})
