"""The memory of the parameters the runtime gathers (FSDP's pattern), for the liveness walk.

``passes.schedule`` all-gathers a parameter held sharded on one axis whose uses need it whole,
once per step in forward (grouped per layer, prefetched one group ahead, ``ir.gathers``), and
again in backward if its group is resharded after forward; its gradient waits whole in a
reduce-scatter bucket (``ops.buckets``). Those whole tensors are not node outputs, so the choice
graph names each gathered parameter ``gathered:<placeholder>`` and sizes it by the specs of its
first use's edge: the bytes of the consumer's input spec where that edge is one all-gather
(``single_gather``; a padded shard's with its padding, ``moved_shape``), else 0. In the ILP that is linear in the edge's y variables
(``ilp.ShardingILP.memory_expression``); for a chosen plan, ``ChoiceGraph.bytes_of``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost import compute, liveness, memory
from autopar.ir.gathers import gather_groups, param_layer, reshards
from autopar.ir.options import CommOptions
from autopar.ir.spec import Spec, local_shape

if TYPE_CHECKING:
    from autopar.solver.problem.choices import Choice, Edge

PREFIX = "gathered:"


@dataclass(frozen=True, slots=True)
class GatheredSize:
    """Bytes of a gathered parameter per (producer spec, consumer spec) of edge ``edge``
    (``sizes`` is shared by the parameters whose edges share a price table, shape and dtype:
    read only)."""

    edge: int
    sizes: dict[tuple[Spec, Spec], float]

    def bytes_for(self, src: Spec, dst: Spec) -> float:
        return self.sizes.get((src, dst), 0.0)


def single_gather(src: Spec, dst: Spec) -> tuple[int, int] | None:
    """(axis, dim) when ``src → dst`` is one all-gather on one axis, else None."""
    changed = [a for a, (s, d) in enumerate(zip(src, dst)) if s != d]
    if len(changed) != 1:
        return None
    axis = changed[0]
    if isinstance(src[axis], Shard) and type(src[axis]) is Shard and isinstance(dst[axis], Replicate):
        if not any(isinstance(p, Shard) and p.dim == src[axis].dim for a, p in enumerate(src) if a != axis):
            return axis, src[axis].dim
    return None


def moved_shape(shape: Sequence[int], src: Spec, dim: int, k: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as the all-gather of ``src``'s ``dim`` over ``k`` ranks moves and holds it: ``k``
    pieces of the local ``ceil(n / k)`` rows, so a padded shard's (``ir.spec.padded_axis``) with
    its padding, as ``ops.buckets.ParamGathers`` gathers it (``shape`` itself where ``k`` divides)."""
    local = local_shape(shape, src, mesh_shape)
    return tuple(k * local[d] if d == dim else n for d, n in enumerate(shape))


def reads_whole(target) -> bool:
    """Whether a use of a parameter by an op of ``target`` is where the runtime would gather it:
    not a view, a getitem or a cast, which take the shard as it is (its users gather)."""
    if target is None or target is operator.getitem or target is torch.ops.aten._to_copy.default:
        return target is None  # None: the graph's output
    return not compute.is_view(target)


def cast_of_param(choices: dict[str, Choice], name: str) -> str | None:
    """The parameter ``name`` is (a parameter, or a precision policy's cast of one), else None."""
    choice = choices[name]
    if choice.kind == "param":
        return name
    if (
        choice.info is not None
        and choice.info.target is torch.ops.aten._to_copy.default
        and len(choice.inputs) == 1
        and choices[choice.inputs[0][0]].kind == "param"
    ):
        return choice.inputs[0][0]
    return None


