"""Choose activation checkpointing and offload when the chosen sharding does not fit the budget.

The sharding ILP runs first, as always. When its plan's liveness peak is still above
``memory_budget`` (or no sharding fits at all, in which case the leanest sharding is taken),
this planner prices every candidate decision in seconds added per step and bytes saved:

=================  ==========================================  ==================================
decision           bytes saved on the device                   seconds added per step
=================  ==========================================  ==================================
checkpoint layer   its activations kept from forward to        the layer's forward compute, run
                   backward (not its outputs, not its inputs)  again in backward
selective          the same, less the outputs of its matmuls   the forward compute of its other
checkpoint layer   and attention (``SELECTIVE_KEEPS``), which  ops, run again in backward
                   it keeps until its recompute
selective-op       the same, less the outputs of attention     the forward compute of its other
checkpoint layer   and of every other matmul (torchtitan's     ops (every second matmul among
                   op-level policy: ``selective_op_kept``)     them), run again in backward
offload optimizer  the parameter's optimizer state             read + write it once (the step)
state
offload gradient   the gradient, from its backward to the      write it in backward, read it in
                   step (alive only while produced)            the step
offload parameter  the parameter, except around its uses       read it in forward and backward,
                   (one use ahead with prefetch)               read + write it in the step
offload layer      the same as checkpointing it                write them in forward, read them
activations                                                    in backward
=================  ==========================================  ==================================

A layer takes one of its four decisions at most; one that saves more (selective-op over
selective, a whole-layer checkpoint or offload over either) taken later replaces a selective
checkpoint. ``checkpointing="selective"``, ``"selective-op"`` or ``"full"`` (``plan_memory``'s
``policy``) takes that checkpoint of every layer first, whatever the budget.

Transfers run at the target's link: ``cluster.host_link`` for "cpu" (pinned host memory), and
``cluster.disk_link`` for "disk" (through the host link too, on a device that is not the host).
With ``prefetch`` they overlap the step's compute, so the time a step loses to offload is the
total transfer time less the compute it hides behind, and never below zero.

The choice is greedy by seconds per byte saved: take the cheapest candidates until the peak of
the adjusted liveness walk fits, then drop, most expensive first, every chosen decision the peak
does not need. Savings are not additive (removing bytes at one time does not lower the peak if
another time is higher), which is why each step re-prices the walk instead of summing, from the
last step's: only the intervals of the decision added or dropped (a checkpointed segment's
activations and inputs, an offloaded tensor), of the offloaded neighbours whose prefetch spans
it bounds, and the optimizer step's streamed tensors (``_Walk.curve_under``,
``walk_changes``), so a step costs one decision, not the whole model. A Rotor-style dynamic
program over the chain of layers would choose the checkpoints optimally; it is not built.

The adjusted walk changes the intervals of ``autopar.cost.liveness``: an offloaded parameter is
alive only at its uses (from the previous fetch, with prefetch); an offloaded gradient only at
the time its backward writes it; offloaded optimizer state only in the step, which streams one
parameter at a time: at the last time of the walk, the largest parameter's offloaded tensors
and AdamW's temporary (two parameters' with prefetch) are added, in place of torch's foreach
temporary over every parameter (the walk's "optimizer_temporary"). A checkpointed layer's activations are
alive in forward until their last forward use, and again from the start of the layer's backward
(the recompute) to their old end; the layer's inputs are kept until its backward ends. A layer
whose activations are offloaded has the same two spans without keeping its inputs; with
prefetch the second starts one offloaded layer earlier (its read runs during the backward of the
next offloaded layer).
"""

from __future__ import annotations

import functools
import heapq
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch.fx

from autopar.cost import compute, liveness, optimizer
from autopar.cost.cluster import ClusterSpec, LinkSpec
from autopar.cost.rates import recompute_s as segment_recompute_s
from autopar.errors import InfeasibleError
from autopar.ir.memory import CheckpointSegment, MemoryPlan, OffloadEntry, selective_keeps, selective_op_kept, selective_op_role
from autopar.solver.planners.walk_changes import WalkContext, affected_keys, offloads
from autopar.solver.pricing.reserved import allocator_peaks
from autopar.solver.problem.choices import layer_key, live_nodes, mesh_hint, padded_choice
from autopar.solver.problem.gathered import PREFIX as GATHERED
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

# Transfers of each offloaded kind per step, in units of its bytes (see the module docstring).
TRANSFERS = {"optimizer_state": 2.0, "grad": 2.0, "param": 4.0}
# Of those, the one read in the optimizer step, which no forward or backward compute hides.
OPTIMIZER_READS = frozenset(TRANSFERS)
# Decisions of a layer (a segment index), at most one per layer: recompute all of it
# ("checkpoint"), recompute its cheap ops ("selective"), those and every second matmul
# ("selective-op"), or offload its activations.
_RECOMPUTES = ("checkpoint", "selective", "selective-op")
_LAYER_DECISIONS = _RECOMPUTES + ("activations",)
# How much of a layer each decision frees, in order: a layer's decision is replaced only by one
# that frees more (``_take``).
_FREES = {"selective": 0, "selective-op": 1, "checkpoint": 2, "activations": 2}
# The key of each checkpoint policy's decisions (``ir.memory.CHECKPOINT_POLICIES``).
_POLICY_KEY = {"full": "checkpoint", "selective": "selective", "selective-op": "selective-op"}


@dataclass(frozen=True, slots=True)
class LayerPolicy:
    """A checkpoint policy (``ir.memory.CHECKPOINT_POLICIES``) that layers take whatever the budget:
    every layer, or with ``layers`` (module FQNs: those a model checkpoints itself,
    ``trace.checkpoints``) the layers that are, hold or lie inside one of them (every layer where
    none does)."""

    name: str
    layers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Candidate:
    key: tuple[str, str]  # ("checkpoint", segment index) or (kind, param node)
    saved_bytes: float
    cost_s: float
    decision: CheckpointSegment | OffloadEntry


