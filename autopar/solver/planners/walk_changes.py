"""Which decisions' intervals a step of the memory planner's greedy must re-price.

``memory_plan._Walk.curve_under`` keeps the last curve it priced, and prices the next set of
decisions from it. The spans of an interval depend on the decisions that touch it
(``_WalkShape.touched``) and on two neighbours that are not its own:

- with prefetch, an offloaded parameter is fetched from the previous offloaded fetch and kept
  until the next one (``_Walk._fetched``): offloading or keeping a parameter changes the spans
  of the offloaded parameters fetched just before and after each of its uses;
- with prefetch, a layer whose activations are offloaded reads them back from the backward of
  the next such layer (``_Walk._context``): moving a layer's activations changes the previous
  moved layer's spans.

So the decisions to re-price are those that differ between the two sets, and those neighbours
under either set. (The optimizer step's streamed tensors, the largest offloaded ones, are
re-priced apart: ``_Walk._step_spans``.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def affected_keys(
    before: frozenset, after: frozenset, fetches: list[tuple[int, str]], segments: list[tuple[str, int, int]], prefetch: bool
) -> set[tuple[str, str]]:
    """The decision keys whose touched intervals may have other spans under ``after`` than under
    ``before``: the keys in one set only, and (with prefetch) their neighbours in either."""
    changed = set(before ^ after)
    if not prefetch:
        return changed
    out = set(changed)
    params = {node for kind, node in changed if kind == "param"}
    if params:
        for decisions in (before, after):
            offloaded = {node for kind, node in decisions if kind == "param"}
            out.update(("param", node) for node in fetch_neighbours(fetches, offloaded, params))
    moved = {index for kind, index in changed if kind == "activations"}
    if moved:
        for decisions in (before, after):
            layers = {index for kind, index in decisions if kind == "activations"}
            out.update(("activations", index) for index in moved_before(segments, layers, moved))
    return out


def fetch_neighbours(fetches: list[tuple[int, str]], offloaded: set[str], params: Iterable[str]) -> set[str]:
    """The parameters of ``offloaded`` fetched right before or after a fetch of one of ``params``
    (in ``offloaded``), in the order of ``fetches``: those whose prefetch spans it bounds."""
    params = set(params) & offloaded
    order = [node for _, node in fetches if node in offloaded]
    out: set[str] = set()
    for position, node in enumerate(order):
        if node not in params:
            continue
        if position > 0:
            out.add(order[position - 1])
        if position + 1 < len(order):
            out.add(order[position + 1])
    return out - params


def moved_before(segments: list[tuple[str, int, int]], layers: set[str], changed: set[str]) -> set[str]:
    """The segment indices in ``layers`` (those whose activations are offloaded) that come right
    before one of ``changed`` in forward order: their read back starts in its backward."""
    order = sorted(layers, key=lambda index: segments[int(index)][1])
    return {order[position - 1] for position, index in enumerate(order) if index in changed and position > 0} - changed


_ABSENT = object()  # ``BySegment.get``: no value (a value may be anything)


class BySegment:
    """A value per time for the times of some segments, looked up through the segment of each
    time (``segment_at``) instead of being written out time by time: the greedy builds one per
    step (``_Walk._context``), and a step should cost its decisions, not the layers they cover.
    Reads as the dict {time: values[segment_at[time]]} over the times of ``values``' segments
    whose time is in ``only`` (None: every time)."""

    __slots__ = ("_at", "_values", "_only")

    def __init__(self, segment_at: dict[int, int], values: dict[int, object], only: frozenset[int] | None = None):
        self._at, self._values, self._only = segment_at, values, only

    def __contains__(self, time: int) -> bool:
        return self.get(time, _ABSENT) is not _ABSENT

    def __getitem__(self, time: int):
        value = self.get(time, _ABSENT)
        if value is _ABSENT:
            raise KeyError(time)
        return value

    def get(self, time: int, default=None):
        # one lookup each in the two dicts: the greedy asks this of every time its steps re-price
        value = self._values.get(self._at.get(time), _ABSENT)
        if value is _ABSENT or (self._only is not None and time not in self._only):
            return default
        return value

    def __bool__(self) -> bool:
        return bool(self._values)


# Kinds of offloaded tensors (``memory_plan.TRANSFERS``); a layer's decisions are keyed by
# its segment index: a recompute ("checkpoint", "selective", "selective-op") or its moved "activations".
_OFFLOADED = ("optimizer_state", "grad", "param")
_RECOMPUTES = ("checkpoint", "selective", "selective-op")


@dataclass(frozen=True, slots=True)
class WalkContext:
    """What ``memory_plan._Walk._spans`` needs of a set of decisions, derived from the last
    step's by the decisions that differ (``derive``), so that a step of the greedy costs its
    decisions, not all of them: the offloaded nodes by kind, the recomputed (and selective)
    segments, the segments whose activations move and when each reads them back, and each
    offloaded node's tensors in the optimizer step's stream (``stream``: its sort key first).
    Its sets and dicts are not changed once built: the next step's are copies."""

    prefetch: bool
    offloaded: dict[str, set[str]]
    recomputed: dict[int, tuple[int, int]]  # segment -> (first, last)
    selective: dict[int, tuple[int, int]]
    selective_op: dict[int, tuple[int, int]]
    moved: dict[int, tuple[str, int, int]]
    reads: dict[int, tuple[int, int]]  # segment -> (last forward time, time its read starts)
    stream: dict[str, tuple[float, str, float]]  # node -> (-bytes, node, factor)
    in_segment: BySegment
    in_moved: BySegment
    kept: BySegment  # the outputs a selective checkpoint keeps
    kept_op: BySegment  # the outputs a selective-op checkpoint keeps

    @classmethod
    def empty(cls, walk, prefetch: bool) -> WalkContext:
        return cls._of(walk, prefetch, {kind: set() for kind in _OFFLOADED}, {}, {}, {}, {}, {}, {})

    @classmethod
    def _of(cls, walk, prefetch, offloaded, recomputed, selective, selective_op, moved, reads, stream) -> WalkContext:
        at = walk.shape.segment_at
        lookups = (
            BySegment(at, recomputed),
            BySegment(at, reads),
            BySegment(at, selective, walk.shape.kept),
            BySegment(at, selective_op, walk.shape.kept_op),
        )
        return cls(prefetch, offloaded, recomputed, selective, selective_op, moved, reads, stream, *lookups)

    def offloads(self, kind: str, node: str) -> bool:
        """Whether ``node``'s tensor of ``kind`` lives off the device."""
        return offloads(self.offloaded, kind, node)

    def derive(self, walk, changed: Iterable[tuple[str, str]], decisions: frozenset) -> WalkContext:
        """The context of ``decisions``, which differ from this one's by ``changed``."""
        offloaded = {kind: set(nodes) for kind, nodes in self.offloaded.items()}
        recomputed, selective, moved = dict(self.recomputed), dict(self.selective), dict(self.moved)
        selective_op = dict(self.selective_op)
        streamed: set[str] = set()
        for key in changed:
            kind, name = key
            on = key in decisions
            if kind in offloaded:
                (offloaded[kind].add if on else offloaded[kind].discard)(name)
                streamed.add(name)
                continue
            index = int(name)
            segment = walk.segments[index]
            for target, value, kinds in (
                (moved, segment, ("activations",)),
                (recomputed, segment[1:], _RECOMPUTES),
                (selective, segment[1:], ("selective",)),
                (selective_op, segment[1:], ("selective-op",)),
            ):
                if kind in kinds:
                    if on:
                        target[index] = value
                    else:
                        target.pop(index, None)
            if kind in _RECOMPUTES and not on and any((other, name) in decisions for other in _RECOMPUTES):
                recomputed[index] = segment[1:]  # the layer's other recompute stays
        reads = self.reads
        if any(kind == "activations" for kind, _ in changed):
            layers = sorted(moved.values(), key=lambda seg: seg[1])
            reads = {}
            for position, (_, first, last) in enumerate(layers):
                later = position + 1 < len(layers)
                read_from = walk.bwd(layers[position + 1][2]) if self.prefetch and later else walk.bwd(last)
                reads[walk.shape.segment_at[first]] = (last, read_from)
        stream = dict(self.stream)
        for node in streamed:
            entry = walk.stream_entry(node, offloaded)
            if entry is None:
                stream.pop(node, None)
            else:
                stream[node] = entry
        return WalkContext._of(walk, self.prefetch, offloaded, recomputed, selective, selective_op, moved, reads, stream)


def offloads(offloaded: dict[str, set[str]], kind: str, node: str) -> bool:
    """Whether ``node``'s tensor of ``kind`` is in ``offloaded`` (by kind); a fetched
    parameter's gradient goes to the store with it."""
    return node in offloaded[kind] or (kind == "grad" and node in offloaded["param"])
