"""Price a solution's parameter communication as the runtime schedules it (``passes.schedule``).

The choice graph prices each edge and each consumer on its own: an all-gather per sharded use of a
parameter, a gradient all-reduce (latency included) per use that needs one. The runtime merges
them per parameter and buckets the reductions:

- each (parameter, mesh axis, spec) reduction that any use needs runs once, in a bucket, priced
  exactly as the ILP prices it (``choices.param_sync_groups``), so the ILP's objective and the
  plan's step agree up to the terms below (``ParamSchedule.post_solve_s``) and the overlap;
- a parameter sharded on one axis, whose every gathered use needs the gradient summed on exactly
  that axis (and no use all-reduces it whole), is all-gathered once, and its gradient is
  reduce-scattered (FSDP's pattern): (k-1)/k of the bytes of the all-reduce it replaces (one
  whose uses sum it on other axes too, hybrid sharding, the runtime schedules as well, but it
  is priced here per use, whole, as the ILP prices it: ``problem.gather_overlap``); where
  its layer's group reshards after forward (``ir.gathers.reshards``) and an op saves it for
  backward, it is all-gathered once more, in backward;
- gradients are reduced in the precision policy's ``reduce_dtype`` (which the cast of a
  parameter carries), gathers move the dtype their uses read (the cast's ``param_dtype``: a
  padded shard's cast takes the piece too, ``solver.problem.padded_casts``, so its uses are one
  gather as an even shard's are); a padded shard's gather and reduce-scatter move ``k`` pieces
  of ``ceil(n / k)`` rows (``ops.buckets``);
- each reduction pays its bytes and its share of a bucket's latency
  (``comm.param_grad_sync_cost``); the buckets pay ceil(bytes / cap) latencies in all (per
  layer for reduce-scatters, whose buckets stay inside one layer's gather group).

``param_schedule`` returns the difference between the two, and the totals that the step's
exposed-communication term needs (``comm.exposed_grad_sync_s``).

**Overlap of FSDP's gathers** (on NCCL clusters; ``ParamSchedule.overlaps``): the runtime gathers
each layer's group one group ahead on its communication stream, as FSDP2 prefetches, so the
forward gathers run while the previous group computes and only the first group's gather and
what forward compute cannot cover is exposed (``comm.exposed_gathers_s``); the backward re-gathers
share the stream with the gradient reductions, and both hide behind backward compute
(``comm.exposed_grad_sync_s`` of their sum). On gloo the ranks' own CPU moves every message,
so nothing overlaps there and the gathers stay in the step whole (the CPU calibration).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from autopar.cost import comm, memory
from autopar.cost.cluster import ClusterSpec
from autopar.ir.gathers import gather_groups, param_layer, reshards
from autopar.solver.problem.choices import ChoiceGraph, synced_param
from autopar.solver.problem.gathered import moved_shape, single_gather
from autopar.solver.problem.op_prices import grad_sync_axes


@dataclass(frozen=True, slots=True)
class ParamSchedule:
    """What the scheduled runtime changes in a solution's price."""

    delta_s: float  # seconds: scheduled minus priced per use
    delta_bytes: float
    delta_bytes_per_axis: dict[int, float]
    sync_s: float  # the bucketed gradient reductions, after merging
    backward_s: float  # backward compute that can hide them
    last_bucket_s: float  # the last bucket (the first parameters of forward): never hidden
    per_use_s: float = 0.0  # the per-use parameter all-reduces in compute_s that the buckets replace
    post_solve_s: float = 0.0  # what the ILP does not price: one gather per parameter, reduce-scatter, buckets' latency
    # FSDP's gathers that overlap compute (module docstring; all 0 where nothing overlaps, gloo):
    gather_s: float = 0.0  # forward: one gather per scheduled parameter, as the step's reshard_s prices them
    regather_s: float = 0.0  # backward: the groups gathered again, as delta_s prices them
    gathered_s: float = 0.0  # the forward gathers as the runtime runs them: one latency per collective
    first_gather_s: float = 0.0  # of which the first collective's, which nothing runs before
    regathered_s: float = 0.0  # the backward re-gathers as run
    forward_s: float = 0.0  # forward compute of the chosen strategies, which hides the forward gathers
    copy_s: float = 0.0  # the flat buffers' copies around the gathers and reduce-scatters, on the compute stream

    @property
    def overlaps(self) -> bool:
        return self.gather_s > 0.0 or self.regather_s > 0.0

    @property
    def exposed_s(self) -> float:
        """The gradient reductions (and backward re-gathers, where they overlap) that backward compute does not hide."""
        return comm.exposed_grad_sync_s(self.sync_s + self.regathered_s, self.backward_s, self.last_bucket_s)

    @property
    def exposed_gathers_s(self) -> float:
        """The forward gathers that forward compute does not hide (0 where nothing overlaps)."""
        return comm.exposed_gathers_s(self.gathered_s, self.first_gather_s, self.forward_s)

    @property
    def overlap_delta_s(self) -> float:
        """What overlapping the gathers changes in the step: the gathers priced whole (forward in
        ``reshard_s``, backward in ``delta_s``) out, what compute does not hide of them in (the
        backward re-gathers' share is in ``exposed_s``)."""
        return self.exposed_gathers_s - self.gather_s - self.regather_s + self.copy_s