def offload_link(cluster: ClusterSpec, target: str) -> LinkSpec | None:
    """The link offloaded tensors cross for ``target``; None where offload saves nothing."""
    if target == "cpu":
        return cluster.host_link
    if cluster.host_link is None:
        return cluster.disk_link
    slower = min((cluster.host_link, cluster.disk_link), key=lambda link: link.bandwidth_bytes_per_s)
    return slower


@dataclass
class _WalkShape:
    """What the walk needs of the graph whatever its sharding: node indices, aliases, uses, the
    checkpoint segments, the parameter fetches, and which intervals each decision can change,
    so that ``_Walk.curve_under`` re-prices only those: a checkpointed segment (or one whose
    activations are offloaded) changes the activations it produces and, for checkpointing, the
    ones it reads; an offloaded tensor only its own. A segment of a repeated layer thus costs
    that layer's intervals, not the whole walk's. Computed once per choice graph."""

    num: int
    index: dict[str, int]
    root: dict[str, str]
    uses: dict[str, list[int]]
    segments: list[tuple[str, int, int]]
    fetches: list[tuple[int, str]]
    touched: dict[tuple[str, str], set[int]]
    segment_at: dict[int, int]  # time -> index of its segment, for the times in one
    # Times whose op a "selective" checkpoint keeps the output of (``ir.memory.selective_keeps``).
    kept: frozenset[int] = frozenset()
    # Times whose op a "selective-op" checkpoint keeps the output of (``ir.memory.selective_op_kept``).
    kept_op: frozenset[int] = frozenset()
    # Per segment, what pricing it needs of each of its nodes (``_Walk.segment_terms``).
    segment_terms: list | None = None
    # The walk's "optimizer_temporary" spans (torch's foreach AdamW's, at the step), which
    # ``_Walk._step_spans`` holds apart, and which intervals they are.
    temporaries: tuple = ()
    temporary_mask: np.ndarray | None = None

    @classmethod
    def of(cls, traced: TracedModel, graph) -> _WalkShape:
        cached = graph.derived.get("live_nodes")  # as the graph was built from them
        nodes = cached[1] if cached is not None and cached[0] is traced.gm else live_nodes(traced.gm, graph.choices)
        root: dict[str, str] = {}
        for node in nodes:
            root[node.name] = root[node.inputs[0]] if node.kind == "alias" and node.inputs else node.name
        leader = {member: group[0] for group in graph.ties for member in group}
        uses: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            if node.kind == "alias":
                continue
            for producer in node.inputs:
                base = leader.get(root[producer], root[producer])
                uses.setdefault(base, []).append(i)
        fx_nodes = {n.name: n for n in traced.gm.graph.nodes}
        # Checkpoint segments: maximal runs of ops of one numbered layer (e.g. transformer.h.3).
        segments: list[tuple[str, int, int]] = []
        current: tuple[str, int] | None = None
        for i, node in enumerate(nodes):
            key = layer_key(fx_nodes[node.name], None) if node.kind in ("op", "alias") else None
            if key is not None and current is not None and key == current and segments[-1][2] == i - 1:
                name, first, _ = segments[-1]
                segments[-1] = (name, first, i)
            elif key is not None:
                segments.append((f"{key[0]}.{key[1]}", i, i))
            current = key
        # Offloaded parameters are fetched before each use; in graph order, for prefetch.
        param_nodes = [n.name for n in nodes if n.kind == "param" and n.name == leader.get(n.name, n.name)]
        fetches = sorted((u, p) for p in param_nodes for u in sorted(set(uses.get(p, ()))))
        segment_at: dict[int, int] = {}
        for index, (_, first, last) in enumerate(segments):
            for i in range(first, last + 1):
                segment_at[i] = index
        intervals = graph.timeline.intervals
        touched: dict[tuple[str, str], set[int]] = {}
        for k, iv in enumerate(intervals):
            keys: list[tuple[str, str]] = []
            if iv.kind == "activation":
                if iv.start in segment_at:
                    keys += [(policy, str(segment_at[iv.start])) for policy in _LAYER_DECISIONS]
                keys += [(p, str(segment_at[u])) for u in uses.get(iv.node, ()) if u in segment_at for p in _RECOMPUTES]
            elif iv.kind == "gathered":  # re-gathered inside a checkpointed segment of its uses
                gathered_uses = uses.get(iv.node.removeprefix(GATHERED), ())
                keys += [(p, str(segment_at[u])) for u in gathered_uses if u in segment_at for p in _RECOMPUTES]
            elif iv.kind in TRANSFERS:
                keys.append((iv.kind, iv.node))
                if iv.kind == "grad":  # a fetched parameter's gradient goes to the store
                    keys.append(("param", iv.node))
            for key in keys:
                touched.setdefault(key, set()).add(k)
        kept = frozenset(i for i, node in enumerate(nodes) if node.kind == "op" and selective_keeps(fx_nodes[node.name].target))
        kept_op = frozenset(
            first + k
            for _, first, last in segments
            for k, keeps in enumerate(selective_op_kept([_op_role(nodes[i], fx_nodes) for i in range(first, last + 1)]))
            if keeps
        )
        index = {node.name: i for i, node in enumerate(nodes)}
        mask = np.array([iv.kind == "optimizer_temporary" for iv in intervals], dtype=bool)
        temporaries = tuple(
            (iv.node, iv.kind, iv.start, iv.end, iv.factor) for iv, temporary in zip(intervals, mask) if temporary
        )
        return cls(
            len(nodes), index, root, uses, segments, fetches, touched, segment_at, kept, kept_op,
            temporaries=temporaries, temporary_mask=mask,
        )  # fmt: skip


