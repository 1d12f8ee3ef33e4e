"""Ask DTensor's sharding-propagation registry for ops that have no autopar rule.

DTensor keeps two kinds of strategy for an op in ``DTensor._op_dispatcher.sharding_propagator``:

- a *single-dim* strategy (``op_single_dim_strategy_funcs``): placements for one mesh axis, given
  tensor metadata only. It is already in the shape of autopar's rows; its sharding placeholders
  become ``Shard(dim)``.
- a full strategy function (``op_strategy_funcs``): given an ``OpStrategy`` per tensor input it
  returns the ``OpSpec``s it accepts. We call it on a one-dimensional mesh, offering every
  input as Replicate, Partial or Shard on each dim, and read each ``OpSpec`` as a row.

The mesh is a ``DeviceMesh`` built with ``_init_backend=False``: it has no process group, and no
default group is created, so a later ``init_process_group`` in the same process is unaffected.
Strategy functions only read its shape.

Rows are kept only where the plain op on local shards computes what DTensor's would:

- placements must be Replicate, Shard or Partial("sum"), never another reduce op, a
  ``MaskPartial`` (embedding) or a ``_StridedShard``;
- rows that DTensor completes by rewriting arguments that autopar leaves global are dropped:
  shape arguments of ops outside ``SIZE_ARGS`` (``slice_backward``, upsample backward), the
  scalar N, C, HxW of ``native_group_norm``, and squeeze dims;
- ops that DTensor runs through a custom handler (convolution, argmax) or its RNG tracker
  (dropout, ``rand_like``) are not asked at all.

Results are cached per op and arguments (shapes included). Anything unexpected gives None,
never an error (logged at debug level): the op then falls back to replication.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ir.spec import P, Placement, R, S
from autopar.rules.registry import FALLBACK_RULES, SIZE_ARGS, OpInfo, Row, TensorArg

logger = logging.getLogger(__name__)

_CACHE: dict[Hashable, tuple[Row, ...] | None] = {}
_MESH: Any = None


def rows_for(info: OpInfo) -> list[Row] | None:
    """Per-axis rows from DTensor's strategy for ``info.target``, or None if it has none."""
    key = _cache_key(info)
    if key is not None and key in _CACHE:
        cached = _CACHE[key]
        return list(cached) if cached is not None else None
    try:
        rows = _rows_from_dtensor(info)
    except Exception:  # DTensor internals are private and change between releases
        logger.debug("DTensor strategy for %s failed", info.describe(), exc_info=True)
        rows = None
    if not rows:
        rows = None
    if key is not None:
        _CACHE[key] = tuple(rows) if rows is not None else None
    return rows


def clear_cache() -> None:
    _CACHE.clear()


def _cache_key(info: OpInfo) -> Hashable | None:
    def freeze(value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return tuple(freeze(v) for v in value)
        return value

    key = (info.target, tuple(sorted((k, freeze(v)) for k, v in info.kw.items())), info.out_shapes)
    try:
        hash(key)
    except Exception:  # an unhashable argument (a SymInt, an odd object): no caching
        return None
    return key


def _mesh() -> Any:
    global _MESH
    if _MESH is None:
        from torch.distributed.device_mesh import DeviceMesh

        _MESH = DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0)
    return _MESH


def _dispatcher() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor._op_dispatcher


def _rows_from_dtensor(info: OpInfo) -> list[Row] | None:
    target = info.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    dispatcher = _dispatcher()
    # DTensor runs these with code of its own (halo exchange for convolution, a gather for
    # argmax over a sharded dim, its RNG tracker for random ops), so their strategies do not
    # describe the plain op on local shards.
    if target in getattr(dispatcher, "_custom_op_handlers", {}) or target in getattr(dispatcher, "_random_ops", ()):
        return None
    propagator = dispatcher.sharding_propagator
    if target in propagator.op_single_dim_strategy_funcs:
        raw = _single_dim_rows(info, propagator.op_single_dim_strategy_funcs[target])
    elif target in propagator.op_strategy_funcs:
        raw = _strategy_func_rows(info, propagator)
    else:
        # op_to_rules holds only convolution in torch 2.13, which also has a single-dim
        # strategy; decomposition-based strategies are not consulted.
        return None
    if raw is None:
        return None
    rows = [row for row in raw if row is not None and _runs_locally(info, row, propagator)]
    replicate = Row(tuple(R for _ in info.inputs), _outs(info, [R] * len(info.out_shapes)))
    if replicate not in rows:
        rows.insert(0, replicate)
    return rows


def _runs_locally(info: OpInfo, row: Row, propagator: Any) -> bool:
    """False for rows that DTensor completes by rewriting arguments autopar leaves global."""
    target = info.target
    sharded_out = any(isinstance(p, Shard) for p in row.outs)
    sharded_in = any(isinstance(p, Shard) for p in row.ins)
    if target in getattr(propagator, "op_to_shape_and_stride_idx", {}) and target not in SIZE_ARGS:
        return not sharded_out
    if target in getattr(propagator, "op_to_scalar_shape_adjuster", {}):
        return not sharded_in
    if target in getattr(propagator, "squeeze_op_to_dims_variant", {}):
        return not (sharded_in or sharded_out)
    return True