def _saves(consumer, index: int) -> bool:
    """Whether the op keeps input ``index`` for its backward (an embedding keeps only its indices)."""
    if consumer.info is None or not memory.saves_inputs(consumer.info.target):
        return False
    return not (getattr(consumer.info.target, "overloadpacket", None) is torch.ops.aten.embedding and index == 0)


def param_schedule(
    graph: ChoiceGraph, choice: dict[str, int], cluster: ClusterSpec, bucket_cap_bytes: float = comm.DEFAULT_BUCKET_CAP_BYTES
) -> ParamSchedule:
    """What scheduling ``choice``'s parameter communication as the runtime does changes in its
    per-use price (module docstring). Every sum is added in one fixed order, so that the same
    solution is priced the same to the last bit."""
    order, uses, reduce_dtypes = _param_uses(graph)
    groups, refunds = graph.param_sync_groups()
    needed = [(key, group) for key, group in groups.items() if group.needed(choice)]
    reduced = {(param, key[1], key[2]): group.price_s for key, group in needed for param in group.params}
    sums = _per_param_sums(graph, choice, cluster, bucket_cap_bytes, (order, uses, reduce_dtypes), reduced)
    # The parameter reductions, priced as the ILP prices them (``choices.param_sync_groups``):
    # each (parameter, axis, spec) that any use needs, once, bucketed, in place of the per-use
    # all-reduces in ``compute_s``.
    per_use_s = sum(refund[choice[n]] for n, refund in refunds.items())
    merged_s = sum(group.total_s for _, group in needed)
    sums.delta_s += merged_s - per_use_s + sums.scatter_delta_s
    sync_s = 0.0
    sync_s += merged_s + sums.scatter_delta_s
    synced = _synced(needed, sums, order)
    # Each all-reduced gradient is copied into its bucket on the compute stream, as a reduce-
    # scattered one is into its flat buffer (``_copy_s``): not in the ILP's price (post_solve_s)
    sums.delta_s += sum(comm.bucket_copy_s(nbytes, cluster) for _, _, nbytes, layer in synced if layer is None)
    backward_s = forward_s = 0.0
    for name in graph.order:
        chosen = graph.choices[name].priced[choice[name]]
        backward_s += chosen.backward_s
        forward_s += chosen.compute_s - chosen.backward_s
    last_bucket_s, filled = _last_bucket(synced, bucket_cap_bytes)
    if synced:
        # Each member paid bytes/cap of its bucket's latency (``comm.param_grad_sync_cost``); the
        # buckets pay it whole: ceil(bytes / cap) latencies over the step, one in the last bucket.
        # Reduce-scatter buckets do not span layers: ceil(bytes / cap) per layer for those.
        latency = _bucket_latency_s(graph.mesh_shape, cluster, bucket_cap_bytes)
        by_layer: dict[str | None, float] = {}
        for _, _, nbytes, layer in synced:
            by_layer[layer] = by_layer.get(layer, 0.0) + nbytes
        paid = latency * sum(min(1.0, nbytes / bucket_cap_bytes) for _, _, nbytes, _ in synced)
        owed = latency * max(1, sum(math.ceil(nbytes / bucket_cap_bytes) for nbytes in by_layer.values()))
        sync_s += max(0.0, owed - paid)
        sums.delta_s += max(0.0, owed - paid)
        last_bucket_s += latency * (1.0 - min(1.0, filled / bucket_cap_bytes))
    gathers = _overlapped_gathers(sums, cluster, graph.comm.gather_group_bytes)
    return ParamSchedule(
        sums.delta_s,
        sums.delta_bytes,
        sums.per_axis,
        sync_s,
        backward_s,
        last_bucket_s,
        per_use_s,
        sums.delta_s - (merged_s - per_use_s),
        *gathers,
        # compute_s holds the per-use gradient all-reduces too (backward): not forward compute
        forward_s - per_use_s if any(gathers) else 0.0,
        _copy_s(sums, cluster, graph.mesh_shape) if any(gathers) else 0.0,
    )


