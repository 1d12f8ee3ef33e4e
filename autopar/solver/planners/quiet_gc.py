"""``quiet_gc``: planning holds the garbage collector's full passes off the caller's objects."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def quiet_gc():
    """Leave the objects that exist now out of the garbage collector's passes until the block ends.

    Tracing and planning allocate hundreds of thousands of objects, and every so many of them
    Python runs a full collection, which walks every object in the process: torch's, a model's
    modules, whatever the caller holds. On a 48-layer LLaMA that was 0.3-0.8 s of a 3-5 s plan,
    more the larger the process. ``gc.freeze`` moves what exists into a generation that no pass
    walks (nothing is lost: what becomes garbage in there is collected after ``gc.unfreeze``),
    so that the passes during planning walk only what planning made. Full collections are held
    off until the block ends as well (the young generations are still collected): planning
    keeps what it makes until it returns, and each full pass walked all of it again, 0.7-1 s of
    a 4 s plan of LLaMA-3-8B on (8, 2, 4), whose ILP has 10^5 variables. A caller that froze
    objects itself, or turned the collector off, is left as it is. Tracing and ``plan_traced``
    run under it (a decorator as well as a context manager); a block inside another does nothing
    (``gc.get_freeze_count`` walks every frozen object: 35 ms a plan, asked inside the outer block)."""
    if _QUIET_DEPTH[0] or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], _NO_FULL_COLLECTIONS)
    _QUIET_DEPTH[0] += 1
    try:
        yield
    finally:
        _QUIET_DEPTH[0] -= 1
        gc.set_threshold(*thresholds)
        gc.unfreeze()


# Collections of the middle generation before a full one, within ``quiet_gc``: never, in practice.
_NO_FULL_COLLECTIONS = 1 << 30
# How many ``quiet_gc`` blocks that froze the heap are open (one at most).
_QUIET_DEPTH = [0]


__all__ = ["quiet_gc"]
