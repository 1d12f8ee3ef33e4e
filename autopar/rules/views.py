"""Sharding rules for view ops: reshapes, permutations, expand, split, cat, slicing.

Every op here only moves or copies elements, so each is linear: Partial passes through (P in,
P out). Sharding follows a tensor dim through the op:

- Reshape-like ops (view, reshape, flatten, unflatten, squeeze, unsqueeze) group the non-size-1
  input and output dims into blocks with equal products, as DTensor's ``view_groups`` does. Only
  the leading dim of a block may be sharded, and it maps to the block's leading output dim: a
  rank's shard is then a contiguous 1/k of the block's flattened range on both sides, so the
  local op is exact whenever both dims divide by k (the framework's evenness check).
- Permutations map each dim to where it moves.
- ``expand`` keeps the dims it does not broadcast; a broadcast output dim may be sharded while
  the input stays replicated, since each rank expands to its own local size.
- Split, cat, stack, slice, select and narrow work on one dim; every other dim may be sharded.
- Strided shards (``spec.SS``, a fused projection's layout) pass through a reshape that keeps
  their dim whole, and a split into as many equal parts as the blocks turns them into plain
  shards of each part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from autopar.ir.spec import SS, P, Placement, R, S
from autopar.rules.registry import OpInfo, Row, TensorArg, register, strided_blocks

aten = torch.ops.aten


def _norm(dim: int, ndim: int) -> int:
    """A non-negative dim; a 0-d tensor accepts dims -1 and 0, as torch's wrap_dim does."""
    return dim % max(ndim, 1)


def _linear_rows(num_inputs: int, num_outs: int | None = None) -> list[Row]:
    """The all-replicated row and, since view ops are linear, the all-partial one.
    ``num_outs`` is the number of outputs of an op that returns a tuple."""

    def outs(p: Placement) -> Placement | tuple[Placement, ...]:
        return p if num_outs is None else (p,) * num_outs

    return [Row((R,) * num_inputs, outs(R)), Row((P,) * num_inputs, outs(P))]


# --------------------------------------------------------------------------------------------
# Reshape-like ops