class _Walk:
    """The liveness intervals of one chosen sharding, re-priced under a set of decisions."""

    def __init__(self, traced: TracedModel, graph, bytes_of: Callable[[str], float], sizes: np.ndarray | None = None):
        self.graph = graph
        self.bytes_of = _memoized(bytes_of)  # asked for the same nodes at every step of the greedy
        self.timeline: liveness.Timeline = graph.timeline
        cached = graph.derived.get("memory_walk")
        if cached is None or cached[0] is not traced.gm:
            cached = graph.derived["memory_walk"] = (traced.gm, _WalkShape.of(traced, graph))
        shape = self.shape = cached[1]
        self.num, self.index, self.root, self.uses = shape.num, shape.index, shape.root, shape.uses
        self.segments, self.fetches, self._touched = shape.segments, shape.fetches, shape.touched
        self._sizes = self.timeline.sizes(bytes_of) if sizes is None else sizes
        self._base = _unplanned(self.timeline, self._sizes, ~shape.temporary_mask)  # the step's apart
        # (prefetch, decisions, context, delta, streamed, each replaced interval's spans) of the last curve
        self._last: tuple | None = None
        self._stepped: dict[str, list[tuple[str, float]]] | None = None  # ``_step_spans``' factors

    def bwd(self, time: int) -> int:
        return 2 * self.num - 1 - time

    def intervals(self, decisions: set[tuple[str, str]], prefetch: bool) -> list[tuple[str, str, int, int, float]]:
        """(node, kind, start, end, factor) of every stored tensor under ``decisions``."""
        context = self._context(decisions, prefetch)
        out = []
        for iv in self.timeline.intervals:
            out.extend(self._spans(iv, context))
        out.extend(self._step_spans(context))
        return out

    def last_intervals(self) -> list[tuple[str, str, int, int, float]]:
        """``intervals`` of the last curve's decisions (``curve_under``), from the spans it priced:
        an interval it did not re-price is as the walk without decisions has it (torch's
        optimizer temporaries apart: they are the step's spans, ``_step_spans``)."""
        assert self._last is not None, "last_intervals follows a curve_under"
        priced, streamed = self._last[5], self._last[4]
        out = []
        for k, iv in enumerate(self.timeline.intervals):
            spans = priced.get(k)
            if spans is not None:
                out.extend(spans)
            elif iv.kind != "optimizer_temporary":
                out.append((iv.node, iv.kind, iv.start, iv.end, iv.factor))
        out.extend(streamed)
        return out

    def _context(self, decisions, prefetch: bool) -> WalkContext:
        """What ``_spans`` needs of ``decisions`` (``walk_changes.WalkContext``), from nothing."""
        decisions = frozenset(decisions)
        return WalkContext.empty(self, prefetch).derive(self, decisions, decisions)

    def _spans(self, iv: liveness.Interval, context: WalkContext) -> list[tuple[str, str, int, int, float]]:
        """The (node, kind, start, end, factor) spans of one interval under ``_context``'s decisions."""
        offloaded, in_segment, in_moved, prefetch, kept = (
            context.offloaded,
            context.in_segment,
            context.in_moved,
            context.prefetch,
            context.kept,
        )
        if iv.kind == "optimizer_temporary":
            return []  # ``_step_spans``
        if iv.kind in TRANSFERS and context.offloads(iv.kind, iv.node):
            if iv.kind == "optimizer_state":
                return []
            if iv.kind == "grad":
                return [(iv.node, iv.kind, iv.start, iv.start, iv.factor)]
            return [(iv.node, iv.kind, s, e, iv.factor) for s, e in self._fetched(iv.node, offloaded["param"], prefetch)]
        moved = in_moved.get(iv.start) if iv.kind == "activation" else None
        if moved is not None:
            last, read_from = moved
            last_forward = self.saved_inside(iv, last)
            if last_forward is not None:
                return [(iv.node, iv.kind, iv.start, last_forward, iv.factor), (iv.node, iv.kind, read_from, iv.end, iv.factor)]
        if iv.kind == "activation" and (iv.start in kept or iv.start in context.kept_op):
            # torch's selective checkpoint caches the output from forward until the recompute
            # at the start of the segment's backward reads it back.
            _, last = in_segment[iv.start]
            return [(iv.node, iv.kind, iv.start, max(iv.end, self.bwd(last)), iv.factor)]
        if iv.kind == "activation" and in_segment:
            return self._checkpointed(iv, in_segment)
        if iv.kind == "gathered" and in_segment:
            return self._gathered_checkpointed(iv, in_segment)
        return [(iv.node, iv.kind, iv.start, iv.end, iv.factor)]

    def _step_spans(self, context: WalkContext) -> list[tuple[str, str, int, int, float]] | tuple:
        """What the optimizer step holds at the walk's last time beyond its resident tensors.
        Where nothing is offloaded, torch's optimizer steps: its temporaries (the walk's
        "optimizer_temporary" intervals). Else ``autopar.optim.AdamW`` streams offloaded state
        one parameter at a time: the largest parameter's offloaded tensors and AdamW's temporary
        (and, with prefetch, the next largest's tensors) are on the device (``stream_entry``)."""
        if not context.stream:
            return self.shape.temporaries  # the same tuple each time: ``curve_under`` compares it first
        largest = heapq.nsmallest(2 if context.prefetch else 1, context.stream.values())
        last = 2 * self.num - 1
        return [(node, "optimizer_state", last, last, factor) for _, node, factor in largest]

    def stream_entry(self, node: str, offloaded: dict[str, set[str]]) -> tuple[float, str, float] | None:
        """(its order in the stream, ``node``, the factor of its bytes that the step holds: one
        for AdamW's temporary, and each of its offloaded tensors), or None where nothing of
        ``node`` is in ``offloaded`` (the offloaded nodes by kind)."""
        if self._stepped is None:  # each node's optimizer state and gradient factors, in interval order
            self._stepped = {}
            for iv in self.timeline.intervals:
                if iv.kind in ("optimizer_state", "grad"):
                    self._stepped.setdefault(iv.node, []).append((iv.kind, iv.factor))
        factor = None
        for kind, share in self._stepped.get(node, ()):
            if offloads(offloaded, kind, node):
                factor = (1.0 if factor is None else factor) + share
        if node in offloaded["param"]:
            factor = (1.0 if factor is None else factor) + 1.0
        return None if factor is None else (-factor * self.bytes_of(node), node, factor)

    def _fetched(self, param: str, offloaded: set[str], prefetch: bool) -> list[tuple[int, int]]:
        fetches = [(u, p) for u, p in self.fetches if p in offloaded]
        spans = []
        for k, (use, p) in enumerate(fetches):
            if p != param:
                continue
            before = fetches[k - 1][0] if prefetch and k > 0 else use
            after = fetches[k + 1][0] if prefetch and k + 1 < len(fetches) else use
            spans.append((before, use))
            spans.append((self.bwd(after), self.bwd(use)))
        return spans

    def segment_terms(self) -> list[list[tuple[str, float | None, float | None, bool, bool, float | None]]]:
        """Per checkpoint segment, (node, what its compute is divided by to leave its forward
        (1 + the backward factor of its op; None: all forward), the factor of its activation that
        the segment frees (None: none), whether a "selective" checkpoint keeps its output,
        whether a "selective-op" one does, the factor a checkpoint that keeps it keeps longer
        than no checkpoint (None: none)) for each node: the same for every sharding, so computed
        once per choice graph (``_WalkShape``) and priced per plan by ``_candidates``."""
        if self.shape.segment_terms is None:
            # a node's last activation interval, as ``_candidates`` always took it
            activation = {iv.node: iv for iv in self.timeline.intervals if iv.kind == "activation"}
            terms = []
            for _, first, last in self.segments:
                rows = []
                for i in range(first, last + 1):
                    node = self.timeline.names[i]
                    c = self.graph.choices[node]
                    divisor = 1.0 + compute.backward_factor(c.info) if c.info is not None and c.requires_grad else None
                    iv = activation.get(node)
                    freed = iv.factor if iv is not None and self.saved_inside(iv, last) is not None else None
                    keeps, keeps_op = i in self.shape.kept, i in self.shape.kept_op
                    # kept from forward to the recompute, where nothing in backward needed it
                    held = iv.factor if (keeps or keeps_op) and iv is not None and iv.end < self.num else None
                    rows.append((node, divisor, freed, keeps, keeps_op, held))
                terms.append(rows)
            self.shape.segment_terms = terms
        return self.shape.segment_terms

    def saved_inside(self, iv: liveness.Interval, last: int) -> int | None:
        """The last forward use of activation ``iv`` if a segment ending at time ``last`` saves it
        for backward (it is no output of the segment), else None: what checkpointing the segment
        or offloading its activations frees between forward and backward."""
        last_forward = max(self.uses.get(iv.node, [iv.start]))
        return last_forward if last_forward <= last and iv.end >= self.num else None

    def _checkpointed(self, iv: liveness.Interval, in_segment) -> list[tuple[str, str, int, int, float]]:
        i = iv.start
        uses = self.uses.get(iv.node, [i])
        end = iv.end
        own = in_segment.get(i)
        if own is not None:
            first, last = own
            last_forward = self.saved_inside(iv, last)
            if last_forward is not None:
                return [(iv.node, iv.kind, i, last_forward, iv.factor), (iv.node, iv.kind, self.bwd(last), end, iv.factor)]
            return [(iv.node, iv.kind, i, end, iv.factor)]
        # An input of a checkpointed segment is kept until the segment's backward ends (the
        # earliest such segment's, which ends last).
        get = in_segment.get
        firsts = [span[0] for u in uses if (span := get(u)) is not None and span[0] > i]
        if firsts:
            end = max(end, self.bwd(min(firsts)))
        return [(iv.node, iv.kind, i, end, iv.factor)]

    def _gathered_checkpointed(self, iv: liveness.Interval, in_segment) -> list[tuple[str, str, int, int, float]]:
        """A gathered parameter whose every use lies in one checkpointed segment is gathered
        inside it (``passes.memory``): freed after its last forward use, whether or not its group
        reshards, and gathered again by the segment's recompute, for the segment's backward."""
        uses = self.uses.get(iv.node.removeprefix(GATHERED), [])
        spans = {in_segment.get(u) for u in uses}
        if not uses or len(spans) != 1 or None in spans:
            return [(iv.node, iv.kind, iv.start, iv.end, iv.factor)]
        ((first, last),) = spans
        pieces = []
        if iv.start < self.num:
            pieces.append((iv.node, iv.kind, iv.start, min(iv.end, max(uses)), iv.factor))
        if iv.start == iv.end >= self.num:
            # the all-gather buffer the group is copied out of (``liveness.gathered_intervals``):
            # one instant, now at the recompute's gather, not the segment's whole backward
            pieces.append((iv.node, iv.kind, self.bwd(last), self.bwd(last), iv.factor))
        elif iv.end >= self.num:
            pieces.append((iv.node, iv.kind, self.bwd(last), self.bwd(first), iv.factor))
        return pieces

    def curve(self, intervals) -> list[float]:
        delta = [0.0] * (2 * self.num + 1)
        for node, _kind, start, end, factor in intervals:
            size = factor * self.bytes_of(node)
            delta[start] += size
            delta[end + 1] -= size
        out, running = [], 0.0
        for change in delta[:-1]:
            running += change
            out.append(running)
        return out

    def curve_under(self, decisions, prefetch: bool) -> np.ndarray:
        """Bytes alive at every time under ``decisions`` (``curve(intervals(decisions))``), priced
        from the last call's curve: only the intervals whose spans differ between its decisions
        and these are taken out and added again (``walk_changes.affected_keys``: the decisions
        that differ, and the offloaded neighbours whose prefetch spans they bound), and the
        optimizer step's streamed tensors where they differ. The greedy's steps add or drop one
        decision each, so a step costs that decision's intervals, not the whole walk's. The
        first call (or one with another ``prefetch``) prices from the walk without decisions."""
        decisions = frozenset(decisions)
        last, self._last = self._last, None  # set again once this curve is whole
        if last is not None and last[0] == prefetch:
            _, before, old_context, delta, old_streamed, priced = last
            context = old_context.derive(self, before ^ decisions, decisions)
            streamed = self._step_spans(context)
            delta = delta.copy()
            keys = affected_keys(before, decisions, self.fetches, self.segments, prefetch)
            for k in sorted({k for key in keys for k in self._touched.get(key, ())}):
                self._replace(delta, k, priced, context)
            if streamed is not old_streamed and streamed != old_streamed:
                self._add(delta, old_streamed, -1.0)
                self._add(delta, streamed, 1.0)
        else:
            context = self._context(decisions, prefetch)
            streamed = self._step_spans(context)
            delta = self._base.copy()
            priced = {}
            for k in sorted({k for key in decisions for k in self._touched.get(key, ())}):
                self._replace(delta, k, priced, context)
            self._add(delta, streamed, 1.0)
        self._last = (prefetch, decisions, context, delta, streamed, priced)
        return np.cumsum(delta[:-1])

    def _replace(self, delta: np.ndarray, k: int, priced: dict[int, list], context: WalkContext) -> None:
        """Take interval ``k``'s spans as ``delta`` holds them out of it and add its spans under
        ``context``, where they differ. ``priced``: the spans of each interval replaced since the
        walk without decisions (the others are as it has them), updated here: the last curve's
        spans are looked up, not priced again under its context (half of a step's ``_spans``)."""
        iv = self.timeline.intervals[k]
        old = priced.get(k)
        if old is None:
            old = [(iv.node, iv.kind, iv.start, iv.end, iv.factor)]
        new = priced[k] = self._spans(iv, context)
        if old != new:
            self._add(delta, old, -1.0)
            self._add(delta, new, 1.0)

    def _add(self, delta: np.ndarray, spans: list[tuple[str, str, int, int, float]], sign: float) -> None:
        """Add (``sign`` 1) or take out (-1) ``spans`` in the difference array ``delta``."""
        for node, _kind, start, end, factor in spans:
            size = sign * factor * self.bytes_of(node)
            delta[start] += size
            delta[end + 1] -= size

    def kept_peak(self) -> float:
        """``_kept_peak`` of this walk's sizes."""
        return _kept_peak(self.timeline, self._sizes)

    def peak(self, decisions, prefetch: bool, fresh: bool = False) -> tuple[float, int]:
        """(peak bytes, the first time it is reached) under ``decisions``; ``fresh``: priced from
        the walk without decisions, as a plan's figures are, whatever the greedy priced before."""
        if fresh:
            self._last = None
        values = self.curve_under(decisions, prefetch)
        time = int(np.argmax(values))
        return float(values[time]), time