def _copy_s(sums: _Sums, cluster: ClusterSpec, mesh) -> float:
    """Seconds of the copies the runtime makes around FSDP's collectives, as FSDP2 does
    (``ops.buckets``): each gather copies the shards into a flat buffer and every whole parameter
    out of the gathered one (read and write: 2·(1 + 1/k) of its bytes), again for a re-gather, and
    each reduce-scatter copies the whole gradients into its bucket (2× their bytes), memory-bound
    at the achieved bandwidth on the compute stream. Priced where the gathers overlap (NCCL); the
    gloo prices are those the CPU calibration measured."""
    moved = 0.0
    for _, _, layer, _, gathered, (axis, _) in sums.gathers:
        copies = 2 if layer in sums.regathered_layers else 1
        moved += copies * 2 * gathered * (1 + 1 / mesh[axis])
    for _, _, whole, _ in sums.scattered.values():
        moved += 2 * whole
    return comm.copy_s(moved, cluster)


def _overlapped_gathers(sums: _Sums, cluster: ClusterSpec, group_bytes: int) -> tuple[float, ...]:
    """(forward gathers as priced, backward re-gathers as priced, forward gathers as run, the
    first collective's, backward re-gathers as run) that overlap compute: FSDP's gathers on an
    NCCL cluster (module docstring); none on gloo. The runtime gathers a run of one layer's
    parameters (up to ``group_bytes``, ``ir.gathers.gather_groups``) in one collective, which
    pays one latency where the per-parameter prices paid one each."""
    if cluster.gloo or not sums.gathers:
        return 0.0, 0.0, 0.0, 0.0, 0.0
    ordered = sorted(sums.gathers, key=lambda gather: (gather[0], gather[2]))
    runs = gather_groups([(i, gather[2], gather[5], gather[4]) for i, gather in enumerate(ordered)], group_bytes)
    run_s = []
    for run in runs:
        members = [ordered[i] for i in run]
        latency = max(gather[3] for gather in members)
        run_s.append((members[0][2], sum(gather[1] - gather[3] for gather in members) + latency))
    gathered_s = sum(seconds for _, seconds in run_s)
    regathered_s = sum(seconds for layer, seconds in run_s if layer in sums.regathered_layers)
    priced_s = sum(gather[1] for gather in ordered)
    return priced_s, sums.regather_s, gathered_s, run_s[0][1], regathered_s


@dataclass(slots=True)
class _Sums:
    """``param_schedule``'s running sums over the parameters, and what it keeps of each."""

    delta_s: float = 0.0
    delta_bytes: float = 0.0
    per_axis: dict[int, float] = field(default_factory=dict)
    scatter_delta_s: float = 0.0
    held: dict[str, tuple[int, float]] = field(default_factory=dict)  # reduced parameter → (first use, local bytes)
    # reduce-scattered parameter → (first use, Δs, bytes, layer)
    scattered: dict[str, tuple[int, float, float, str]] = field(default_factory=dict)
    gathers: list[tuple] = field(default_factory=list)  # ``_ParamTerms.gather`` of each gathered parameter
    regather_s: float = 0.0  # the backward re-gathers added to delta_s
    regathered_layers: set[str] = field(default_factory=set)

    def add_axis(self, axis: int, value: float) -> None:
        self.per_axis[axis] = self.per_axis.get(axis, 0.0) + value