# --------------------------------------------------------------------------------------------
# Converting placements


def _placement(value: Any, ndim: int) -> Placement | None:
    """autopar's placement for a DTensor placement, or None if autopar cannot use it."""
    if type(value) is Replicate:
        return R
    if type(value) is Partial and value.reduce_op == "sum":
        return P
    if type(value) is Shard and -ndim <= value.dim < ndim:
        return S(value.dim % ndim)
    return None


def _outs(info: OpInfo, outs: list[Placement]) -> Placement | tuple[Placement, ...]:
    return tuple(outs) if info.out_is_tuple else outs[0]


def _make_row(info: OpInfo, in_values: list[Any], out_values: list[Any]) -> Row | None:
    """A row from DTensor placements, one per tensor input and one per output (None for an
    output the op does not return), or None if any placement is unusable."""
    out_values = [v for v in out_values if v is not None]
    if len(in_values) != len(info.inputs) or len(out_values) != len(info.out_shapes):
        return None
    ins = [_placement(v, arg.ndim) for v, arg in zip(in_values, info.inputs)]
    outs = [_placement(v, len(shape)) for v, shape in zip(out_values, info.out_shapes)]
    if any(p is None for p in ins + outs):
        return None
    return Row(tuple(ins), _outs(info, outs))


# --------------------------------------------------------------------------------------------
# Single-dim strategies


def _single_dim_rows(info: OpInfo, strategy: Any) -> list[Row | None] | None:
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

    def to_meta(value: Any) -> Any:
        # As DTensor's OpSchema.args_meta: a list of tensors becomes a tuple of TensorMeta.
        if isinstance(value, TensorArg):
            return _tensor_meta(value)
        if isinstance(value, (list, tuple)):
            metas = [to_meta(v) for v in value]
            all_tensors = bool(value) and all(isinstance(v, TensorArg) for v in value)
            return tuple(metas) if all_tensors else type(value)(metas)
        return value

    args, kwargs = _split_args(info.target, info.kw, to_meta)
    func = getattr(strategy, "func", strategy)
    raw = func(info.target, tuple(args), kwargs)
    num_inputs = len(info.inputs)
    rows: list[Row | None] = []
    for entry in raw:
        entry = [Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in entry]
        num_outs = len(entry) - num_inputs
        if num_outs < 1:
            return None
        rows.append(_make_row(info, entry[num_outs:], entry[:num_outs]))
    return rows


# --------------------------------------------------------------------------------------------
# Full strategy functions


def _strategy_func_rows(info: OpInfo, propagator: Any) -> list[Row | None] | None:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy

    mesh = _mesh()

    def to_strategy(value: Any) -> Any:
        # Offer every placement, so that strategies that follow their input list them all.
        if isinstance(value, TensorArg):
            meta = _tensor_meta(value)
            candidates = [Replicate(), Partial()] + [Shard(d) for d in range(value.ndim)]
            specs = [DTensorSpec(mesh, (p,), tensor_meta=meta) for p in candidates]
            return OpStrategy([OpSpec(spec) for spec in specs])
        if isinstance(value, (list, tuple)):
            if value and all(isinstance(v, TensorArg) for v in value):
                return TupleStrategy([to_strategy(v) for v in value])
            return type(value)(to_strategy(v) for v in value)
        return value

    args, kwargs = _split_args(info.target, info.kw, to_strategy)
    schema = OpSchema(info.target, tuple(args), kwargs, schema_info=propagator.op_to_schema_info.get(info.target))
    result = propagator.op_strategy_funcs[info.target](schema)
    if not isinstance(result, OpStrategy):
        return None
    rows: list[Row | None] = []
    for spec in result.strategies:
        outputs = spec.output_specs
        out_specs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        if spec.input_specs is None:
            if len(out_specs) != 1:
                return None
            in_specs = [out_specs[0]] * len(info.inputs)
        else:
            in_specs = list(spec.input_specs)
        if any(s.mesh.ndim != 1 for s in in_specs + [o for o in out_specs if o is not None]):
            return None
        rows.append(
            _make_row(
                info,
                [s.placements[0] for s in in_specs],
                [o.placements[0] if o is not None else None for o in out_specs],
            )
        )
    return rows


# --------------------------------------------------------------------------------------------


def _split_args(target: Any, kw: dict[str, Any], convert: Any) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword-only arguments of ``target`` from ``kw``, each converted.
    Keyword-only arguments left at their default are omitted, as in a dispatched call."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for argument in target._schema.arguments:
        value = kw.get(argument.name)
        if not argument.kwarg_only:
            args.append(convert(value))
        elif not (argument.has_default_value() and value == argument.default_value):
            kwargs[argument.name] = convert(value)
    return args, kwargs


def _tensor_meta(arg: TensorArg) -> Any:
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    stride, running = [], 1
    for size in reversed(arg.shape):
        stride.append(running)
        running *= max(size, 1)
    return TensorMeta(torch.Size(arg.shape), tuple(reversed(stride)), arg.dtype)


FALLBACK_RULES.append(rows_for)

__all__ = ["rows_for", "clear_cache"]
