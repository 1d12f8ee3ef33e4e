"""Sharding specs: one DTensor placement per mesh axis, and how to move between them.

A *spec* is a tuple with one placement per mesh axis, each ``Replicate()``, ``Shard(dim)`` or
``Partial("sum")`` from ``torch.distributed.tensor``, or DTensor's strided shard
``_StridedShard(dim, split_factor=n)``. Plan files spell them ``R``, ``S(d)``, ``P`` and ``S(d)/n``.

A strided shard is how Megatron cuts a fused projection: the dim is ``n`` equal blocks (q, k and v
of a fused attention projection, or gate and up of a fused MLP), each block is cut into ``k``
chunks along the mesh axis, and rank ``r`` holds chunk ``r`` of every block, in block order. A
rank's slice of ``split(dim, size / n)`` is then its own q, k and v, with no communication. autopar
allows a strided dim on one mesh axis only (no other axis shards that dim).

Sharding is nested in axis order: a tensor dim sharded on axes 0 and 1 is first cut into
``mesh[0]`` chunks, and each chunk again into ``mesh[1]`` chunks, as DTensor does. Ops use even
shards only: a dim may be sharded only when its size divides by the product of the axis sizes
that shard it (``is_valid``). The one exception is FSDP2's: a *padded* parameter shard
(``padded_axis``, ``is_valid_param``), ``Shard(0)`` on one mesh axis of ``k`` ranks that does
not divide dim 0, cut as ``torch.chunk`` cuts (``ceil(n / k)`` rows a rank, the last ranks'
pieces shorter or empty). Such a parameter reaches its uses only gathered whole
(``padded_transition_ok``), and every collective moves it padded to ``k`` pieces of
``ceil(n / k)`` rows: ``local_shape`` is that padded piece, which the cost model prices.

``transition_steps`` is the single source of truth for resharding. The cost model prices these
steps and the collectives pass inserts exactly these steps, so what is priced is what runs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.errors import ConfigTypeError, InternalError, PlanError

Placement = Replicate | Shard | Partial | _StridedShard
Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def SS(dim: int, blocks: int) -> _StridedShard:
    """A strided shard of ``dim`` seen as ``blocks`` equal blocks (plan spelling ``S(dim)/blocks``)."""
    if blocks < 2:
        raise PlanError(f"a strided shard needs at least 2 blocks, got {blocks}: use S({dim}) for 1")
    return _StridedShard(dim, split_factor=blocks)


_SHARD, _STRIDED, _REPLICATE, _PARTIAL = 1, 2, 4, 8
# The same bits, as ``PlacementNumbers.arrays`` gives them.
KIND_SHARD, KIND_STRIDED, KIND_REPLICATE, KIND_PARTIAL = _SHARD, _STRIDED, _REPLICATE, _PARTIAL
# Placement type -> _SHARD | _STRIDED bits, or _REPLICATE, or _PARTIAL: ``isinstance`` on torch's
# placement types goes through a metaclass hook, and pricing a 3-axis mesh asks it tens of
# millions of times.
_KINDS: dict[type, int] = {}


def _kind(placement: Placement) -> int:
    cls = type(placement)
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, _StridedShard):
            kind = _STRIDED | _SHARD
        else:
            kind = (
                _SHARD
                if issubclass(cls, Shard)
                else _REPLICATE
                if issubclass(cls, Replicate)
                else _PARTIAL
                if issubclass(cls, Partial)
                else 0
            )
        kind = _KINDS[cls] = kind
    return kind


def is_strided(placement: Placement) -> bool:
    return bool(_kind(placement) & _STRIDED)


def is_sharded(placement: Placement) -> bool:
    """Shard or strided shard: the rank holds 1/k of the dim."""
    return bool(_kind(placement) & _SHARD)


_SHARD_RE = re.compile(r"^S\((\d+)\)$")
_STRIDED_RE = re.compile(r"^S\((\d+)\)/(\d+)$")


def parse_placement(text: str) -> Placement:
    """``"R"`` → Replicate(), ``"S(1)"`` → Shard(1), ``"P"`` → Partial("sum")."""
    if text == "R":
        return R
    if text == "P":
        return P
    match = _SHARD_RE.match(text)
    if match:
        return Shard(int(match.group(1)))
    match = _STRIDED_RE.match(text)
    if match:
        return SS(int(match.group(1)), int(match.group(2)))
    raise PlanError(f"unknown placement {text!r}: expected 'R', 'P', 'S(<dim>)' or 'S(<dim>)/<blocks>'")


def format_placement(placement: Placement) -> str:
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, _StridedShard):
        return f"S({placement.dim})/{placement.split_factor}"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Partial):
        if placement.reduce_op != "sum":
            raise InternalError(f"only Partial('sum') is used by autopar, got {placement!r}")
        return "P"
    raise ConfigTypeError(f"not a placement: {placement!r}; expected Replicate(), Shard(dim) or Partial('sum')")


def spec_text(spec: Spec) -> str:
    """A spec as plans and reports print it: "(S(0), R)"."""
    return "(" + ", ".join(format_spec(spec)) + ")"


def parse_spec(texts: Sequence[str]) -> Spec:
    return tuple(parse_placement(t) for t in texts)


def format_spec(spec: Spec) -> list[str]:
    return [format_placement(p) for p in spec]


def replicated(num_axes: int) -> Spec:
    return (R,) * num_axes


def shard_axes(spec: Spec, dim: int) -> list[int]:
    """Mesh axes that shard tensor dim ``dim``, in nesting order."""
    return [axis for axis, p in enumerate(spec) if isinstance(p, Shard) and p.dim == dim]


def is_valid(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim exists and divides evenly by the axes that shard it; a
    strided dim must divide into its blocks times the axis size, on that one axis alone. A mesh
    axis of size 1 carries only ``R``: there a shard is the whole tensor and a partial sum has
    one term, so S and P would only name R differently, and plans that mix the names ask for
    transitions (S to P) that no collective makes.

    Axis by axis (``axis_cut``), outermost first: a dim cut on several axes must divide by each
    size in turn, which is dividing by their product; a strided dim must meet no other cut."""
    remaining = list(shape)  # each dim's size over the sizes of the axes that cut it so far
    cut_dims = strided_dims = 0  # bit d: dim d is cut (strided) on some axis so far
    for axis, placement in enumerate(spec):
        cut = axis_cut(shape, placement, mesh_shape[axis])
        if cut is None:
            return False
        dim, strided = cut
        if dim < 0:
            continue
        bit = 1 << dim
        if strided_dims & bit or strided and cut_dims & bit or remaining[dim] % mesh_shape[axis]:
            return False
        remaining[dim] //= mesh_shape[axis]
        cut_dims |= bit
        if strided:
            strided_dims |= bit
    return True


