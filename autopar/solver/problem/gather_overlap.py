"""FSDP's all-gathers and the gradient reductions in the ILP's objective as the runtime overlaps them.

An edge prices each gathered parameter's all-gather whole: its bytes and a ring latency per
parameter, in the step. The runtime runs them otherwise (``solver.pricing.comm_schedule``):
a layer's parameters in one collective (one latency per group), one group ahead on the
communication stream, so forward compute hides them; and it copies the pieces into and out of
flat buffers on the compute stream. Pricing them whole made FSDP look dearer than DDP by a
latency per parameter (0.15 s a step on 196 parameters over 48 ranks), so where memory did not
bind the ILP never sharded a parameter, and never won back the optimizer step that sharding
splits.

So, on clusters whose gathers overlap (not gloo: there the ranks' CPUs move every byte), the
objective takes each gathered parameter's first-use gather out of its edge's price and pays

- its copies, on that edge (``copy_s``: the runtime's, as ``comm_schedule._copy_s`` prices them;
  the gradient's reduce-scatter copy always, a re-gather's where its layer reshards);
- ``E_f ≥ Σ run_s · y − F, E_f ≥ 0``: the gathers as run (bytes, and each parameter's share of
  its group's one latency, by bytes, at least its share of its layer's one) that ``F`` does not
  hide, one row and one continuous variable. ``F`` is the least forward compute any plan has
  (each node's cheapest strategy), so E_f is never under what the chosen plan's own forward
  leaves exposed; the first group's gather, which nothing hides, is priced on the solved plan
  alone;
- ``E_b ≥ Σ run_s · y + Σ P · z − B, E_b ≥ 0`` for the gathers again in backward (the layers that
  reshard after forward) and the gradient reductions (the ILP's z at their bucketed price P),
  which share the backward stream, behind the least backward compute ``B``: the objective pays
  E_b in place of Σ P · z, so DDP's all-reduce is hidden as the post-solve price hides it
  (``comm.exposed_grad_sync_s``, on the plan's own compute), but for the last bucket's (the
  first parameters of forward), which nothing hides and whose z keep their price. Priced whole,
  the reductions made a layout that reduces less look faster than one whose reductions backward
  hides anyway.

The cost model prices FSDP's pattern only where a gathered use reduces its gradient on the
gathered axis alone (``comm_schedule._param_terms``). A parameter gathered on one axis and
reduced on another too (hybrid sharding) the runtime schedules as well (``passes.schedule``:
reduce-scatter, then the shard all-reduced on the other axes), but its price is still per use,
whole, here and after the solve: the ILP's reductions are priced by (parameter, axis, spec)
whatever the parameter's own placement, so the shard's cheaper reductions would need a term for
each (placement, reduction) pair (benchmarks/README.md). A pair says so where the consumer's
input is cut on every other axis larger than 1 (tensor parallelism on the inner axis, FSDP on
the outer, torchtitan's layout): its gradient then needs no sum there. Only those pairs are
priced here; a pair replicated on another axis keeps its whole price, whatever the consumer does.
Not on meshes of three axes larger than 1: there an edge may also route a pair through the
replicated spec (its hub, ``edges.EdgePrices``), which prices the same gather whole, and both
routes of a pair must cost the same.

What the plan reports is the solved plan's price (``ParamSchedule.overlap_delta_s``); this is the
ILP's view of it, linear in the gathered edges' y (``ilp.ShardingILP.add_exposed_gathers``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Shard

from autopar.cost import comm
from autopar.cost.cluster import ClusterSpec
from autopar.ir.gathers import param_layer, reshards
from autopar.ir.spec import Spec
from autopar.solver.problem.gathered import single_gather


@dataclass(frozen=True, slots=True)
class GatherTerms:
    """One gathered parameter's first-use edge, whether its layer gathers it again in backward,
    and per (src, dst) of the edge that is one all-gather: (seconds the edge prices, seconds of
    one gather as run, seconds of the runtime's copies). The table is shared by the parameters
    whose edges share a price table, shape, dtype and layer size: read only."""

    edge: int
    regathered: bool
    pairs: dict[tuple[Spec, Spec], tuple[float, float, float]]

    def parts(self, pair: tuple[Spec, Spec] | None) -> tuple[float, float, float]:
        """(copies − edge price, forward gather as run, backward re-gather as run) where the edge
        carries ``pair``; zeros where that is no gather of the table."""
        terms = self.pairs.get(pair)
        if terms is None:
            return 0.0, 0.0, 0.0
        return terms[2] - terms[0], terms[1], terms[1] if self.regathered else 0.0


@dataclass(frozen=True, slots=True)
class GatherOverlap:
    """The gathered parameters' terms, the forward and backward compute that hide their
    gathers (``F``, ``B``), and the parameters whose gradients fill the last bucket (the first
    of forward, up to ``CommOptions.bucket_cap_bytes``), which backward never hides."""

    items: tuple[GatherTerms, ...]
    forward_s: float
    backward_s: float
    last_bucket: frozenset[str] = frozenset()

    def adjustment_s(self, specs: Mapping[int, tuple[Spec, Spec]], sync_s: float = 0.0) -> float:
        """What the ILP's objective adds to Σ compute + Σ resharding for a plan whose edges carry
        ``specs`` and whose parameter reductions take ``sync_s`` (each once, bucketed): each
        gather's copies in place of its edge price, and what compute does not hide of the
        gathers as run and, in backward, of the reductions beside them, in place of ``sync_s``."""
        return float(self.combined(*self.sums(specs), sync_s))

    def sums(self, specs: Mapping[int, tuple[Spec, Spec]]) -> tuple[float, float, float]:
        """(Σ copies − edge prices, Σ forward gathers as run, Σ backward re-gathers as run) of the
        gathered edges that carry ``specs`` (an edge left out of it: none of its terms)."""
        delta = forward = backward = 0.0
        for item in self.items:
            parts = item.parts(specs.get(item.edge))
            delta += parts[0]
            forward += parts[1]
            backward += parts[2]
        return delta, forward, backward

    def combined(self, delta, forward, backward, sync_s):
        """``adjustment_s`` from its ``sums`` and the hidden reductions' seconds: floats, or numpy
        arrays of them (one per counterfactual, ``pricing.runner_ups``). The reductions' own price
        leaves the objective for what backward does not hide of them."""
        return delta + np.maximum(0.0, forward - self.forward_s) + np.maximum(0.0, backward + sync_s - self.backward_s) - sync_s

    def hidden_sync_s(self, groups: Mapping, choice: Mapping[str, int]) -> float:
        """The seconds of the reduction groups (``ChoiceGraph.param_sync_groups``) that ``choice``
        needs, as E_b holds them (``hidden_s``)."""
        return sum(self.hidden_s(group) for group in groups.values() if group.needed(choice))

    def hidden_s(self, group) -> float:
        """The seconds of reduction group ``group`` (``choices.ParamSyncGroup``) that E_b holds:
        its parameters' outside the last bucket (the rest the objective pays whole)."""
        return group.price_s * len(group.params - self.last_bucket)


def gather_overlap(graph, cluster: ClusterSpec, like: GatherOverlap | None = None) -> GatherOverlap | None:
    """The ILP's terms for ``graph``'s gathered parameters (module docstring); None where its
    gathers do not overlap compute (gloo, or nothing gathered) or on three axes (docstring).
    ``like``: the terms of the same graph under another schedule (``CommOptions``), whose
    compute sums and last bucket, which no schedule changes, are taken as they are."""
    mesh = graph.mesh_shape
    if cluster.gloo or not graph.gathered or sum(size > 1 for size in mesh) >= 3:
        return None
    params = {name: name.split(":", 1)[1] for name in graph.gathered}
    layer_of = {name: param_layer(graph.choices[param].fqn or param) for name, param in params.items()}
    per_layer = Counter(layer_of.values())
    tables: dict[tuple, dict] = {}
    items = []
    for name, gathered in graph.gathered.items():
        edge = graph.edges[gathered.edge]
        param = params[name]
        layer = layer_of[name]
        regathered = reshards(layer, graph.comm.reshard_after_forward)
        producer = graph.choices[edge.producer]
        reduce_dtype = producer.sync_dtypes[0] if producer.kind != "param" and producer.sync_dtypes else None
        grad_itemsize = (reduce_dtype or graph.choices[param].out_dtypes[0]).itemsize
        key = (id(edge.price), id(gathered.sizes), regathered, grad_itemsize, per_layer[layer])
        if key not in tables:
            tables[key] = _pairs(graph, edge, gathered.sizes, regathered, grad_itemsize, per_layer[layer], cluster)
        if tables[key]:
            items.append(GatherTerms(gathered.edge, regathered, tables[key]))
    if not items:
        return None
    if like is not None:
        return dataclasses.replace(like, items=tuple(items))
    forward, backward = _least_compute_s(graph)
    return GatherOverlap(tuple(items), forward, backward, _last_bucket(graph))


def _last_bucket(graph) -> frozenset[str]:
    """The parameters first used in forward, in order, while their whole bytes fit one bucket (at
    least one): their gradients are reduced last, when backward has no compute left to hide them
    (``comm.exposed_grad_sync_s``), so the objective pays their reductions whole."""
    index = {name: i for i, name in enumerate(graph.order)}
    first_use = {}
    for edge in graph.edges:
        if graph.choices[edge.producer].kind == "param":
            at = index[edge.consumer]
            first_use[edge.producer] = min(at, first_use.get(edge.producer, at))
    taken, filled = set(), 0.0
    for param in sorted(first_use, key=lambda name: (first_use[name], name)):
        choice = graph.choices[param]
        nbytes = math.prod(choice.out_shapes[0]) * choice.out_dtypes[0].itemsize
        if taken and filled + nbytes > graph.comm.bucket_cap_bytes:
            break
        taken.add(param)
        filled += nbytes
    return frozenset(taken)


def _pairs(graph, edge, sizes, regathered: bool, grad_itemsize: int, in_layer: int, cluster: ClusterSpec) -> dict:
    """``GatherTerms.pairs`` of one gathered parameter's edge: the runtime gathers a layer's
    parameters in collectives of up to ``gather_group_bytes``, so each pays a share of a latency,
    by its bytes, and at least an equal share of its layer's one (``in_layer`` parameters); and
    it copies the pieces in and out of a flat buffer (again for a re-gather) and the gradient
    into its reduce-scatter bucket, as ``comm_schedule._copy_s`` prices them."""
    mesh = graph.mesh_shape
    pairs = {}
    for (src, dst), nbytes in sizes.items():
        price = edge.price.get((src, dst))
        if price is None or not nbytes:
            continue
        axis = single_gather(src, dst)[0]
        if any(size > 1 and not isinstance(dst[b], Shard) for b, size in enumerate(mesh) if b != axis):
            continue  # its gradient may be summed on another axis too: not FSDP's pattern (docstring)
        k = mesh[axis]
        latency = (k - 1) * cluster.axis_link(mesh, axis).latency_s
        share = max(nbytes / graph.comm.gather_group_bytes, 1.0 / in_layer) if graph.comm.gather_group_bytes > 0 else 1.0
        run = price[0] - latency + latency * min(1.0, share)
        copies = (2 if regathered else 1) * 2 * nbytes * (1 + 1 / k) + 2 * nbytes * grad_itemsize / edge.dtype.itemsize
        pairs[(src, dst)] = (price[0], max(0.0, run), comm.copy_s(copies, cluster))
    return pairs


def _least_compute_s(graph) -> tuple[float, float]:
    """(Σ over nodes of the least forward seconds of any strategy, and of the least backward):
    forward is compute less backward and the per-use parameter gradient all-reduces that
    ``compute_s`` holds (``param_sync_s``)."""
    forward = backward = 0.0
    for name in graph.order:
        priced = graph.choices[name].priced
        if len(priced):
            forward += max(0.0, min(p.compute_s - p.backward_s - p.param_sync_s for p in priced))
            backward += min(p.backward_s for p in priced)
    return forward, backward


__all__ = ["GatherOverlap", "GatherTerms", "gather_overlap"]