def _per_param_sums(
    graph: ChoiceGraph, choice: dict[str, int], cluster: ClusterSpec, bucket_cap_bytes: float, param_uses: tuple, reduced: dict
) -> _Sums:
    """Each parameter's merged gathers and reductions (``_param_terms``), added up in graph order,
    and the second gathers of the layers that reshard after forward."""
    order, uses, reduce_dtypes = param_uses
    sums = _Sums()
    regathered: list[tuple[str, float, float, int]] = []  # (layer, seconds, bytes sent, axis) resharded
    saved_layers: set[str] = set()
    # Each parameter's terms depend on its own strategy and its uses' alone: priced once per
    # graph for each such combination (``_param_terms``), then added up here in the order they
    # always were, so that every sum is the same to the last bit. The candidates that ``solve``
    # compares differ in few nodes; most of their parameters are priced already.
    cached = graph.derived.get("param_terms")
    if cached is None or cached[0] is not cluster or cached[1] != bucket_cap_bytes:
        cached = graph.derived["param_terms"] = (cluster, bucket_cap_bytes, {})
    memo = cached[2]
    for name, edges in uses.items():
        key = (name, choice[name], *[choice[edge.consumer] for edge in edges])
        terms = memo.get(key)
        if terms is None:
            terms = memo[key] = _param_terms(graph, name, edges, choice, order, reduce_dtypes, cluster, bucket_cap_bytes)
        for target, value in terms.changes:
            if target == "s":
                sums.delta_s += value
            elif target == "bytes":
                sums.delta_bytes += value
            else:
                sums.add_axis(target, value)
        sums.held[name] = terms.held
        if terms.gather is not None:
            sums.gathers.append(terms.gather)
        if terms.regathered is not None:
            regathered.append(terms.regathered)
            if terms.saved:
                saved_layers.add(terms.regathered[0])
        if terms.scatter is not None:
            # The ILP priced this reduction as a bucketed all-reduce of the gathered
            # parameter (its group); the runtime reduce-scatters it instead.
            first, axis, dst, scatter_s, sent_delta, whole, layer = terms.scatter
            group_s = reduced.get((name, axis, dst), 0.0)
            sums.scatter_delta_s += scatter_s - group_s
            sums.delta_bytes += sent_delta
            sums.add_axis(axis, sent_delta)
            sums.scattered[name] = (first, scatter_s - group_s, whole, layer)
    # Resharded after forward: backward gathers a layer's group again when an op saved one of
    # its parameters (``ops.buckets.ParamGathers``), the whole group.
    for layer, gather_s, gather_sent, axis in regathered:
        if layer in saved_layers:
            sums.delta_s += gather_s
            sums.regather_s += gather_s
            sums.regathered_layers.add(layer)
            sums.delta_bytes += gather_sent
            sums.add_axis(axis, gather_sent)
    return sums


def _synced(needed: list, sums: _Sums, order: dict[str, int]) -> list[tuple[int, float, float, str | None]]:
    """(first use, seconds, local bytes, layer) per reduced parameter; layer None: all-reduced, in
    buckets of any parameters."""
    per_param: dict[str, float] = {}
    for _, group in needed:
        for param in group.params:
            per_param[param] = per_param.get(param, 0.0) + group.price_s
    synced = []
    for param, seconds in per_param.items():
        first, nbytes = sums.held.get(param, (order.get(param, 0), 0.0))  # a parameter with no edge: none
        layer = None
        if param in sums.scattered:
            first, extra, nbytes, layer = sums.scattered[param]
            seconds += extra
        synced.append((first, seconds, nbytes, layer))
    return synced