def gathered_parameters(
    choices: dict[str, Choice],
    edges: Sequence[Edge],
    order: Sequence[str],
    nodes: Sequence[liveness.LiveNode],
    mesh_shape: Sequence[int],
    fqns: Mapping[str, str],
    ties: Sequence[Sequence[str]] = (),
    options: CommOptions | None = None,
    exchange: bool = False,
) -> tuple[dict[str, GatheredSize], list[liveness.Interval], list[GatherRow]]:
    """The sizes, liveness intervals and rows (``gathered_intervals`` builds the intervals of
    another schedule from them) of every parameter the runtime may gather (module docstring),
    under the communication schedule ``options`` (``CommOptions()``: the runtime's default).
    ``fqns`` maps parameter placeholders to their FQNs (their layer groups them)."""
    options = options or CommOptions()
    if not options.enabled or all(size == 1 for size in mesh_shape):
        return {}, [], []
    index = {name: i for i, name in enumerate(order)}
    tie_leader = {member: group[0] for group in ties for member in group}
    uses: dict[str, list[tuple[int, int]]] = {}
    first_edge: dict[str, int] = {}
    for e, edge in enumerate(edges):
        param = cast_of_param(choices, edge.producer)
        consumer = choices[edge.consumer]
        target = consumer.info.target if consumer.info is not None else (None if consumer.kind == "output" else operator.getitem)
        if param is None or not edge.requires_grad or not reads_whole(target):
            continue
        param = tie_leader.get(param, param)
        uses.setdefault(param, []).append((index[edge.consumer], edge.in_index))
        if param not in first_edge or index[edge.consumer] < index[edges[first_edge[param]].consumer]:
            first_edge[param] = e
    sizes: dict[str, GatheredSize] = {}
    rows = []
    # Repeated layers' edges share their price tables: size each (table, shape, dtype) once.
    sized: dict[tuple, dict[tuple[Spec, Spec], float]] = {}
    for param, e in first_edge.items():
        edge = edges[e]
        key = (id(edge.price), edge.shape, edge.dtype)
        if key not in sized:
            sized[key] = _gathered_sizes(edge, mesh_shape)
        sizes[PREFIX + param] = GatheredSize(e, sized[key])  # shared by the layers' copies: read only
        rows.append(
            GatherRow(param, fqns.get(param, param), tuple(uses[param]), edge.shape, edge.dtype, choices[param].out_dtypes[0])
        )
    return sizes, gathered_intervals(rows, nodes, options, exchange), rows


def _gathered_sizes(edge: Edge, mesh_shape: Sequence[int]) -> dict[tuple[Spec, Spec], float]:
    """Bytes of ``edge``'s tensor gathered, per (src, dst) of its price table that is one
    all-gather (``single_gather``), padded as it is gathered (``moved_shape``)."""
    sizes = {}
    for src, dst in edge.price:
        found = single_gather(src, dst)
        if found is not None:
            moved = moved_shape(edge.shape, src, found[1], mesh_shape[found[0]], mesh_shape)
            sizes[(src, dst)] = float(memory.local_bytes(moved, edge.dtype, dst, mesh_shape))
    return sizes


@dataclass(frozen=True, slots=True)
class GatherRow:
    """A parameter the runtime may gather: its uses (node index, input index), and the shape and
    dtype it is gathered in (a precision policy's ``param_dtype``) and stored in."""

    param: str
    fqn: str
    uses: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    stored_dtype: torch.dtype


def gathered_intervals(
    rows: Sequence[GatherRow], nodes: Sequence[liveness.LiveNode], options: CommOptions | None = None, exchange: bool = False
) -> list[liveness.Interval]:
    """The liveness intervals of ``rows``' gathered parameters (named ``PREFIX + param``), grouped
    and resharded as ``passes.schedule`` does under ``options`` (``exchange``: reduce-scatters
    run as gloo's all-to-all, ``ClusterSpec.gloo``)."""
    options = options or CommOptions()
    ordered = sorted(rows, key=lambda row: (min(i for i, _ in row.uses), row.param))
    wholes = [math.prod(row.shape) * row.dtype.itemsize for row in ordered]
    groups = gather_groups(
        [(row.param, param_layer(row.fqn), row.dtype, whole) for row, whole in zip(ordered, wholes)], options.gather_group_bytes
    )
    group_of = {param: g for g, params in enumerate(groups) for param in params}
    group_bytes = [0.0] * len(groups)
    for row, whole in zip(ordered, wholes):
        group_bytes[group_of[row.param]] += whole
    gathered = [
        liveness.Gathered(
            PREFIX + row.param,
            row.uses,
            group_of[row.param],
            reshards(param_layer(row.fqn), options.reshard_after_forward),
            row.stored_dtype.itemsize / row.dtype.itemsize,
            _prefetched_by(group_of[row.param], group_bytes, options.prefetch_bytes),
        )
        for row in ordered
    ]
    return liveness.gathered_intervals(nodes, gathered, backward_prefetch=options.prefetch_bytes > 0, exchange=exchange)


def _prefetched_by(group: int, group_bytes: Sequence[float], prefetch_bytes: int) -> int:
    """The group at whose first gather the runtime launches ``group``'s all-gather
    (``ParamGathers.gather``: the next group always, further ones within ``prefetch_bytes``)."""
    if prefetch_bytes <= 0 or group == 0:
        return group
    earliest, ahead = group - 1, group_bytes[group]
    for p in range(group - 2, -1, -1):
        ahead += group_bytes[p + 1]
        if ahead > prefetch_bytes:
            break
        earliest = p
    return earliest


__all__ = [
    "PREFIX",
    "GatheredSize",
    "GatherRow",
    "single_gather",
    "moved_shape",
    "gathered_parameters",
    "gathered_intervals",
    "cast_of_param",
    "reads_whole",
]
