"""Communication cost: an alpha-beta model per mesh axis, with ring (and tree) algorithms.

On mesh axis ``axis`` a collective runs among ``k = mesh_shape[axis]`` ranks over the link that
``ClusterSpec.axis_link`` picks, with latency ``α`` (s) and bandwidth ``β`` (bytes/s). ``bytes``
is the size of the whole tensor each rank holds (as named in each function). With ``k == 1``
every cost is 0.

=====================  ===================================  ==================================
collective             time (s)                             bytes each device sends
=====================  ===================================  ==================================
all-reduce (ring)      2(k-1)·α + 2(k-1)/k · bytes/β        2(k-1)/k · bytes
all-gather             (k-1)·α + (k-1)/k · bytes_out/β      (k-1)/k · bytes_out
reduce-scatter         (k-1)·α + (k-1)/k · bytes_in/β       (k-1)/k · bytes_in
all-to-all             (k-1)·α + (k-1)/k · bytes/β          (k-1)/k · bytes
send/recv              α + bytes/β                          bytes (the sender)
chunk (local slice)    0                                    0
=====================  ===================================  ==================================

**All-reduce picks the cheaper of ring and tree** on a cluster whose collectives run on NCCL (every
cluster but a gloo one, ``ClusterSpec.gloo``), as NCCL's tuner does: it prices each algorithm for the
message and runs the fastest (NCCL ``src/graph/tuning.cc``, ``ncclTopoTuneModel`` and
``ncclTopoGetAlgoTime``; the tree is offered for all-reduce only, other collectives run on the ring).
NCCL's tree is a chain through the group's ``p`` ranks in each node and a double binary tree across
its ``m`` nodes, walked up (reduce) then down (broadcast), pipelined, at half the bus bandwidth::

    tree all-reduce   2·((p-1)·α_intra + floor(log2 m)·α) + 2/0.9 · bytes/β

(NCCL: latency ``2·((nRanks/nNodes-1)·intraLat + log2i(nNodes)·interLat)``, algorithm bandwidth
``busBw · 0.5`` with the tree's bus bandwidth 0.9× the ring's, ``TREE_BANDWIDTH_FRACTION``; the
ring's algorithm bandwidth is ``busBw · nRanks / (2(nRanks-1))``.) Inside one node (``m = 1``) the
tree's latency equals the ring's and its bandwidth term is larger, so the ring always wins there;
across many nodes the tree's log-depth latency wins up to large messages (the crossover grows
with ``k``). NCCL's other refinements (per-size tree correction factors, the LL/LL128 protocols,
a hierarchical ring latency) are left out. gloo's all-reduce (what ``ProcessGroupGloo`` runs on
CPU tensors) is a ring (gloo ``allreduce.cc``: an unspecified algorithm runs ``ring``), so gloo
clusters keep the ring formula. ``bytes_sent`` counts the ring's volume for every all-reduce
(the tree's, about 2·bytes, is priced in its time only).

``transition_cost`` prices exactly the steps of ``autopar.ir.spec.transition_steps``, so what is
priced is what the collectives pass inserts. The backward of each step is its dual under the
replicated-loss convention (see ``autopar.ops.collectives``): all-reduce → nothing; reduce-scatter →
all-gather; all-gather → nothing (keep the local chunk); chunk → all-gather; all-to-all →
all-to-all back.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from autopar.cost.cluster import ClusterSpec, LinkSpec
from autopar.errors import InternalError
from autopar.ir.options import CommOptions
from autopar.ir.spec import (
    KIND_SHARD,
    REPLICATE_KEY,
    STEP_KINDS,
    PlacementNumbers,
    R,
    Routes,
    Spec,
    key_local_shape,
    local_shape,
    numbered_elements,
    padded_transition_ok,
    placement_key,
    routes_between,
    slot_axis,
    spec_key,
    steps_between,
    transition_steps,
)


@dataclass(frozen=True, slots=True)
class CommCost:
    """Seconds spent communicating in forward and in backward, and the bytes each device sends
    (forward and backward together)."""

    forward_s: float
    backward_s: float
    bytes_sent: float
    # (mesh axis, bytes sent on it), sorted by axis: ``bytes_sent`` split by the axis it crosses
    bytes_per_axis: tuple[tuple[int, float], ...] = ()

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    def __add__(self, other: CommCost) -> CommCost:
        per_axis = dict(self.bytes_per_axis)
        for axis, sent in other.bytes_per_axis:
            per_axis[axis] = per_axis.get(axis, 0.0) + sent
        return CommCost(
            self.forward_s + other.forward_s,
            self.backward_s + other.backward_s,
            self.bytes_sent + other.bytes_sent,
            tuple(sorted(per_axis.items())),
        )


ZERO = CommCost(0.0, 0.0, 0.0)

# A parameter gradient is reduced in a bucket with others (``ops.buckets``).
DEFAULT_BUCKET_CAP_BYTES = CommOptions().bucket_cap_bytes
# Bytes of summed gradients a pipeline's held sync all-reduces in one collective
# (``runtime.held_sync``); the stage planner prices its last bucket as exposed.
HELD_BUCKET_BYTES = 32 * 2**20
# The bus bandwidth NCCL's tree reaches, as a fraction of the ring's (``tuning.cc``:
# ``busBw = min(busBw * .9, maxTreeBw)``; .92 in NCCL 2.19+).
TREE_BANDWIDTH_FRACTION = 0.9


def _axis(axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> tuple[int, LinkSpec]:
    return mesh_shape[axis], cluster.axis_link(mesh_shape, axis)


def tree_latency_s(axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> float:
    """The latency of NCCL's tree all-reduce on ``axis`` (module docstring): 2·((p-1)·α_intra +
    floor(log2 m)·α), with ``p`` of the group's ranks on each of ``m`` nodes (ranks laid out as
    ``ClusterSpec.axis_link`` says) and ``α`` the axis's link."""
    k, link = _axis(axis, mesh_shape, cluster)
    stride = math.prod(mesh_shape[axis + 1 :])  # rank distance between neighbours of one group
    per_node = max(1, min(k, cluster.devices_per_node // stride))
    nodes = -(-k // per_node)
    intra = cluster.intra_node.latency_s / cluster.compute_share(mesh_shape) if nodes > 1 else link.latency_s
    return 2 * ((per_node - 1) * intra + (nodes.bit_length() - 1) * link.latency_s)


def all_reduce_terms(num_bytes: float, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> tuple[float, float]:
    """(latency s, bandwidth factor f) of the all-reduce a ``num_bytes`` message runs on ``axis``:
    it takes latency + f · bytes/β. The ring (2(k-1)·α, f = 2(k-1)/k), or on an NCCL cluster the
    tree (``tree_latency_s``, f = 2 / ``TREE_BANDWIDTH_FRACTION``) where that is cheaper for
    ``num_bytes``; on a tie, the ring."""
    k, link = _axis(axis, mesh_shape, cluster)
    ring = (2 * (k - 1) * link.latency_s, 2 * (k - 1) / k)
    if k == 1 or cluster.gloo:
        return ring
    tree = (tree_latency_s(axis, mesh_shape, cluster), 2.0 / TREE_BANDWIDTH_FRACTION)
    if tree[0] + tree[1] * num_bytes / link.bandwidth_bytes_per_s < ring[0] + ring[1] * num_bytes / link.bandwidth_bytes_per_s:
        return tree
    return ring


def all_reduce_s(num_bytes: float, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> float:
    """All-reduce of a ``num_bytes`` tensor: the ring's 2(k-1)·α + 2(k-1)/k · bytes/β, or on an
    NCCL cluster the tree's where cheaper (``all_reduce_terms``, the module docstring)."""
    k, link = _axis(axis, mesh_shape, cluster)
    if k == 1:
        return 0.0
    latency, factor = all_reduce_terms(num_bytes, axis, mesh_shape, cluster)
    return latency + factor * num_bytes / link.bandwidth_bytes_per_s


def bucket_latency_s(
    axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec, bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_BYTES
) -> float:
    """The latency one full gradient bucket (``bucket_cap_bytes``) pays on ``axis``: that of the
    algorithm ``all_reduce_terms`` picks at the bucket's size; 0 with one rank."""
    if mesh_shape[axis] == 1:
        return 0.0
    return all_reduce_terms(bucket_cap_bytes, axis, mesh_shape, cluster)[0]


def all_gather_s(num_bytes_out: float, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> float:
    """Ring all-gather producing ``num_bytes_out`` per rank: (k-1)·α + (k-1)/k · bytes_out/β."""
    k, link = _axis(axis, mesh_shape, cluster)
    if k == 1:
        return 0.0
    return (k - 1) * link.latency_s + (k - 1) / k * num_bytes_out / link.bandwidth_bytes_per_s


def reduce_scatter_s(num_bytes_in: float, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> float:
    """Ring reduce-scatter of ``num_bytes_in`` per rank: (k-1)·α + (k-1)/k · bytes_in/β."""
    k, link = _axis(axis, mesh_shape, cluster)
    if k == 1:
        return 0.0
    return (k - 1) * link.latency_s + (k - 1) / k * num_bytes_in / link.bandwidth_bytes_per_s


def all_to_all_s(num_bytes: float, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> float:
    """All-to-all of a ``num_bytes`` local tensor: (k-1)·α + (k-1)/k · bytes/β."""
    k, link = _axis(axis, mesh_shape, cluster)
    if k == 1:
        return 0.0
    return (k - 1) * link.latency_s + (k - 1) / k * num_bytes / link.bandwidth_bytes_per_s


_COST_FNS = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}

_SENT_FRACTION = {
    "all_reduce": lambda k: 2 * (k - 1) / k,
    "all_gather": lambda k: (k - 1) / k,
    "reduce_scatter": lambda k: (k - 1) / k,
    "all_to_all": lambda k: (k - 1) / k,
    "send_recv": lambda k: 1.0 if k > 1 else 0.0,
    "chunk": lambda k: 0.0,
}


def bytes_sent(kind: str, num_bytes: float, k: int) -> float:
    """Bytes each device sends in one collective over ``k`` ranks (see the module table).

    ``num_bytes`` is the same size the matching ``*_s`` function takes: the output for
    all-gather, the input for reduce-scatter, the tensor for all-reduce and all-to-all.
    """
    if kind not in _SENT_FRACTION:
        raise InternalError(f"unknown collective {kind!r}: expected one of {sorted(_SENT_FRACTION)}")
    if k < 1:
        raise InternalError(f"a group has at least one rank, got k={k}")
    return _SENT_FRACTION[kind](k) * num_bytes


def _bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _walk(src: Spec, dst: Spec, global_shape: Sequence[int], dtype: torch.dtype, mesh_shape: Sequence[int]):
    """Each step of ``transition_steps(src, dst)`` with its forward and backward collectives,
    sized at the local bytes of the tensor just before it; nothing when it is impossible."""
    current = list(src)
    for step in transition_steps(src, dst) or ():
        local_bytes = _bytes(local_shape(global_shape, tuple(current), mesh_shape), dtype)
        yield step, _step_collectives(step.kind, local_bytes, mesh_shape[step.axis])
        current[step.axis] = dst[step.axis] if step.kind not in ("all_reduce", "all_gather") else R


def transition_cost(
    src: Spec,
    dst: Spec,
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    requires_grad: bool,
    grad_dtype: torch.dtype | None = None,
) -> CommCost | None:
    """The cost of resharding a ``global_shape`` tensor from ``src`` to ``dst``, or None when
    ``transition_steps`` says it is impossible.

    Each step is priced at the local size of the tensor just before it. Backward costs (the
    dual of each step, see the module docstring) are counted only when ``requires_grad``, in
    ``grad_dtype`` where the gradient is reduced in another dtype than the value (a precision
    policy's ``reduce_dtype``).
    """
    steps = transition_steps(src, dst)
    if steps is None or steps and not padded_transition_ok(global_shape, src, dst, mesh_shape):
        return None
    if not steps:
        return ZERO
    # One walk prices both directions (``_walk``'s sizes; sums in step order, as ``CommCost.__add__``).
    itemsize, grad_itemsize = dtype.itemsize, (grad_dtype or dtype).itemsize
    forward_total = backward_total = sent_total = 0.0
    per_axis: dict[int, float] = {}
    current = list(src)

    def price(collective: Collective, axis: int) -> tuple[float, float]:
        return _price(collective, axis, mesh_shape, cluster)

    for step in steps:
        elements = math.prod(local_shape(global_shape, tuple(current), mesh_shape))
        forward_s, backward_s, sent = _step_cost(
            step.kind, step.axis, elements, (itemsize, grad_itemsize), mesh_shape, requires_grad, price
        )
        forward_total += forward_s
        backward_total += backward_s
        sent_total += sent
        if sent:
            per_axis[step.axis] = per_axis.get(step.axis, 0.0) + sent
        current[step.axis] = _after_step(step, dst)
    return CommCost(forward_total, backward_total, sent_total, tuple(sorted(per_axis.items())))


class TransitionPrices:
    """``transition_cost``'s (forward + backward seconds, bytes sent) on one mesh and cluster, for
    many (src, dst, shape) at once, the same floats in the same order: a pair's steps and the
    specs before each step are worked out once per pair, each spec's local element count once
    per (shape, spec), and each collective's price once per (kind, bytes, axis). Pricing the
    edges of a 3-axis mesh asks for tens of thousands of (pair, shape) (``solver.problem.edges``).
    Specs are passed with their codes (ints the caller numbers them by, one per distinct spec and
    one spec per code: a code's spec is read once, ``spec.spec_key``). ``price_pairs`` prices
    many pairs of one shape at once with numpy, specs as rows of placement numbers (``numbered``):
    a hub table's ~10^5 near pairs on a 4-axis mesh."""

    def __init__(self, mesh_shape: Sequence[int], cluster: ClusterSpec):
        self.mesh_shape, self.cluster = tuple(mesh_shape), cluster
        self._routes: dict[tuple[int, int], tuple | None] = {}
        self._keys: dict[int, tuple] = {}  # ``spec_key`` of each spec by its code
        self._codes: dict[tuple, int] = {}  # the keys of the specs a tensor is in before a step, numbered
        self._before: dict[int, tuple] = {}  # and back
        self._elements: dict[tuple, int] = {}
        self._collectives: dict[tuple, tuple[float, float]] = {}
        self._steps: dict[tuple, tuple[float, float, float]] = {}  # ``_step_cost`` by its arguments
        self.numbers = PlacementNumbers()  # of ``numbered`` and ``price_pairs``
        self._placements: dict[int, int] = {}  # ``numbered``: by a placement's id, its number
        self._kept: list = []  # and the placements, alive
        self._slots: dict[tuple, dict[int, tuple[float, float, float]]] = {}  # ``_slot_prices``'

    def _route(self, src: Spec, dst: Spec, key: tuple[int, int]) -> tuple | None:
        """The steps from ``src`` to ``dst`` (codes ``key``) as (kind, axis, code of the spec
        before it); by the specs' keys (``spec.steps_between``), each spec's read once."""
        route = self._routes.get(key, _UNSEEN)
        if route is _UNSEEN:
            keys = self._keys
            src_key = keys.get(key[0])
            if src_key is None:
                src_key = keys[key[0]] = spec_key(src)
            dst_key = keys.get(key[1])
            if dst_key is None:
                dst_key = keys[key[1]] = spec_key(dst)
            # Specs of other lengths: ``transition_steps`` says so.
            steps = steps_between(src_key, dst_key) if len(src_key) == len(dst_key) else transition_steps(src, dst)
            if steps is None:
                route = None
            else:
                route, current = [], list(src_key)
                for step in steps:
                    before = tuple(current)
                    code = self._codes.setdefault(before, len(self._codes))
                    self._before.setdefault(code, before)
                    route.append((step.kind, step.axis, code))
                    current[step.axis] = _after_step(step, dst_key, REPLICATE_KEY)
                route = tuple(route)
            self._routes[key] = route
        return route

    def _price(self, collective: Collective, axis: int) -> tuple[float, float]:
        if collective is None:
            return 0.0, 0.0
        key = (collective, axis)
        found = self._collectives.get(key)
        if found is None:
            found = self._collectives[key] = _price(collective, axis, self.mesh_shape, self.cluster)
        return found

    def price(
        self,
        src: Spec,
        dst: Spec,
        codes: tuple[int, int],
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        requires_grad: bool,
        grad_dtype: torch.dtype | None = None,
    ) -> tuple[float, float] | None:
        """(``transition_cost(...).total_s``, its ``bytes_sent``), or None where it is None."""
        route = self._route(src, dst, codes)
        if route is None or route and not padded_transition_ok(global_shape, src, dst, self.mesh_shape):
            return None
        itemsizes = (dtype.itemsize, (grad_dtype or dtype).itemsize)
        forward_total = backward_total = sent_total = 0.0
        mesh_shape = self.mesh_shape
        for kind, axis, code in route:
            elements = self._elements.get((global_shape, code))
            if elements is None:
                before = self._before[code]
                elements = self._elements[(global_shape, code)] = math.prod(key_local_shape(global_shape, before, mesh_shape))
            forward_s, backward_s, sent = self._step(kind, axis, elements, itemsizes, requires_grad)
            forward_total += forward_s
            backward_total += backward_s
            sent_total += sent
        return forward_total + backward_total, sent_total

    def numbered(self, spec: Spec) -> tuple[int, ...]:
        """``spec``'s placements as numbers (``spec.PlacementNumbers``), rows of which
        ``price_pairs`` takes. Each placement object is read once (a plan has a few hundred, in
        ~10^5 specs): by its identity, and kept alive so that its identity is not reused."""
        placements = self._placements
        try:
            return tuple([placements[id(placement)] for placement in spec])
        except KeyError:
            for placement in spec:
                if id(placement) not in placements:
                    placements[id(placement)] = self.numbers.number(placement_key(placement))
                    self._kept.append(placement)
            return tuple([placements[id(placement)] for placement in spec])

    def price_pairs(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        global_shape: tuple[int, ...],
        dtype: torch.dtype,
        requires_grad: bool,
        grad_dtype: torch.dtype | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``price`` of each (``src[k]``, ``dst[k]``), rows of ``numbered``, with numpy: whether it
        is possible, its seconds and its bytes sent (0 where not possible). The same floats as
        ``price``: each step's price is ``_step_cost``'s, and the steps are summed slot by slot in
        their order (a slot with no step adds 0.0, which changes no sum)."""
        routes = routes_between(src, dst, self.numbers)
        itemsizes = (dtype.itemsize, (grad_dtype or dtype).itemsize)
        slots, count = routes.kinds.shape
        forward, backward, sent = np.zeros(count), np.zeros(count), np.zeros(count)
        states = routes.base ** len(self.mesh_shape)
        for slot in range(slots):
            kinds = routes.kinds[slot]
            if not kinds.any():
                continue
            keys = kinds.astype(np.int64) * states + routes.before[slot]
            axis = slot_axis(slot, len(self.mesh_shape))
            table, index = self._slot_prices(keys, routes, axis, global_shape, itemsizes, requires_grad)
            forward += table[0][index]
            backward += table[1][index]
            sent += table[2][index]
        return routes.possible & self._padded_ok(src, dst, global_shape), forward + backward, sent

    def padded_axes(self, src: np.ndarray, global_shape: tuple[int, ...]) -> np.ndarray | None:
        """Per row of ``src`` (numbered specs of a ``global_shape`` tensor) and mesh axis, whether
        the row is a padded parameter shard on that axis (``spec.padded_axis``: ``Shard(0)`` on one
        axis that does not divide dim 0, ``R`` or a shard of another dim on the others; ``R`` is
        number 0); None where every axis divides dim 0."""
        uneven = [axis for axis, size in enumerate(self.mesh_shape) if size > 1 and global_shape and global_shape[0] % size]
        if not uneven:
            return None
        kinds, dims = self.numbers.arrays()
        src_kinds, src_dims = kinds[src], dims[src]
        # per axis: R, or a plain shard of a dim other than 0 (no other cut of dim 0)
        beside = (src == 0) | ((src_kinds == KIND_SHARD) & (src_dims != 0))
        padded = np.zeros(src.shape, dtype=bool)
        for axis in uneven:
            others = np.delete(beside, axis, axis=1).all(axis=1)
            padded[:, axis] = (src_kinds[:, axis] == KIND_SHARD) & (src_dims[:, axis] == 0) & others
        return padded

    def _padded_ok(self, src: np.ndarray, dst: np.ndarray, global_shape: tuple[int, ...]) -> np.ndarray | bool:
        """``spec.padded_transition_ok`` of each pair (rows of ``numbered``): a padded parameter
        shard (``padded_axes``) goes only to ``R`` on its axis, the others as they are."""
        padded = self.padded_axes(src, global_shape)
        if padded is None:
            return True
        same = src == dst
        refused = np.zeros(len(src), dtype=bool)
        for axis in np.flatnonzero(padded.any(axis=0)):
            gathered_here = (dst[:, axis] == 0) & np.delete(same, axis, axis=1).all(axis=1)
            refused |= padded[:, axis] & ~gathered_here
        return ~refused | same.all(axis=1)

    def _slot_prices(
        self, keys: np.ndarray, routes: Routes, axis: int, global_shape: tuple, itemsizes: tuple[int, int], requires_grad: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        """The (forward, backward, sent) of each distinct step that ``keys`` name (kind · states +
        the placements before it, ``routes.before``; 0: none), and each key's index among them."""
        base = routes.base
        states = base ** len(self.mesh_shape)
        if len(STEP_KINDS) * states <= 1 << 22:  # each key marked in a mask: no sort
            present = np.zeros(len(STEP_KINDS) * states, dtype=bool)
            present[keys] = True
            distinct = np.flatnonzero(present)
            index = np.zeros(len(present), dtype=np.int64)
            index[distinct] = np.arange(len(distinct))
            index = index[keys]
        else:
            distinct, index = np.unique(keys, return_inverse=True)
        # Each step's price once per (shape, sizes, grad, axis) and numbering, across calls.
        known = self._slots.setdefault((global_shape, itemsizes, requires_grad, axis, base), {0: (0.0, 0.0, 0.0)})
        distinct = distinct.tolist()
        missing = np.array([key for key in distinct if key not in known], dtype=np.int64)
        if len(missing):
            elements = numbered_elements(global_shape, missing % states, base, self.numbers, self.mesh_shape)
            for key, kind, count in zip(missing.tolist(), (missing // states).tolist(), elements.tolist()):
                known[key] = self._step(STEP_KINDS[kind], axis, count, itemsizes, requires_grad)
        return np.array([known[key] for key in distinct]).reshape(len(distinct), 3).T, index

    def _step(
        self, kind: str, axis: int, elements: int, itemsizes: tuple[int, int], requires_grad: bool
    ) -> tuple[float, float, float]:
        """``_step_cost`` of one step, once per arguments."""
        key = (kind, axis, elements, itemsizes, requires_grad)
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = _step_cost(kind, axis, elements, itemsizes, self.mesh_shape, requires_grad, self._price)
        return step


_UNSEEN = object()


def _step_cost(
    kind: str,
    axis: int,
    elements: int,
    itemsizes: tuple[int, int],
    mesh_shape: Sequence[int],
    requires_grad: bool,
    price: Callable[[Collective, int], tuple[float, float]],
) -> tuple[float, float, float]:
    """(forward seconds, backward seconds, bytes sent) of one transition step on a tensor of
    ``elements`` local elements (``itemsizes``: the value's and its gradient's), each collective
    priced by ``price(collective, axis)``: what ``transition_cost`` and ``TransitionPrices`` sum."""
    forward, _ = _step_collectives(kind, elements * itemsizes[0], mesh_shape[axis])
    forward_s, sent = price(forward, axis)
    backward_s = 0.0
    if requires_grad:
        _, backward = _step_collectives(kind, elements * itemsizes[1], mesh_shape[axis])
        backward_s, backward_sent = price(backward, axis)
        sent = sent + backward_sent
    return forward_s, backward_s, sent


def _after_step(step, dst: Sequence, replicated=R):
    """The placement on ``step.axis`` once ``step`` of a transition to ``dst`` is done: the
    target's, or ``replicated`` after a reduction or a gather (``R``; ``REPLICATE_KEY`` where
    ``dst`` is a ``spec_key``)."""
    return dst[step.axis] if step.kind not in ("all_reduce", "all_gather") else replicated


def transition_bytes_per_axis(
    src: Spec,
    dst: Spec,
    global_shape: Sequence[int],
    dtype: torch.dtype,
    mesh_shape: Sequence[int],
    requires_grad: bool,
    grad_dtype: torch.dtype | None = None,
) -> dict[int, float]:
    """Bytes each device sends on each mesh axis for ``transition_cost``'s steps (forward, and
    backward when ``requires_grad``, in ``grad_dtype`` if given); empty when nothing is sent or
    the transition is impossible."""
    per_axis: dict[int, float] = {}
    backwards = [b for _, (_, b) in _walk(src, dst, global_shape, grad_dtype or dtype, mesh_shape)]
    for (step, (forward, _)), backward in zip(_walk(src, dst, global_shape, dtype, mesh_shape), backwards):
        k = mesh_shape[step.axis]
        for collective in (forward, backward if requires_grad else None):
            if collective is not None and k > 1:
                per_axis[step.axis] = per_axis.get(step.axis, 0.0) + bytes_sent(collective[0], collective[1], k)
    return per_axis


Collective = tuple[str, float] | None  # (kind, the byte size its cost function takes), or nothing


def _step_collectives(kind: str, local_bytes: int, k: int) -> tuple[Collective, Collective]:
    """The forward collective of one step and the backward one (its dual), each with the byte
    size that its ``*_s`` function takes; ``local_bytes`` is the local size before the step."""
    if kind == "all_reduce":  # P → R; backward: identity
        return ("all_reduce", local_bytes), None
    if kind == "reduce_scatter":  # P → S; backward all-gathers the gradient to the input's size
        return ("reduce_scatter", local_bytes), ("all_gather", local_bytes)
    if kind == "all_gather":  # S → R, output k times larger; backward keeps the local chunk
        return ("all_gather", local_bytes * k), None
    if kind == "chunk":  # R → S, local; backward all-gathers the gradient to the input's size
        return None, ("all_gather", local_bytes)
    if kind == "all_to_all":  # S(a) → S(b), same local size; backward: the reverse all-to-all
        return ("all_to_all", local_bytes), ("all_to_all", local_bytes)
    raise AssertionError(f"unhandled step kind {kind!r}")


def _price(collective: Collective, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> tuple[float, float]:
    """(seconds, bytes each device sends) of one collective on ``axis``."""
    if collective is None:
        return 0.0, 0.0
    kind, num_bytes = collective
    seconds = _COST_FNS[kind](num_bytes, axis, mesh_shape, cluster)
    return seconds, bytes_sent(kind, num_bytes, mesh_shape[axis])


def grad_allreduce_cost(
    global_shape: Sequence[int],
    spec_of_input: Spec,
    axis: int,
    dtype: torch.dtype,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
) -> CommCost:
    """The backward all-reduce on ``axis`` of the gradient of a tensor held as ``spec_of_input``
    (``allreduce_grad``: a replicated input feeding work split on that axis, or a replicated
    parameter's gradient). Nothing happens in forward."""
    local_bytes = _bytes(local_shape(global_shape, spec_of_input, mesh_shape), dtype)
    k = mesh_shape[axis]
    sent = bytes_sent("all_reduce", local_bytes, k)
    return CommCost(
        forward_s=0.0,
        backward_s=all_reduce_s(local_bytes, axis, mesh_shape, cluster),
        bytes_sent=sent,
        bytes_per_axis=((axis, sent),) if sent else (),
    )


def param_grad_sync_cost(
    global_shape: Sequence[int],
    spec_of_input: Spec,
    axis: int,
    dtype: torch.dtype,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    bucket_cap_bytes: float = DEFAULT_BUCKET_CAP_BYTES,
) -> CommCost:
    """A parameter gradient's share of the bucketed all-reduce on ``axis`` that the runtime
    runs (``ops.buckets``): its bandwidth term, and the latency of one bucket per
    ``bucket_cap_bytes`` (a bucket pays its latency once for all its members): on the ring
    2(k-1)·α·bytes/cap + 2(k-1)/k · bytes/β; the algorithm (``all_reduce_terms``) is the one the
    bucket runs, picked at its size (the cap, or the gradient where that is larger). Whether
    backward compute hides it is priced over the whole step (``exposed_grad_sync_s``), not here."""
    local_bytes = _bytes(local_shape(global_shape, spec_of_input, mesh_shape), dtype)
    k, link = _axis(axis, mesh_shape, cluster)
    sent = bytes_sent("all_reduce", local_bytes, k)
    if k == 1:
        return ZERO
    latency, factor = all_reduce_terms(max(local_bytes, bucket_cap_bytes), axis, mesh_shape, cluster)
    seconds = latency * min(1.0, local_bytes / bucket_cap_bytes) + factor * local_bytes / link.bandwidth_bytes_per_s
    return CommCost(0.0, seconds, sent, ((axis, sent),) if sent else ())


def exposed_grad_sync_s(sync_s: float, backward_compute_s: float, last_bucket_s: float) -> float:
    """Seconds of bucketed gradient reductions that backward compute does not hide.

    Buckets launch as backward produces their gradients and run one after another, so at best
    all but the last bucket hide behind the backward compute still to run; the last one
    (launched when backward ends) is always exposed:
    max(last bucket, total − backward compute)."""
    return max(min(last_bucket_s, sync_s), sync_s - backward_compute_s, 0.0)


def copy_s(nbytes: float, cluster: ClusterSpec) -> float:
    """Seconds of copies that read and write ``nbytes`` in all (each byte counted once per read and
    once per write), memory-bound at the achieved bandwidth, on the compute stream: the flat
    buffers around the runtime's collectives (``ops.buckets``)."""
    efficiency = cluster.rates.memory_efficiency if cluster.rates is not None else 1.0
    return nbytes / (cluster.memory_bandwidth_bytes_per_s * efficiency)


def bucket_copy_s(grad_bytes: float, cluster: ClusterSpec) -> float:
    """Seconds of copying a gradient of ``grad_bytes`` into its all-reduce bucket (``ops.buckets.
    GradBuckets.add``, as DDP copies into its buckets and FSDP2 into its reduce-scatter input), on
    the compute stream; 0 on gloo, whose measured prices hold the host's copies (docs/cost-model.md)."""
    return 0.0 if cluster.gloo else copy_s(2 * grad_bytes, cluster)


def exposed_gathers_s(gather_s: float, first_gather_s: float, forward_compute_s: float) -> float:
    """Seconds of FSDP's forward all-gathers that forward compute does not hide.

    Each layer's group is gathered one group ahead on the communication stream (FSDP2's forward
    prefetch; autopar's ``passes.schedule``), so every gather but the first runs while an earlier
    group computes, one after another on the link. The first group's waits with nothing before
    it: first + max(0, rest − forward compute). Per layer, a gather longer than its layer's
    compute would show more; with repeated layers the totals say the same."""
    return first_gather_s + max(0.0, gather_s - first_gather_s - forward_compute_s)


def context_parallel_collectives(
    kv_bytes: float, rows_bytes: float, axes: Sequence[int], balanced: bool, mesh_shape: Sequence[int], requires_grad: bool
) -> list[tuple[str, float, int]]:
    """The context-parallel attention kernel's own collectives (``ops.attention``), as
    ``(kind, num_bytes, axis)`` in the sizes the ``*_s`` functions take; nothing overlaps them.

    - K and V (``kv_bytes``: both, local) are all-gathered along the sequence on each of
      ``axes``, innermost first, so each gather's output is the previous one's times the axis
      size; backward gathers them again (the kernel recomputes) and reduce-scatters their
      gradients, the same sizes;
    - when ``balanced`` (``ir.context.is_balanced``), the query rows go to head-tail order and
      the output rows back (``rows_bytes``: q plus output, local), and in backward their
      gradients: one all-to-all on each of ``axes`` each way (``ir.context.head_tail_route``).
    """
    steps: list[tuple[str, float, int]] = []
    size = float(kv_bytes)
    for axis in reversed(axes):
        size *= mesh_shape[axis]
        steps += [("all_gather", size, axis)] * (2 if requires_grad else 1)
        if requires_grad:
            steps.append(("reduce_scatter", size, axis))
    if balanced:
        for axis in axes:
            steps += [("all_to_all", float(rows_bytes), axis)] * (2 if requires_grad else 1)
    return steps


def collectives_cost(
    steps: Sequence[tuple[str, float, int]], mesh_shape: Sequence[int], cluster: ClusterSpec
) -> tuple[float, dict[int, float]]:
    """(seconds, bytes sent per mesh axis) of ``(kind, num_bytes, axis)`` collectives run one
    after another."""
    seconds, per_axis = 0.0, {}
    for kind, num_bytes, axis in steps:
        seconds += _COST_FNS[kind](num_bytes, axis, mesh_shape, cluster)
        per_axis[axis] = per_axis.get(axis, 0.0) + bytes_sent(kind, num_bytes, mesh_shape[axis])
    return seconds, per_axis


def send_recv_s(num_bytes: float, axis: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> float:
    """One point-to-point send of ``num_bytes`` between neighbours on ``axis`` (pipeline stages):
    α + bytes/β; the sender sends ``num_bytes``. 0 when the axis has one rank."""
    k, link = _axis(axis, mesh_shape, cluster)
    if k == 1:
        return 0.0
    return link.latency_s + num_bytes / link.bandwidth_bytes_per_s


__all__ = [
    "CommCost",
    "all_reduce_s",
    "all_reduce_terms",
    "tree_latency_s",
    "bucket_latency_s",
    "all_gather_s",
    "reduce_scatter_s",
    "all_to_all_s",
    "send_recv_s",
    "bytes_sent",
    "context_parallel_collectives",
    "collectives_cost",
    "transition_cost",
    "TransitionPrices",
    "transition_bytes_per_axis",
    "grad_allreduce_cost",
    "param_grad_sync_cost",
    "bucket_copy_s",
    "copy_s",
    "exposed_grad_sync_s",
    "exposed_gathers_s",
    "DEFAULT_BUCKET_CAP_BYTES",
]
