"""``solver.planners.quiet_gc``: planning leaves the caller's objects out of the collector's passes, and gives
them back, untouched, when it ends."""

from __future__ import annotations

import gc
import weakref

import pytest

from autopar.solver.planners.quiet_gc import quiet_gc


class _Node:
    pass


def _cycle(holder: list | None = None) -> weakref.ref:
    """A reference cycle that only ``holder`` holds (once dropped, only the cyclic collector frees it)."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    if holder is not None:
        holder.append(a)
    return weakref.ref(a)


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_what_exists_is_frozen_inside_and_collected_after():
    holder: list = []
    before = _cycle(holder)
    with quiet_gc():
        assert gc.get_freeze_count() > 0
        holder.clear()  # garbage now, but made before the block
        gc.collect()
        assert before() is not None  # frozen: no pass walks it
        inside = _cycle()
        gc.collect()
        assert inside() is None  # made inside: collected as usual
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert before() is None  # nothing is lost


def test_nested_blocks_and_decorated_calls_unfreeze_once():
    @quiet_gc()
    def plan():
        return gc.get_freeze_count()

    # Frozen objects still die when their last reference goes, so the count only falls: a second
    # freeze would raise it, an unfreeze would zero it.
    with quiet_gc():
        frozen = gc.get_freeze_count()
        assert 0 < plan() <= frozen
        assert 0 < gc.get_freeze_count() <= frozen  # the inner call left the outer block's freeze alone
    assert gc.get_freeze_count() == 0
    assert plan() > 0 and gc.get_freeze_count() == 0


def test_a_caller_that_froze_or_disabled_the_collector_is_left_alone():
    gc.freeze()
    frozen = gc.get_freeze_count()
    with quiet_gc():
        _cycle()
        assert 0 < gc.get_freeze_count() <= frozen  # not frozen again
    assert 0 < gc.get_freeze_count() <= frozen  # and not unfrozen
    gc.unfreeze()
    gc.disable()
    try:
        with quiet_gc():
            assert gc.get_freeze_count() == 0
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_full_collections_wait_for_the_block_and_the_thresholds_come_back():
    before = gc.get_threshold()
    with quiet_gc():
        young, middle, full = gc.get_threshold()
        assert (young, middle) == before[:2] and full > 10**6  # no automatic full pass
        inside = _cycle()
        gc.collect()
        assert inside() is None  # an explicit collection still collects
    assert gc.get_threshold() == before