_UNCUT = (-1, False)


def axis_cut(shape: Sequence[int], placement: Placement, size: int) -> tuple[int, bool] | None:
    """What ``placement`` on one mesh axis of ``size`` does to a tensor of ``shape``, the part of
    ``is_valid`` that looks at one axis: None where that axis alone makes a spec invalid (a shard
    or partial sum on an axis of size 1, a dim the tensor lacks, a strided dim whose blocks do not
    divide into ``size`` chunks); else ``(dim, strided)``, the dim it cuts into ``size`` parts
    (-1: none). ``registry.expand_rows`` checks whole strategies from these, per row and axis."""
    kind = _kind(placement)
    if size == 1 and not kind & _REPLICATE:
        return None
    if not kind & _SHARD:
        return _UNCUT
    dim = placement.dim
    if not 0 <= dim < len(shape):
        return None
    if kind & _STRIDED:
        if shape[dim] % (placement.split_factor * size):
            return None
        return (dim, True)
    return (dim, False)


def replicated_axes(spec: Spec) -> int:
    """Bit ``a`` set where ``spec`` is ``Replicate()`` on mesh axis ``a``."""
    return _axes_of_kind(spec, _REPLICATE)


def partial_axes(spec: Spec) -> int:
    """Bit ``a`` set where ``spec`` is ``Partial`` on mesh axis ``a``."""
    return _axes_of_kind(spec, _PARTIAL)