def _op_role(node, fx_nodes) -> str | None:
    """``ir.memory.selective_op_role`` of a live node of the choice graph (None: not an op)."""
    if node.kind != "op":
        return None
    fx_node = fx_nodes[node.name]
    dims = tuple(
        arg.meta["val"].dim() for arg in fx_node.args if isinstance(arg, torch.fx.Node) and hasattr(arg.meta.get("val"), "dim")
    )
    return selective_op_role(fx_node.target, dims)


def _memoized(bytes_of: Callable[[str], float]) -> Callable[[str], float]:
    """``bytes_of``, asked once per name."""
    known: dict[str, float] = {}

    def size(name: str) -> float:
        value = known.get(name)
        if value is None:
            value = known[name] = bytes_of(name)
        return value

    return size


def _kept_peak(timeline: liveness.Timeline, sizes: np.ndarray) -> float:
    """The peak of the tensors no checkpoint frees: all but activations and gathered copies
    (``_Walk._spans`` changes only those for a checkpoint). Checkpointing adds nothing below them,
    so no set of checkpoints brings the peak under this. From the timeline alone: the walk's
    shape (``_WalkShape``) is not needed to know that checkpointing cannot fit a sharding."""
    starts, ends = timeline.bounds()
    kept = np.array([iv.kind not in ("activation", "gathered") for iv in timeline.intervals], dtype=bool)
    delta = _difference(len(timeline.names), starts[kept], ends[kept], sizes[kept])
    return float(np.cumsum(delta[:-1]).max(initial=0.0))