def _last_bucket(synced: list, bucket_cap_bytes: float) -> tuple[float, float]:
    """(seconds, bytes) of the last bucket: the first parameters of forward reduce last."""
    last_bucket_s = 0.0
    filled = 0.0
    ordered = sorted(synced, key=lambda item: item[:3])
    for _, seconds, nbytes, layer in ordered:
        # a reduce-scatter bucket holds one layer's gather group (``passes.schedule``)
        if filled and (filled + nbytes > bucket_cap_bytes or layer != ordered[0][3]):
            break
        last_bucket_s += seconds
        filled += nbytes
    return last_bucket_s, filled


@dataclass(frozen=True, slots=True)
class _ParamTerms:
    """One parameter's part of ``param_schedule`` under one choice of its strategy and its uses'."""

    changes: tuple[tuple[str | int, float], ...]  # ("s" | "bytes" | an axis, what is added), in order
    held: tuple[int, float]  # (first use, local bytes) of its reduction
    regathered: tuple[str, float, float, int] | None  # (layer, seconds, bytes sent, axis): gathered again in backward if saved
    saved: bool  # an op saves it for backward
    # gathered once in forward: (first use, seconds, layer, latency s, whole bytes, (axis, dtype))
    gather: tuple[int, float, str, float, int, tuple] | None
    scatter: (
        tuple[int, int, tuple, float, float, float, str] | None
    )  # reduce-scattered: (first use, axis, spec, seconds, Δbytes, bytes, layer)


def _param_terms(
    graph: ChoiceGraph,
    name: str,
    edges: list,
    choice: dict[str, int],
    order: dict[str, int],
    reduce_dtypes: dict[str, object],
    cluster: ClusterSpec,
    bucket_cap_bytes: float,
) -> _ParamTerms:
    """Parameter ``name``'s merged gathers and reductions under ``choice`` (module docstring)."""
    mesh = graph.mesh_shape
    changes: list[tuple[str | int, float]] = []
    src = graph.choices[name].strategies[choice[name]].outs[0]
    syncs: dict[tuple[int, ...], list] = {}
    gathers: dict[tuple[int, int], list] = {}
    for edge in edges:
        consumer = graph.choices[edge.consumer]
        strategy = consumer.strategies[choice[edge.consumer]]
        if consumer.info is None:
            continue
        dst = strategy.ins[edge.in_index]
        axes = tuple(grad_sync_axes(strategy, edge.in_index))
        axes = tuple(a for a in axes if mesh[a] > 1)
        if src == dst:
            if axes:
                syncs.setdefault(axes, []).append((edge, dst))
            continue
        gather = single_gather(src, dst)
        if gather is not None and axes in ((), (gather[0],)):
            gathers.setdefault(gather + (bool(axes),), []).append((edge, dst))
    arg_shape, dtype = graph.choices[name].out_shapes[0], reduce_dtypes.get(name, graph.choices[name].out_dtypes[0])
    held = None
    if syncs:
        # Bytes: one reduction per (parameter, axis), as the ILP merges them (seconds below).
        for axes, members in syncs.items():
            for a in axes:
                cost = comm.param_grad_sync_cost(arg_shape, src, a, dtype, mesh, cluster, bucket_cap_bytes)
                changes.append(("bytes", -((len(members) - 1) * cost.bytes_sent)))
                for axis, sent in cost.bytes_per_axis:
                    changes.append((axis, -((len(members) - 1) * sent)))
        held = (min(order[e.consumer] for ms in syncs.values() for e, _ in ms), memory.local_bytes(arg_shape, dtype, src, mesh))
    if held is None:
        held = (min(order[e.consumer] for e in edges), memory.local_bytes(arg_shape, dtype, src, mesh))
    regathered = scatter = forward_gather = None
    saved = False
    if len(gathers) == 1 and not syncs:
        (((axis, dim, reduce), members),) = gathers.items()
        dst = members[0][1]
        k = mesh[axis]
        # Gathered in the dtype its uses read (a policy's param_dtype: the runtime gathers the
        # cast shards), its gradient reduce-scattered in the reduction dtype; a padded shard's
        # (``ir.spec.padded_axis``) both k pieces of ceil(n / k) rows, as ``ops.buckets`` moves them.
        moved = moved_shape(arg_shape, src, dim, k, mesh)
        gathered = memory.local_bytes(moved, members[0][0].dtype, dst, mesh)
        whole = memory.local_bytes(moved, dtype, dst, mesh)
        gather_s = comm.all_gather_s(gathered, axis, mesh, cluster)
        gather_sent = comm.bytes_sent("all_gather", gathered, k)
        # each use gathered it; once now
        changes.append(("s", -((len(members) - 1) * gather_s)))
        changes.append(("bytes", -((len(members) - 1) * gather_sent)))
        changes.append((axis, -((len(members) - 1) * gather_sent)))
        layer = param_layer(graph.choices[name].fqn or name)
        latency_s = (k - 1) * cluster.axis_link(mesh, axis).latency_s
        forward_gather = (
            min(order[e.consumer] for e, _ in members),
            gather_s,
            layer,
            latency_s,
            gathered,
            (axis, members[0][0].dtype),
        )
        if reshards(layer, graph.comm.reshard_after_forward):
            regathered = (layer, gather_s, gather_sent, axis)
            saved = any(_saves(graph.choices[e.consumer], e.in_index) for e, _ in members)
        if reduce:
            first = min(order[e.consumer] for e, _ in members)
            scatter = _scatter_terms(arg_shape, dst, axis, dtype, whole, len(members), cluster, mesh, bucket_cap_bytes)
            scatter = (first, axis, dst, *scatter, whole, layer)
    return _ParamTerms(tuple(changes), held, regathered, saved, forward_gather, scatter)