def _axes_of_kind(spec: Spec, kind: int) -> int:
    mask = 0
    for axis, placement in enumerate(spec):
        if (_KINDS.get(type(placement)) or _kind(placement)) & kind:  # ``_kind``, its call saved
            mask |= 1 << axis
    return mask


def replicate_size_one_axes(spec: Spec, mesh_shape: Sequence[int]) -> Spec:
    """``spec`` with ``R`` on every mesh axis of size 1 (the same layout, named as ``is_valid``
    wants it)."""
    return tuple(Replicate() if mesh_shape[axis] == 1 else p for axis, p in enumerate(spec))


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape each rank holds, padded: a sharded dim of ``n`` on ``k`` ranks has ``ceil(n / k)``
    rows, which is ``n / k`` under ``is_valid`` and the padded piece of a padded parameter shard
    (``padded_axis``: what its collectives move and what the cost model prices; a rank's own
    piece is ``piece_shape``)."""
    out = list(shape)
    for axis, placement in enumerate(spec):
        if (_KINDS.get(type(placement)) or _kind(placement)) & _SHARD:  # ``_kind``, its call saved
            out[placement.dim] = -(-out[placement.dim] // mesh_shape[axis])
    return tuple(out)


# FSDP2's padded parameter shards (``padded_axis``) may be planned: the one switch, which the
# planner (``solver.problem.choices.padded_param_specs``, hand plans) reads. Off, plans are as
# before them; pricing, and the runtime of a plan that holds one, work either way.
PADDED_PARAM_SHARDS = True


def padded_axis(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> int | None:
    """The mesh axis of a padded parameter shard, or None where ``spec`` is not one: ``Shard(0)``
    on exactly one mesh axis, whose size (> 1) does not divide dim 0, and on every other axis
    ``R`` or an even ``Shard`` of another dim (FSDP2's layout on one mesh dimension, beside
    tensor parallelism or replicas on the others: torchtitan's FSDP + TP, HSDP). Dim 0 may be
    shorter than the axis (some ranks then hold empty pieces)."""
    found, other_cuts = None, False
    for axis, placement in enumerate(spec):
        kind = _KINDS.get(type(placement)) or _kind(placement)
        if kind & _REPLICATE:
            continue
        if kind != _SHARD:
            return None
        if placement.dim != 0:
            other_cuts = True  # checked below: even, on an axis larger than 1
            continue
        if found is not None or mesh_shape[axis] == 1:
            return None
        found = axis
    if found is None or not shape or shape[0] % mesh_shape[found] == 0:
        return None
    if other_cuts and not is_valid(shape, (*spec[:found], R, *spec[found + 1 :]), mesh_shape):
        return None
    return found


def is_valid_param(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """``is_valid``, or a padded parameter shard (``padded_axis``): the specs a parameter may be
    held as."""
    return is_valid(shape, spec, mesh_shape) or padded_axis(shape, spec, mesh_shape) is not None


def padded_transition_ok(shape: Sequence[int], src: Spec, dst: Spec, mesh_shape: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` held as ``src`` may be resharded to ``dst`` as far as padding
    goes: a padded parameter shard only to ``R`` on its padded axis with every other axis as it is
    (one all-gather of the padded pieces on that axis, whose backward reduce-scatters the padded
    gradient there), any other spec freely."""
    if not shape or all(shape[0] % size == 0 for size in mesh_shape):
        return True
    axis = padded_axis(shape, src, mesh_shape)
    if axis is None or tuple(src) == tuple(dst):
        return True
    return all(bool(_kind(d) & _REPLICATE) if a == axis else d == s for a, (s, d) in enumerate(zip(src, dst)))


def chunk_piece(x: torch.Tensor, dim: int, k: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``torch.chunk(x, k, dim)``, empty where chunk gives fewer than ``k``
    pieces (``ceil(n / k)`` rows a piece: DTensor's and FSDP2's cut of an uneven dim)."""
    rows = -(-x.shape[dim] // k)
    start = min(rows * index, x.shape[dim])
    return x.narrow(dim, start, min(rows, x.shape[dim] - start))


def pad_piece(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros after its end along ``dim`` up to ``size`` rows (itself when that long): a
    padded shard's piece (or its gradient) laid out as the collectives move it, ``k`` equal
    chunks of ``ceil(n / k)`` rows, as FSDP2 pads them."""
    short = size - x.shape[dim]
    if short <= 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[:dim] + (short,) + x.shape[dim + 1 :])], dim)