def _unplanned(timeline: liveness.Timeline, sizes: np.ndarray, only: np.ndarray | None = None) -> np.ndarray:
    """The walk with no decision, as a difference array (``np.add.at`` adds in order, as a
    loop), of the intervals ``only`` marks (None: all)."""
    starts, ends = timeline.bounds()
    if only is not None:
        starts, ends, sizes = starts[only], ends[only], sizes[only]
    return _difference(len(timeline.names), starts, ends, sizes)


def _plain_peak(timeline: liveness.Timeline, sizes: np.ndarray) -> float:
    """``_Walk.peak`` with no decision (``_unplanned``, summed as the walk sums it)."""
    return float(np.cumsum(_unplanned(timeline, sizes)[:-1]).max())


def _difference(num: int, starts: np.ndarray, ends: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The difference array of intervals ``[starts, ends]`` of ``sizes`` bytes over a walk of
    ``num`` forward times (``np.add.at`` adds in order, as a loop)."""
    delta = np.zeros(2 * num + 1)
    np.add.at(delta, starts, sizes)
    np.add.at(delta, ends + 1, -sizes)
    return delta


def plan_memory(
    traced: TracedModel,
    graph,
    choice: dict[str, int],
    cluster: ClusterSpec,
    budget: float,
    *,
    target: str | None,
    prefetch: bool = True,
    checkpointing: bool = True,
    explain: bool = True,
    policy: LayerPolicy | None = None,
) -> tuple[MemoryPlan, MemoryFigures]:
    """The cheapest decisions that bring the peak under ``budget`` (module docstring), and what
    the plan reports of its memory under them (``MemoryFigures``). ``target`` None allows
    checkpointing only.
    ``policy`` checkpoints its layers with its policy first, whatever the budget (a layout such as
    torchtitan's), and leaves only offload to choose.
    Raises InfeasibleError with the peak when every candidate is taken (``explain=False``: with
    no list of what is alive there, for a caller that only tries a candidate and moves on)."""
    bytes_of = graph.bytes_of(choice)
    sizes = graph.timeline.sizes(bytes_of)
    layers, policy = (policy.layers, policy.name) if policy is not None else ((), None)
    if target is None and _kept_peak(graph.timeline, sizes) > budget and _plain_peak(graph.timeline, sizes) > budget:
        # Checkpointing alone cannot fit: fail as the greedy would, having taken every candidate
        # (known before the walk's shape is built, which ``solve``'s candidates may never need).
        if not explain:
            raise _infeasible(None, graph, set(), prefetch, budget, target, checkpointing, explain)
        walk = _Walk(traced, graph, bytes_of, sizes)
        keys = _leanest_keys(_candidates(walk, graph, choice, cluster, target, checkpointing, policy))
        raise _infeasible(walk, graph, keys, prefetch, budget, target, checkpointing, explain)
    walk = _Walk(traced, graph, bytes_of, sizes)
    candidates = _candidates(walk, graph, choice, cluster, target, checkpointing, policy)
    before, _ = walk.peak(set(), prefetch)
    fixed = [c for c in candidates if policy is not None and c.key[0] == _POLICY_KEY[policy]]
    fixed = [c for c in fixed if _holds_any(c.decision.name, layers)] or fixed
    compute_s = sum(graph.choices[n].priced[choice[n]].compute_s for n in graph.order)
    link = offload_link(cluster, target) if target else None
    taken = _cheapest_greedy(walk, cluster, graph.mesh_shape, candidates, fixed, budget, prefetch, compute_s, link)
    if taken is None:
        raise _infeasible(walk, graph, _leanest_keys(candidates), prefetch, budget, target, checkpointing, explain)
    (chosen, keys), (recompute_s, exposed_s) = taken
    peak, time = walk.peak(keys, prefetch, fresh=True)
    breakdown = dict.fromkeys(liveness.KINDS, 0.0)
    spans = walk.last_intervals()  # the fresh curve's: ``intervals(keys, prefetch)``
    for node, kind, start, end, factor in spans:
        if start <= time <= end:
            breakdown[kind] += factor * bytes_of(node)
    segments, moved, entries = _in_order(chosen, walk, graph)
    memory = MemoryPlan(
        target=target or "cpu",
        prefetch=prefetch,
        checkpoint=segments,
        offload=entries,
        offload_activations=moved,
        peak_before_bytes=float(int(before)),
        peak_bytes=float(int(peak)),
        added_s=recompute_s + exposed_s,
    )
    log.info(
        "autopar: memory: %d checkpointed segments, %d with offloaded activations, %d offloaded tensors; "
        "peak %.0f -> %.0f bytes (budget %.0f)",
        len(segments),
        len(moved),
        len(entries),
        before,
        peak,
        budget,
    )
    time_name = walk.timeline.time_name(time) if time < walk.timeline.num_times else ""
    # simulated and sampled only for the plan kept (``sharding._with_memory``), not for every candidate priced
    return memory, MemoryFigures(
        time_name,
        breakdown,
        functools.partial(allocator_peaks, spans, bytes_of, walk.timeline.num_times, cluster),
        functools.partial(_sampled, walk.timeline.names, spans, bytes_of),
    )


def _in_order(chosen: list[_Candidate], walk: _Walk, graph) -> tuple[tuple, tuple, tuple]:
    """The ``chosen`` decisions as the plan lists them: (checkpointed segments, segments whose
    activations move, offloaded tensors), each in graph order (tensors by kind first)."""
    segments = tuple(sorted((c.decision for c in chosen if c.key[0] in _RECOMPUTES), key=lambda s: walk.index[s.first]))
    moved = tuple(sorted((c.decision for c in chosen if c.key[0] == "activations"), key=lambda s: walk.index[s.first]))
    order = {"optimizer_state": 0, "grad": 1, "param": 2}
    entries = tuple(
        sorted(
            (c.decision for c in chosen if c.key[0] not in _LAYER_DECISIONS),
            key=lambda e: (order[e.kind], walk.index.get(_param_node(graph, e.fqn), 0)),
        )
    )
    return segments, moved, entries


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """What a plan reports of its memory under ``plan_memory``'s decisions: when its peak is
    (``time``, ``Timeline.time_name``), what is alive then by kind (``at_peak``), and, each a
    call made only for the plan kept, the caching allocator's peaks (``pricing.reserved``) and
    the sampled timeline (``Plan.memory_timeline``), both of the walk under the decisions."""

    time: str
    at_peak: dict[str, float]
    allocator: Callable[[], Mapping[str, int] | None]
    timeline: Callable[[], dict]


def _sampled(names: tuple[str, ...], spans, bytes_of: Callable[[str], float]) -> dict:
    """``Timeline.sampled`` of the walk's ``spans`` under the decisions (a span that ends before
    it starts holds nothing)."""
    intervals = tuple(liveness.Interval(*span) for span in spans if span[2] <= span[3])
    return liveness.Timeline(names, intervals).sampled(bytes_of)


def _greedy(
    walk: _Walk, candidates: list[_Candidate], fixed: list[_Candidate], budget: float, prefetch: bool
) -> tuple[list[_Candidate], set] | None:
    """``_take``, then ``_drop_unneeded``: the decisions chosen and their keys; None where
    ``candidates`` cannot fit ``budget``."""
    chosen, keys, peak = _take(walk, candidates, fixed, budget, prefetch)
    if peak > budget:
        return None
    return _drop_unneeded(walk, candidates, chosen, keys, budget, prefetch, {c.key for c in fixed})


def _cheapest_greedy(
    walk: _Walk, cluster: ClusterSpec, mesh_shape, candidates, fixed, budget: float, prefetch: bool, compute_s: float, link
) -> tuple[tuple[list[_Candidate], set], tuple[float, float]] | None:
    """``_greedy``'s decisions and what they add (``_added_s``); None where nothing fits. The
    greedy ranks a transfer by its seconds before overlap, and a layer's "selective-op" by its
    average over the bytes a cheaper "selective" would free too: where it took "selective-op"
    (not ``fixed``), the greedy without it (as planned before it was a candidate) wins if it adds less."""
    taken = _greedy(walk, candidates, fixed, budget, prefetch)
    if taken is None:
        return None
    added = _added_s(walk, cluster, mesh_shape, taken[0], compute_s, prefetch, link)
    if not fixed and any(c.key[0] == "selective-op" for c in taken[0]):
        others = [c for c in candidates if c.key[0] != "selective-op"]
        alternative = _greedy(walk, others, fixed, budget, prefetch)
        if alternative is not None:
            other = _added_s(walk, cluster, mesh_shape, alternative[0], compute_s, prefetch, link)
            if sum(other) < sum(added):
                return alternative, other
    return taken, added


def _added_s(
    walk: _Walk, cluster: ClusterSpec, mesh_shape, chosen: list[_Candidate], compute_s: float, prefetch: bool, link
) -> tuple[float, float]:
    """(recompute seconds, exposed transfer and optimizer seconds) that ``chosen`` add to a step."""
    recompute_s = sum(c.cost_s for c in chosen if c.key[0] in _RECOMPUTES)  # the rest are transfers
    switch_s, resident_s = _optimizer_switch_s(walk, cluster, mesh_shape, chosen)
    return recompute_s, _exposed_transfers_s(chosen, compute_s, prefetch, link, resident_s) + switch_s


def _take(
    walk: _Walk, candidates: list[_Candidate], fixed: list[_Candidate], budget: float, prefetch: bool
) -> tuple[list[_Candidate], set, float]:
    """``fixed`` and the candidates taken greedily, cheapest per byte saved first, until the
    peak fits ``budget``: (taken, their keys, the peak then). A layer takes one decision; a
    whole-layer one (recompute all, offload) replaces the selective checkpoint it saves more
    than, unless that one is ``fixed``."""
    chosen = list(fixed)
    keys = {c.key for c in fixed}
    peak, _ = walk.peak(keys, prefetch)
    ranked = sorted(candidates, key=lambda c: (c.cost_s / max(c.saved_bytes, 1.0), c.key))
    for candidate in ranked:
        if peak <= budget:
            break
        if candidate.key in keys:
            continue
        taken = _same_layer(candidate.key, keys)
        if taken is not None:
            if _FREES[candidate.key[0]] <= _FREES[taken[0]] or any(c.key == taken for c in fixed):
                continue
            keys.discard(taken)
            chosen = [c for c in chosen if c.key != taken]
        chosen.append(candidate)
        keys.add(candidate.key)
        peak, _ = walk.peak(keys, prefetch)
    return chosen, keys, peak


def _drop_unneeded(
    walk: _Walk, candidates: list[_Candidate], chosen: list[_Candidate], keys: set, budget: float, prefetch: bool, fixed: set
) -> tuple[list[_Candidate], set]:
    """``chosen`` without the decisions the budget holds without (costliest tried first; never
    one of ``fixed``), and with each offloaded parameter's gradient, which is offloaded with it."""
    for candidate in sorted(chosen, key=lambda c: -c.cost_s):
        if candidate.key in fixed:
            continue
        trial = keys - {candidate.key}
        trial_peak, _ = walk.peak(trial, prefetch)
        if trial_peak <= budget:
            keys = trial
    chosen = [c for c in chosen if c.key in keys]
    by_key = {c.key: c for c in candidates}
    for candidate in list(chosen):
        grad = by_key.get(("grad", candidate.key[1])) if candidate.key[0] == "param" else None
        if grad is not None and grad.key not in keys:
            chosen.append(grad)
            keys.add(grad.key)
    return chosen, keys


def _exposed_transfers_s(
    chosen: list[_Candidate], compute_s: float, prefetch: bool, link: LinkSpec | None, resident_s: float
) -> float:
    """Transfer seconds a step waits for. Without prefetch, all of them. With prefetch, those in
    forward and backward (activations, parameter fetches, gradients written behind) overlap the
    step's compute; those of the optimizer step have little to hide behind: the runtime
    (``runtime.optim.AdamW``) reads each offloaded parameter's tensors (``OPTIMIZER_READS``) on
    the store's one thread before updating it, one parameter ahead, and writes back behind. It
    steps the ``resident_s`` seconds of resident parameters first, behind which the first
    offloaded parameter's read runs."""
    transfer_s = sum(c.cost_s for c in chosen if c.key[0] not in _RECOMPUTES)
    if not prefetch:
        return transfer_s
    reads: dict[str, float] = {}  # per parameter node, in plan order
    if link is not None:
        for c in chosen:
            if c.key[0] in OPTIMIZER_READS:
                reads[c.key[1]] = reads.get(c.key[1], 0.0) + c.saved_bytes / link.bandwidth_bytes_per_s + link.latency_s
    reads_s = sum(reads.values())
    hidden_s = min(next(iter(reads.values()), 0.0), resident_s)
    return max(0.0, transfer_s - reads_s - compute_s) + reads_s - hidden_s


def _optimizer_switch_s(walk: _Walk, cluster: ClusterSpec, mesh_shape, chosen: list[_Candidate]) -> tuple[float, float]:
    """A plan that offloads a parameter, gradient or optimizer state is stepped by
    ``autopar.optim.AdamW``, one parameter at a time: (what that adds to the step's optimizer,
    priced as the plan's optimizer runs (``cost.optimizer.implementation``); the seconds of its resident parameters'
    updates, which it runs first). (0, 0) for a plan that offloads none."""
    offloaded = {c.key[1] for c in chosen if c.key[0] in TRANSFERS}
    if not offloaded:
        return 0.0, 0.0
    intervals = walk.timeline.intervals
    stepped = optimizer.stepped_tensors(intervals, walk.bytes_of)
    resident = optimizer.stepped_tensors([iv for iv in intervals if iv.node not in offloaded], walk.bytes_of)
    priced = optimizer.implementation(cluster, walk.graph.optimizer)
    for_loop_s = optimizer.adamw_step_s(stepped, cluster, "for-loop", mesh_shape)
    switch_s = for_loop_s - optimizer.adamw_step_s(stepped, cluster, priced, mesh_shape)
    return switch_s, optimizer.adamw_step_s(resident, cluster, "for-loop", mesh_shape)


def _same_layer(key: tuple[str, str], keys: set) -> tuple[str, str] | None:
    """The decision in ``keys`` for the layer of ``key`` (a checkpoint of either policy, or its
    offloaded activations), if any."""
    if key[0] not in _LAYER_DECISIONS:
        return None
    for kind in _LAYER_DECISIONS:
        if (kind, key[1]) in keys:
            return (kind, key[1])
    return None


def _leanest_keys(candidates: list[_Candidate]) -> set:
    """Every candidate but a layer's decisions that free less than another of that layer (a
    selective checkpoint where the layer has a whole-layer one): what the greedy has taken when
    nothing is left to take."""
    most: dict[str, int] = {}
    for c in candidates:
        if c.key[0] in _LAYER_DECISIONS:
            most[c.key[1]] = max(most.get(c.key[1], -1), _FREES[c.key[0]])
    return {c.key for c in candidates if c.key[0] not in _LAYER_DECISIONS or _FREES[c.key[0]] == most[c.key[1]]}


def _param_node(graph, fqn: str) -> str:
    for name, c in graph.choices.items():
        if c.kind == "param" and c.fqn == fqn:
            return name
    return fqn


def _holds_any(layer: str, modules: tuple[str, ...]) -> bool:
    """Whether the layer of FQN ``layer`` is, holds or lies inside one of ``modules`` (any where
    there are none)."""
    return not modules or any(m == layer or m.startswith(layer + ".") or layer.startswith(m + ".") for m in modules)


def _candidates(walk: _Walk, graph, choice, cluster, target, checkpointing, policy: str | None = None) -> list[_Candidate]:
    """Every decision ``plan_memory`` may take, priced; with a ``policy``, the checkpoints of
    that policy only."""
    out: list[_Candidate] = []
    link = offload_link(cluster, target) if target else None
    policies = (policy,) if policy is not None else (("full", "selective", "selective-op") if checkpointing else ())
    if policies or link is not None:
        for index, ((name, first, last), terms) in enumerate(zip(walk.segments, walk.segment_terms())):
            # per policy: bytes freed and forward seconds run again ("full": all of it)
            saved = {"full": 0.0, "selective": 0.0, "selective-op": 0.0}
            forward_s = dict(saved)
            num_ops = sum(1 for _, divisor, *_ in terms if divisor is not None)  # ops that save for backward
            for node, divisor, freed, keeps, keeps_op, held in terms:
                seconds = graph.choices[node].priced[choice[node]].compute_s
                if divisor is not None:
                    seconds /= divisor
                size = walk.bytes_of(node)
                for kind, kept in (("full", False), ("selective", keeps), ("selective-op", keeps_op)):
                    forward_s[kind] += 0.0 if kept else seconds
                    if freed is not None and not kept:
                        saved[kind] += size * freed
                    if held is not None and kept:
                        saved[kind] -= size * held
            if saved["full"] <= 0:
                continue
            first_name, last_name = walk.timeline.names[first], walk.timeline.names[last]
            for kind in policies:
                if saved[kind] <= 0 or (policy is None and kind == "selective-op" and saved[kind] <= saved["selective"]):
                    continue  # frees nothing (a layer without matmuls: nothing more than "selective")
                seconds = segment_recompute_s(cluster.rates, forward_s[kind], num_ops, kind)
                segment = CheckpointSegment(name, first_name, last_name, saved[kind], seconds, kind)
                out.append(_Candidate((_POLICY_KEY[kind], str(index)), saved[kind], seconds, segment))
            if link is not None:  # written in forward, read in backward
                seconds = 2 * saved["full"] / link.bandwidth_bytes_per_s + 2 * link.latency_s
                segment = CheckpointSegment(name, first_name, last_name, saved["full"], seconds)
                out.append(_Candidate(("activations", str(index)), saved["full"], seconds, segment))
    if link is None:
        return out
    for iv in walk.timeline.intervals:
        if iv.kind not in TRANSFERS:
            continue
        c = graph.choices[iv.node]
        if iv.kind == "param" and not walk.uses.get(iv.node) or padded_choice(c, choice[iv.node], graph.mesh_shape):
            continue  # (the offload store keeps equal shards only: runtime.padded)
        size = iv.factor * walk.bytes_of(iv.node)
        if size <= 0:
            continue
        moved = TRANSFERS[iv.kind] * size
        seconds = moved / link.bandwidth_bytes_per_s + TRANSFERS[iv.kind] * link.latency_s
        entry = OffloadEntry(iv.kind, c.fqn or iv.node, size, moved, seconds)
        out.append(_Candidate((iv.kind, iv.node), size, seconds, entry))
    return out


def _infeasible(
    walk: _Walk | None, graph, keys, prefetch, budget, target, checkpointing, explain: bool = True
) -> InfeasibleError:
    if not explain:
        return InfeasibleError(f"no plan of this sharding fits memory_budget={budget:.0f} bytes per device")
    peak, time = walk.peak(keys, prefetch, fresh=True)
    alive = []
    for node, kind, start, end, factor in walk.intervals(keys, prefetch):
        if start <= time <= end:
            owner = graph.choices.get(node.removeprefix(GATHERED))
            alive.append((factor * walk.bytes_of(node), kind, (owner.fqn if owner is not None else None) or node))
    alive.sort(reverse=True)
    lines = "\n".join(f"    {kind} {name}: {size / 2**20:.1f} MiB" for size, kind, name in alive[:5])
    if any(kind == "optimizer_temporary" for _, kind, _ in alive):
        lines += (
            "\n  (optimizer_temporary: torch's default foreach AdamW holds half its state again while it steps;"
            " offload or autopar.optim.AdamW steps one parameter at a time instead)"
        )
    lines += mesh_hint(graph, [name for _, kind, name in alive[:5] if kind in ("param", "grad", "optimizer_state")])
    allowed = ("checkpointing every layer" if checkpointing else "no checkpointing") + (
        f" and offloading every parameter, gradient, optimizer state and layer's activations to {target}"
        if target
        else ", no offload"
    )
    return InfeasibleError(
        f"no plan fits memory_budget={budget:.0f} bytes ({budget / 2**20:.1f} MiB) per device on mesh "
        f"{graph.mesh_shape}, even with {allowed}.\n  The leanest plan needs {peak:.0f} bytes "
        f"({peak / 2**20:.1f} MiB) per device, at {walk.timeline.time_name(time)}.\n"
        f"  Largest tensors alive there:\n{lines}\n"
        "  Raise the budget, use a larger mesh, or reduce the batch size or sequence length"
        + (
            ", or use precision='bf16-mixed'."
            if target
            else '; offload="auto" (`autopar plan ... --offload auto`) would also offload to host memory or disk.'
        )
    )


__all__ = ["plan_memory", "LayerPolicy", "MemoryFigures", "offload_link", "TRANSFERS"]