def _scatter_terms(
    arg_shape, dst, axis: int, dtype, whole: float, uses: int, cluster, mesh, bucket_cap_bytes
) -> tuple[float, float]:
    """(seconds, Δbytes sent) of reduce-scattering a gathered parameter's gradient (``whole``
    bytes) on ``axis`` in place of the all-reduce per use that the edges priced: its bandwidth
    term and its share of a bucket's latency."""
    link = cluster.axis_link(mesh, axis)
    k = mesh[axis]
    scatter_sent = comm.bytes_sent("reduce_scatter", whole, k)
    scatter_s = (k - 1) * link.latency_s * min(1.0, whole / bucket_cap_bytes) + scatter_sent / link.bandwidth_bytes_per_s
    priced = comm.grad_allreduce_cost(arg_shape, dst, axis, dtype, mesh, cluster)
    return scatter_s, scatter_sent - uses * priced.bytes_sent


def _param_uses(graph: ChoiceGraph) -> tuple[dict[str, int], dict[str, list], dict[str, object]]:
    """(each node's index in graph order, the edges that use each reduced parameter, the dtype
    a parameter's gradient is reduced in where a cast says so): the same for every plan of
    ``graph``, so computed once (``ChoiceGraph.derived``)."""
    cached = graph.derived.get("param_uses")
    if cached is not None:
        return cached
    uses: dict[str, list] = {}
    reduce_dtypes: dict[str, object] = {}
    for edge in graph.edges:
        producer = graph.choices[edge.producer]
        consumer = graph.choices[edge.consumer]
        # The cast of a parameter under a precision policy carries the dtype its gradient is
        # reduced in: it is reduced once per parameter, as a parameter's (``PricedStrategy.param_syncs``).
        cast = consumer.sync_dtypes[edge.in_index] if edge.in_index < len(consumer.sync_dtypes) else None
        if (producer.kind == "param" or cast is not None) and edge.requires_grad:
            param = synced_param(graph.choices, edge.producer)
            uses.setdefault(param, []).append(edge)
            if cast is not None:
                reduce_dtypes[param] = cast
    order = {name: i for i, name in enumerate(graph.order)}
    graph.derived["param_uses"] = (order, uses, reduce_dtypes)
    return order, uses, reduce_dtypes


def _bucket_latency_s(mesh, cluster: ClusterSpec, bucket_cap_bytes: float) -> float:
    """One bucket's latency on the slowest axis (``comm.bucket_latency_s``: 2(k-1)·α on the ring):
    an upper bound on a multi-axis mesh."""
    return max(
        (comm.bucket_latency_s(axis, mesh, cluster, bucket_cap_bytes) for axis, k in enumerate(mesh) if k > 1), default=0.0
    )