def reshape_dim_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dim → output dim for every dim that may be sharded through a reshape.

    Size-1 dims are left out; the others are grouped into blocks with equal products, and the
    leading input dim of each block maps to the leading output dim of the block.
    """
    if math.prod(in_shape) != math.prod(out_shape) or math.prod(in_shape) == 0:
        return {}
    in_dims = [d for d, size in enumerate(in_shape) if size != 1]
    out_dims = [d for d, size in enumerate(out_shape) if size != 1]
    mapping: dict[int, int] = {}
    i = j = 0
    while i < len(in_dims) and j < len(out_dims):
        mapping[in_dims[i]] = out_dims[j]
        in_prod, out_prod = in_shape[in_dims[i]], out_shape[out_dims[j]]
        i, j = i + 1, j + 1
        while in_prod != out_prod:
            if in_prod < out_prod:
                in_prod *= in_shape[in_dims[i]]
                i += 1
            else:
                out_prod *= out_shape[out_dims[j]]
                j += 1
    return mapping


def _reshape_rows(info: OpInfo, frozen_dims: Sequence[int] = ()) -> list[Row]:
    """Rows for an op that keeps the data order and only changes the shape.

    ``frozen_dims`` are input dims that must stay unsharded (see ``squeeze_rule``).
    """
    source = info.inputs[0]
    rows = _linear_rows(1)
    for in_dim, out_dim in reshape_dim_map(source.shape, info.out_shape).items():
        if in_dim not in frozen_dims:
            rows.append(Row((S(in_dim),), S(out_dim)))
            # A dim that the reshape carries over whole keeps its blocks, so a strided shard of
            # it passes (a dim that is merged or split would mix the blocks with other dims).
            if source.shape[in_dim] == info.out_shape[out_dim]:
                rows += [Row((SS(in_dim, n),), SS(out_dim, n)) for n in strided_blocks()]
    return rows


@register(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.unsqueeze.default,
)
def reshape_rule(info: OpInfo) -> list[Row]:
    # Sizes given as -1 need no care: the map is read off the resolved output shape, and
    # localize_kwargs rewrites size arguments to the local output shape.
    return _reshape_rows(info)


@register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze_rule(info: OpInfo) -> list[Row]:
    # squeeze drops every *local* size-1 dim it is asked about, so a dim that a shard shrinks
    # to size 1 would vanish on the ranks. The named dims are therefore never sharded (their
    # global size is 1, or the squeeze is a no-op on them), and squeeze() with no dims, which
    # names every dim, shards nothing: a row cannot know whether a shard would shrink a dim to 1.
    ndim = info.inputs[0].ndim
    if info.target is aten.squeeze.default:
        return _linear_rows(1)
    dims = info.kw["dim"]
    dims = [dims] if isinstance(dims, int) else list(dims)
    return _reshape_rows(info, frozen_dims=[_norm(d, ndim) for d in dims])


@register(aten.view_as.default)
def view_as_rule(info: OpInfo) -> list[Row]:
    # The local result takes the local shape of ``other``, so ``other`` is sharded as the
    # output is; when the output is not sharded, any unsharded ``other`` has the right shape.
    source = info.inputs[0]
    rows = [Row((R, R), R), Row((P, R), P), Row((P, P), P)]
    for in_dim, out_dim in reshape_dim_map(source.shape, info.out_shape).items():
        rows.append(Row((S(in_dim), S(out_dim)), S(out_dim)))
    return rows


@register(aten.view.dtype)
def view_dtype_rule(info: OpInfo) -> list[Row]:
    # Reinterpreting bits is not linear, so no Partial. With a different element size the
    # last dim changes length and cannot be sharded.
    source = info.inputs[0]
    same_size = source.dtype.itemsize == info.kw["dtype"].itemsize
    last = source.ndim - 1
    rows = [Row((R,), R)]
    for dim in range(source.ndim):
        if source.shape[dim] > 1 and (same_size or dim != last):
            rows.append(Row((S(dim),), S(dim)))
    return rows


# --------------------------------------------------------------------------------------------
# Permutations


def _permutation(info: OpInfo) -> list[int]:
    """``perm[out_dim] = in_dim`` for the permutation ops."""
    ndim = info.inputs[0].ndim
    order = list(range(ndim))
    target, kw = info.target, info.kw
    if ndim == 0:  # transpose(0, 0) and friends accept a 0-d tensor
        return order
    if target is aten.permute.default:
        return [_norm(d, ndim) for d in kw["dims"]]
    if target in (aten.transpose.int, aten.swapaxes.default):
        names = ("dim0", "dim1") if target is aten.transpose.int else ("axis0", "axis1")
        a, b = (_norm(kw[n], ndim) for n in names)
        order[a], order[b] = order[b], order[a]
        return order
    if target in (aten.t.default, aten.numpy_T.default):
        return order[::-1]
    if target is aten.mT.default:
        order[-2], order[-1] = order[-1], order[-2]
        return order
    if target is aten.movedim.int:
        source, destination = _norm(kw["source"], ndim), _norm(kw["destination"], ndim)
        order.remove(source)
        order.insert(destination, source)
        return order
    raise AssertionError(f"no permutation for {target}")


@register(
    aten.permute.default,
    aten.transpose.int,
    aten.swapaxes.default,
    aten.t.default,
    aten.numpy_T.default,
    aten.mT.default,
    aten.movedim.int,
)
def permute_rule(info: OpInfo) -> list[Row]:
    shape = info.inputs[0].shape
    rows = _linear_rows(1)
    for out_dim, in_dim in enumerate(_permutation(info)):
        if shape[in_dim] > 1:
            rows.append(Row((S(in_dim),), S(out_dim)))
    return rows


# --------------------------------------------------------------------------------------------
# expand


def _expand_rows(in_shape: Sequence[int], out_shape: Sequence[int], num_inputs: int) -> list[Row]:
    """Rows for expanding ``in_shape`` to ``out_shape``. With ``num_inputs == 2`` (expand_as)
    the second input gives the target shape, so it is sharded as the output is."""
    offset = len(out_shape) - len(in_shape)

    def row(source: Placement, out: Placement) -> Row:
        if num_inputs == 1:
            return Row((source,), out)
        return Row((source, out if out != P else R), out)

    rows = [row(R, R), row(P, P)]
    if num_inputs == 2:
        rows.append(Row((P, P), P))
    for out_dim, size in enumerate(out_shape):
        if size <= 1:
            continue
        in_dim = out_dim - offset
        if in_dim >= 0 and in_shape[in_dim] == size:
            rows.append(row(S(in_dim), S(out_dim)))
        else:  # broadcast: each rank expands the replicated input to its own slice
            rows.append(row(R, S(out_dim)))
    return rows


@register(aten.expand.default)
def expand_rule(info: OpInfo) -> list[Row]:
    return _expand_rows(info.inputs[0].shape, info.out_shape, 1)


@register(aten.expand_as.default)
def expand_as_rule(info: OpInfo) -> list[Row]:
    return _expand_rows(info.inputs[0].shape, info.out_shape, 2)


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(info: OpInfo) -> list[Row]:
    # Each output is its input expanded to the common shape: expand's rows, applied to all.
    out_shape = info.out_shape
    num = len(info.inputs)
    rows = _linear_rows(num, num)
    for out_dim, size in enumerate(out_shape):
        if size <= 1:
            continue
        ins = []
        for arg in info.inputs:
            in_dim = out_dim - (len(out_shape) - arg.ndim)
            ins.append(S(in_dim) if in_dim >= 0 and arg.shape[in_dim] == size else R)
        rows.append(Row(tuple(ins), (S(out_dim),) * num))
    return rows


# --------------------------------------------------------------------------------------------
# Ops along one dim: split, cat, stack, slice, select, narrow


def _other_dims(shape: Sequence[int], dim: int) -> list[int]:
    return [d for d, size in enumerate(shape) if d != dim and size > 1]


@register(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.chunk.default,
    aten.unsafe_chunk.default,
    aten.tensor_split.sections,
    aten.tensor_split.indices,
)
def split_rule(info: OpInfo) -> list[Row]:
    source = info.inputs[0]
    dim = _norm(info.kw["dim"], source.ndim)
    num_outs = len(info.out_shapes)
    rows = _linear_rows(1, num_outs)
    for other in _other_dims(source.shape, dim):
        rows.append(Row((S(other),), (S(other),) * num_outs))
    # A fused projection's split: with the dim strided into as many blocks as there are equal
    # parts, each rank's local split gives its own chunk of every part (split sizes localized).
    equal = len(set(info.out_shapes)) == 1 and info.target not in _SPLITS_AT_INDICES
    if num_outs in strided_blocks() and equal:
        rows.append(Row((SS(dim, num_outs),), (S(dim),) * num_outs))
    return rows


# Splits whose arguments name positions, not sizes or counts: they cannot be localized.
_SPLITS_AT_INDICES = {aten.tensor_split.indices, aten.tensor_split.sections}


@register(aten.unbind.int)
def unbind_rule(info: OpInfo) -> list[Row]:
    source = info.inputs[0]
    dim = _norm(info.kw["dim"], source.ndim)
    num_outs = len(info.out_shapes)
    rows = _linear_rows(1, num_outs)
    for other in _other_dims(source.shape, dim):
        out_dim = other - (other > dim)
        rows.append(Row((S(other),), (S(out_dim),) * num_outs))
    return rows


def _list_inputs(info: OpInfo) -> list[TensorArg]:
    return [t for t in info.kw["tensors"] if isinstance(t, TensorArg)]


@register(aten.cat.default)
def cat_rule(info: OpInfo) -> list[Row]:
    tensors = _list_inputs(info)
    num_inputs = len(info.inputs)
    rows = _linear_rows(num_inputs)
    # torch.cat skips legacy empty 1-d inputs of any rank; such a cat is left unsharded.
    if any(t.ndim != info.out_ndim for t in tensors) or len(tensors) != num_inputs:
        return rows
    dim = _norm(info.kw["dim"], info.out_ndim)
    for other in _other_dims(info.out_shape, dim):
        rows.append(Row((S(other),) * num_inputs, S(other)))
    return rows


@register(aten.stack.default)
def stack_rule(info: OpInfo) -> list[Row]:
    num_inputs = len(info.inputs)
    rows = _linear_rows(num_inputs)
    if len(_list_inputs(info)) != num_inputs:
        return rows
    in_shape = info.inputs[0].shape
    dim = _norm(info.kw["dim"], len(in_shape) + 1)
    for in_dim in _other_dims(in_shape, -1):
        out_dim = in_dim + (in_dim >= dim)
        rows.append(Row((S(in_dim),) * num_inputs, S(out_dim)))
    return rows


def _is_whole_dim(size: int, start: Any, end: Any, step: Any) -> bool:
    start = 0 if start is None else start
    end = size if end is None else end
    return step in (None, 1) and start in (0, -size) and end >= size


@register(aten.slice.Tensor, aten.narrow.default)
def slice_rule(info: OpInfo) -> list[Row]:
    source = info.inputs[0]
    dim = _norm(info.kw["dim"], source.ndim)
    kw = info.kw
    # A slice that keeps the whole dim (x[:, :], end clamped to the size) is the identity on
    # every rank, so that dim may be sharded too. narrow's length is exact, never clamped.
    whole = info.target is aten.slice.Tensor and _is_whole_dim(source.shape[dim], kw["start"], kw["end"], kw["step"])
    rows = _linear_rows(1)
    for other in _other_dims(source.shape, -1 if whole else dim):
        rows.append(Row((S(other),), S(other)))
    return rows


@register(aten.select.int)
def select_rule(info: OpInfo) -> list[Row]:
    source = info.inputs[0]
    dim = _norm(info.kw["dim"], source.ndim)
    rows = _linear_rows(1)
    for other in _other_dims(source.shape, dim):
        rows.append(Row((S(other),), S(other - (other > dim))))
    return rows


# --------------------------------------------------------------------------------------------
# Scatters: what functionalization (``autopar.trace``) makes of in-place writes into views.
# ``x[:, 1:] = y`` becomes ``slice_scatter(x, y, 1, 1)``, ``x[:, 0] = y`` ``select_scatter``.
# Both are linear in (self, src) together, and the dims they do not write pass through.


@register(aten.slice_scatter.default)
def slice_scatter_rule(info: OpInfo) -> list[Row]:
    base = info.inputs[0]
    dim = _norm(info.kw["dim"], base.ndim)
    kw = info.kw
    whole = _is_whole_dim(base.shape[dim], kw["start"], kw["end"], kw["step"])
    rows = _linear_rows(2)
    for other in _other_dims(base.shape, -1 if whole else dim):
        rows.append(Row((S(other), S(other)), S(other)))
    return rows


@register(aten.select_scatter.default)
def select_scatter_rule(info: OpInfo) -> list[Row]:
    base = info.inputs[0]
    dim = _norm(info.kw["dim"], base.ndim)
    rows = _linear_rows(2)
    for other in _other_dims(base.shape, dim):
        rows.append(Row((S(other), S(other - (other > dim))), S(other)))
    return rows


__all__ = ["reshape_dim_map"]