def piece_rows(size: int, k: int, index: int) -> int:
    """Rows of piece ``index`` of a dim of ``size`` cut ``torch.chunk``'s way into ``k``."""
    rows = -(-size // k)
    return max(0, min(rows, size - rows * index))


def piece_shape(shape: Sequence[int], spec: Spec, coordinate: Sequence[int], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape the rank at mesh ``coordinate`` holds (``shard_tensor``'s piece): ``local_shape``
    but for a padded parameter shard, whose rank holds its own, unpadded piece."""
    out = list(shape)
    for axis, placement in enumerate(spec):
        if _kind(placement) & _SHARD:
            out[placement.dim] = piece_rows(out[placement.dim], mesh_shape[axis], coordinate[axis])
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Step:
    """One collective (or local slice) on one mesh axis.

    kinds: ``all_reduce`` (P→R), ``reduce_scatter`` (P→S(dim)), ``all_gather`` (S(dim)→R),
    ``chunk`` (R→S(dim), local, no communication in forward), ``all_to_all`` (S(src_dim)→S(dim)).
    ``blocks`` > 1 makes an ``all_gather`` or ``chunk`` strided: S(dim)/blocks ↔ R.
    """

    kind: str
    axis: int
    dim: int = -1
    src_dim: int = -1
    blocks: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("all_reduce", "reduce_scatter", "all_gather", "chunk", "all_to_all"):
            raise InternalError(f"unknown step kind {self.kind!r}")


PlacementKey = tuple  # ``placement_key``'s (kind, dim, blocks)


def transition_steps(src: Spec, dst: Spec) -> tuple[Step, ...] | None:
    """The collectives that turn a tensor held as ``src`` into ``dst``, or None if impossible.

    Turning R or S into P is never needed by autopar's rules and is reported impossible.
    Phase 1 walks axes innermost first and brings each changing axis to R (or straight to its
    target with one reduce-scatter or all-to-all when no other axis shards the same dim, so
    nesting order is kept). Phase 2 walks axes outermost first and chunks R into the target.
    The steps are ``steps_between`` the specs' keys (``spec_key``).
    """
    if len(src) != len(dst):
        raise InternalError(f"spec lengths differ: {src} vs {dst}")
    return steps_between(spec_key(src), spec_key(dst))


@functools.lru_cache(maxsize=1 << 18)  # a 3-axis mesh has tens of thousands of pairs per tensor rank
def steps_between(src: tuple[PlacementKey, ...], dst: tuple[PlacementKey, ...]) -> tuple[Step, ...] | None:
    """``transition_steps`` of the specs whose ``spec_key``s are ``src`` and ``dst``. Placements
    are read once each, as keys, and compared as those (torch's placement ``__eq__`` and
    ``__hash__`` were most of the time of the ~20,000 new pairs a 3-axis mesh asks for per plan);
    equal steps are one object (``_step``)."""
    num = len(src)
    if src == dst:
        return ()
    keys = list(src + dst)
    kinds = [key[0] for key in keys]
    if any(map(_STRIDED.__and__, kinds)):
        return _strided_steps(keys, num)
    for s, d in zip(kinds, kinds[num:]):
        if d & _PARTIAL and not s & _PARTIAL:
            return None
    reset = _axes_to_reset(keys, num)
    now, ends = keys[:num], keys[num:]  # the keys of the placements now and of the target's
    steps: list[Step] = []
    for axis in reversed(range(num)):
        if not reset[axis]:
            continue
        (s_kind, s_dim, _), (d_kind, d_dim, _) = now[axis], ends[axis]
        if s_kind & _PARTIAL:
            if d_kind & _SHARD and _dim_free(d_dim, axis, now, ends):
                steps.append(_step("reduce_scatter", axis, d_dim))
                now[axis] = ends[axis]
            else:
                steps.append(_step("all_reduce", axis))
                now[axis] = REPLICATE_KEY
        elif s_kind & _SHARD:
            if d_kind & _SHARD and s_dim != d_dim and _dim_free(d_dim, axis, now, ends) and _dim_free(s_dim, axis, now, ends):
                steps.append(_step("all_to_all", axis, d_dim, s_dim))
                now[axis] = ends[axis]
            else:
                steps.append(_step("all_gather", axis, s_dim))
                now[axis] = REPLICATE_KEY
    for axis in range(num):
        if now[axis] != ends[axis]:
            assert now[axis][0] & _REPLICATE and ends[axis][0] & _SHARD
            steps.append(_step("chunk", axis, ends[axis][1]))
    return tuple(steps)


REPLICATE_KEY: PlacementKey = (_REPLICATE, 0, 1)  # ``placement_key(R)``


def placement_key(placement: Placement) -> PlacementKey:
    """(kind, dim, blocks) of a placement: equal keys for equal placements and only for them
    (a Partial's reduce op in the dim's place; a placement of no kind autopar knows compares as
    itself). ``_kind`` and attribute reads instead of torch's ``__eq__``, which checks types
    through a metaclass hook."""
    kind = _kind(placement)
    if kind & _STRIDED:
        return (kind, placement.dim, placement.split_factor)
    if kind & _SHARD:
        return (kind, placement.dim, 1)
    if kind & _REPLICATE:
        return REPLICATE_KEY
    if kind & _PARTIAL:
        return (kind, placement.reduce_op, 1)
    return (kind, placement, 1)


def spec_key(spec: Spec) -> tuple[PlacementKey, ...]:
    """Each placement's ``placement_key``: a tuple of ints that hashes and compares in C."""
    return tuple(map(placement_key, spec))


def key_local_shape(shape: Sequence[int], key: tuple[PlacementKey, ...], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """``local_shape`` of the spec whose ``spec_key`` is ``key``."""
    out = list(shape)
    for axis, (kind, dim, _) in enumerate(key):
        if kind & _SHARD:
            out[dim] = -(-out[dim] // mesh_shape[axis])
    return tuple(out)


_STEPS: dict[tuple, Step] = {}  # ``_step``'s, by its arguments


def _step(*args) -> Step:
    """``Step(*args)``, one object per distinct step (frozen: sharing them is safe)."""
    step = _STEPS.get(args)
    if step is None:
        step = _STEPS[args] = Step(*args)
    return step


def _axes_to_reset(keys: list[tuple], num: int) -> list[bool]:
    """Per axis, whether it must be gathered and re-cut: the axes that change, and the inner
    axes that shard a dim whose outer sharding changes (their chunks would otherwise come out
    in the wrong order). ``keys``: the ``placement_key`` of each placement of the source spec,
    then of the target's. One pass, outermost first, finds them all: an axis is reset by outer ones only."""
    src, dst = keys[:num], keys[num:]
    reset = [src[axis] != dst[axis] for axis in range(num)]
    for axis, key in enumerate(src):
        if not reset[axis] and key[0] & _SHARD:
            reset[axis] = any(reset[b] and key in (src[b], dst[b]) for b in range(axis))
    return reset


def _dim_free(dim: int, axis: int, now: list[tuple], ends: list[tuple]) -> bool:
    """No axis but ``axis`` shards ``dim`` now or in the target, so nesting order cannot be
    broken (placements that are not strided here: a plain ``Shard`` equals ``Shard(dim)`` by its
    dim); ``now`` and ``ends``: the ``placement_key``s of the current placements and of the target's."""
    for a in range(len(now)):
        if a == axis:
            continue
        if now[a][0] & _SHARD and now[a][1] == dim or ends[a][0] & _SHARD and ends[a][1] == dim:
            return False
    return True


def _strided_steps(keys: list[PlacementKey], num: int) -> tuple[Step, ...] | None:
    """Transitions to or from a strided shard: the changing axes are brought to R (a strided
    axis by a strided all-gather), innermost first, then cut into the target, outermost
    first. A strided dim is sharded on one axis only (``is_valid``), so no nesting is broken.
    ``keys``: the ``placement_key`` of each placement of the source spec, then of the target's."""
    kinds = [key[0] for key in keys]
    for s, d in zip(kinds, kinds[num:]):
        if d & _PARTIAL and not s & _PARTIAL:
            return None
    reset = _axes_to_reset(keys, num)
    now, ends = keys[:num], keys[num:]
    steps: list[Step] = []
    for axis in reversed(range(num)):
        if not reset[axis]:
            continue
        key, kind = now[axis], kinds[axis]
        if kind & _PARTIAL:
            steps.append(_step("all_reduce", axis))
        elif kind & _STRIDED:
            steps.append(_step("all_gather", axis, key[1], -1, key[2]))
        elif kind & _SHARD:
            steps.append(_step("all_gather", axis, key[1]))
        now[axis] = REPLICATE_KEY
    for axis in range(num):
        end = ends[axis]
        if now[axis] != end:
            steps.append(_step("chunk", axis, end[1], -1, end[2] if end[0] & _STRIDED else 1))
            now[axis] = end
    return tuple(steps)


# Step kinds as numbers (``routes_between``); 0: no step.
STEP_KINDS = ("", "all_reduce", "reduce_scatter", "all_gather", "chunk", "all_to_all")
_AR, _RS, _AG, _CHUNK, _A2A = 1, 2, 3, 4, 5
_NO_DIM = -128  # ``PlacementNumbers``' dim of a placement that is not a shard


class PlacementNumbers:
    """``placement_key``s numbered in the order first seen, ``REPLICATE_KEY`` as 0, with each
    one's kind and dim (``_NO_DIM`` where not a shard) as arrays: how ``routes_between`` reads specs.
    Small ints (``dtype``; kinds and dims int8), so that a million pairs' arrays stay small."""

    dtype = np.int16

    def __init__(self):
        self.keys: list[PlacementKey] = []
        self._numbers: dict[PlacementKey, int] = {}
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None
        self.number(REPLICATE_KEY)

    def number(self, key: PlacementKey) -> int:
        found = self._numbers.get(key)
        if found is None:
            if len(self.keys) == np.iinfo(self.dtype).max or key[0] & _SHARD and not _NO_DIM < key[1] < 128:
                raise InternalError(f"placement {key} is one too many for a route's numbering (``PlacementNumbers``)")
            found = self._numbers[key] = len(self.keys)
            self.keys.append(key)
            self._arrays = None
        return found

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(kind, dim) of each number."""
        if self._arrays is None:
            kinds = np.array([key[0] for key in self.keys], dtype=np.int8)
            dims = np.array([key[1] if key[0] & _SHARD else _NO_DIM for key in self.keys], dtype=np.int8)
            self._arrays = (kinds, dims)
        return self._arrays


class Routes(NamedTuple):
    """``steps_between`` of many pairs (``routes_between``), a column per pair. A route has a slot
    per step it may take, in the order steps are taken: the axes innermost first (gathers,
    reductions, all-to-alls), then outermost first (chunks); ``slot_axis`` names each slot's axis."""

    possible: np.ndarray  # (pairs,) bool: False where ``steps_between`` is None (no steps)
    kinds: np.ndarray  # (slots, pairs) int8: each slot's step, by ``STEP_KINDS``; 0 none
    before: np.ndarray  # (slots, pairs) int64: the placements before the step, Σ number[a]·base**a; 0 with no step
    base: int  # how many placement numbers there were


def slot_axis(slot: int, num_axes: int) -> int:
    """The mesh axis of a ``Routes`` slot."""
    return num_axes - 1 - slot if slot < num_axes else slot - num_axes


def routes_between(src: np.ndarray, dst: np.ndarray, numbers: PlacementNumbers) -> Routes:
    """``steps_between`` of each (``src[k]``, ``dst[k]``), specs as rows of placement numbers
    (``numbers``), all at once with numpy: the same steps, and the placements before each
    (a 4-axis mesh prices ~10^6 pairs; ``cost.comm.TransitionPrices.price_pairs``). Arrays are
    axis by pair inside, so that each axis is one contiguous run."""
    kinds_of, dims_of = numbers.arrays()
    count, num = src.shape
    base = len(numbers.keys)
    if base**num >= 1 << 59:
        raise InternalError(f"{base} placements on {num} axes overflow a route's numbering")
    weights = base ** np.arange(num, dtype=np.int64)
    src, dst = np.ascontiguousarray(src.T), np.ascontiguousarray(dst.T)
    src_kind, dst_kind = np.take(kinds_of, src), np.take(kinds_of, dst)
    src_dim, dst_dim = np.take(dims_of, src), np.take(dims_of, dst)
    possible = np.bitwise_or.reduce(dst_kind & ~src_kind & _PARTIAL, axis=0) == 0
    simple = np.bitwise_or.reduce((src_kind | dst_kind) & _STRIDED, axis=0) == 0  # ``steps_between``'s own walk
    reset = _resets(src, dst, src_kind & _SHARD != 0)
    dst_shard = dst_kind & _SHARD != 0
    kinds = np.zeros((2 * num, count), dtype=np.int8)
    before = np.zeros((2 * num, count), dtype=np.int64)
    # The placements as the steps go, their number, and the dims they shard (``_NO_DIM``: none).
    now, code, now_dim = src.copy(), weights @ src, src_dim.copy()
    movable = src_kind & (_PARTIAL | _SHARD) != 0
    for slot, axis in enumerate(reversed(range(num))):
        rows = np.flatnonzero(reset[axis] & movable[axis] & possible)  # the pairs with a step here
        partial = src_kind[axis, rows] & _PARTIAL != 0
        step = np.where(partial, np.int8(_AR), np.int8(_AG))  # unless straight to the target:
        near = np.flatnonzero(simple[rows] & dst_shard[axis, rows])
        ends = rows[near]
        target = dst_dim[axis, ends]
        free = _dims_free(target, axis, now_dim[:, ends], dst_dim[:, ends])
        to_all = free & ~partial[near] & (src_dim[axis, ends] != target)
        others = ends[to_all]
        to_all[to_all] = _dims_free(src_dim[axis, others], axis, now_dim[:, others], dst_dim[:, others])
        step[near[free & partial[near]]] = _RS
        step[near[to_all]] = _A2A
        kinds[slot, rows] = step
        before[slot, rows] = code[rows]
        code[rows] -= now[axis, rows] * weights[axis]  # to replicated (number 0), or:
        now[axis, rows], now_dim[axis, rows] = 0, _NO_DIM
        moved = ends[(free & partial[near]) | to_all]
        code[moved] += dst[axis, moved] * weights[axis]
        now[axis, moved], now_dim[axis, moved] = dst[axis, moved], target[(free & partial[near]) | to_all]
    for axis in range(num):
        rows = np.flatnonzero((now[axis] != dst[axis]) & possible)
        if not ((now[axis, rows] == 0) & dst_shard[axis, rows] | ~simple[rows]).all():
            raise AssertionError("a chunk of a placement that is not replicated, into one that is not a shard")
        kinds[num + axis, rows] = _CHUNK
        before[num + axis, rows] = code[rows]
        code[rows] += (dst[axis, rows] - now[axis, rows]) * weights[axis]
        now[axis, rows] = dst[axis, rows]
    return Routes(possible, kinds, before, base)


def numbered_elements(
    shape: Sequence[int], states: np.ndarray, base: int, numbers: PlacementNumbers, mesh_shape: Sequence[int]
) -> np.ndarray:
    """``math.prod(key_local_shape(shape, key, mesh_shape))`` of the placements each of ``states``
    numbers (``Routes.before``: Σ number[a]·``base``**a), the same ints."""
    dims = numbers.arrays()[1][states[:, None] // base ** np.arange(len(mesh_shape), dtype=np.int64) % base]
    local = np.tile(np.asarray(shape, dtype=np.int64), (len(states), 1))
    for axis, size in enumerate(mesh_shape):
        sharded = np.flatnonzero(dims[:, axis] != _NO_DIM)
        local[sharded, dims[sharded, axis]] = -(-local[sharded, dims[sharded, axis]] // size)  # padded: ceil
    return local.prod(axis=1)


def _resets(src: np.ndarray, dst: np.ndarray, src_shard: np.ndarray) -> np.ndarray:
    """``_axes_to_reset`` of each pair (specs as placement numbers, axis by pair)."""
    reset = src != dst
    for axis in range(1, len(src)):
        inherited = np.zeros(src.shape[1], dtype=bool)
        for b in range(axis):
            inherited |= reset[b] & ((src[axis] == src[b]) | (src[axis] == dst[b]))
        reset[axis] |= src_shard[axis] & inherited
    return reset


def _dims_free(dim: np.ndarray, axis: int, now: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``_dim_free`` of each pair: ``now`` and ``ends``, the dims the placements now and the
    target's shard (``_NO_DIM``: none), axis by pair; ``dim`` is a shard's."""
    taken = (now == dim) | (ends == dim)
    taken[axis] = False
    return ~taken.any(axis=0)


# Strided shards (S(d)/k) cut a dim into `blocks` equal blocks and give each rank its chunk of each.
def _split_dim(x: torch.Tensor, dim: int, sizes: tuple[int, ...]) -> torch.Tensor:
    dim = dim % x.dim()
    return x.reshape(*x.shape[:dim], *sizes, *x.shape[dim + 1 :])


def strided_piece(x: torch.Tensor, dim: int, k: int, index: int, blocks: int) -> torch.Tensor:
    """Piece ``index`` of ``k`` under a strided shard: chunk ``index`` of each of ``blocks``
    equal blocks of ``dim``, concatenated in block order."""
    dim = dim % x.dim()
    size = x.shape[dim]
    parts = _split_dim(x, dim, (blocks, k, size // (blocks * k)))
    return parts.select(dim + 1, index).reshape(*x.shape[:dim], size // k, *x.shape[dim + 1 :]).contiguous()


def unstride(x: torch.Tensor, dim: int, k: int, blocks: int) -> torch.Tensor:
    """The whole tensor from the ``k`` strided pieces concatenated along ``dim`` (rank order)."""
    dim = dim % x.dim()
    size = x.shape[dim]
    parts = _split_dim(x, dim, (k, blocks, size // (blocks * k))).transpose(dim, dim + 1)
    return parts.reshape(x.shape).contiguous()


def shard_tensor(full: torch.Tensor, spec: Spec, coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of ``full`` under ``spec`` (axis 0 outermost; an uneven dim is cut as
    ``torch.chunk`` cuts it, with empty pieces where it gives fewer than the axis size)."""
    local = full
    for axis, placement in enumerate(spec):
        if is_strided(placement):
            local = strided_piece(local, placement.dim, mesh_shape[axis], coordinate[axis], placement.split_factor)
        elif isinstance(placement, Shard):
            local = chunk_piece(local, placement.dim, mesh_shape[axis], coordinate[axis])
    return local.contiguous()


# ATen ops whose output aliases their input. The cost model prices them as free and the summary
# leaves them out of its node table.
VIEW_OP_NAMES = frozenset(
    {
        "view",
        "reshape",
        "_unsafe_view",
        "_reshape_alias",
        "view_as",
        "transpose",
        "permute",
        "expand",
        "expand_as",
        "t",
        "unsqueeze",
        "squeeze",
        "alias",
        "detach",
        "split",
        "split_with_sizes",
        "unbind",
        "chunk",
        "select",
        "slice",
        "narrow",
        "unflatten",
        "flatten",
        "as_strided",
        "movedim",
        "swapaxes",
        "lift_fresh",
    }
)
