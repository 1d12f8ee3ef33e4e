"""Sharding rules for reductions: sum, mean, amax/amin, max/min.dim, argmax/argmin, var/std,
prod, logsumexp, cumsum.

A dim that is not reduced may be sharded; the matching output dim is then sharded too (its index
shifts down past reduced dims unless ``keepdim``). A reduced dim may be sharded only where each
rank's result is a summand of the whole: ``sum`` gives Partial, ``mean`` gives Partial through
the ``mean_partial`` kernel (local sum over the *global* count). Extrema and variances of a
sharded reduced dim are not sums and are not offered. Sum and mean are linear, so P → P.
"""

from __future__ import annotations

from typing import Any

import torch

from autopar.ir.spec import P, S
from autopar.rules.pointwise import out_placement
from autopar.rules.registry import OpInfo, Row, register, replicate_row

aten = torch.ops.aten


def reduced_dims(ndim: int, dim: Any) -> set[int]:
    """Reduced dims as non-negative ints. ``None`` and ``[]`` mean every dim (aten's convention
    for the ``dim_IntList`` overloads)."""
    if dim is None:
        return set(range(ndim))
    if isinstance(dim, int):
        dims = [dim]
    else:
        dims = list(dim)
        if not dims:
            return set(range(ndim))
    return {d % ndim if ndim else 0 for d in dims}


def kept_rows(info: OpInfo, reduced: set[int], keepdim: bool) -> list[Row]:
    """All-R, plus one row per kept dim: shard it on the input and its image on the output."""
    rows = [replicate_row(info)]
    ndim = info.inputs[0].ndim
    for dim in range(ndim):
        if dim in reduced:
            continue
        out_dim = dim if keepdim else dim - sum(1 for r in reduced if r < dim)
        rows.append(Row((S(dim),), out_placement(info, S(out_dim))))
    return rows


def _dim_and_keepdim(info: OpInfo) -> tuple[set[int], bool]:
    ndim = info.inputs[0].ndim
    return reduced_dims(ndim, info.kw.get("dim")), bool(info.kw.get("keepdim", False))


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(info: OpInfo) -> list[Row]:
    reduced, keepdim = _dim_and_keepdim(info)
    rows = kept_rows(info, reduced, keepdim)
    rows += [Row((S(dim),), P) for dim in sorted(reduced)]
    rows.append(Row((P,), P))
    return rows


@register(aten.mean.default, aten.mean.dim)
def mean_rule(info: OpInfo) -> list[Row]:
    reduced, keepdim = _dim_and_keepdim(info)
    rows = kept_rows(info, reduced, keepdim)
    rows += [Row((S(dim),), P, kernel="mean_partial") for dim in sorted(reduced)]
    rows.append(Row((P,), P))
    return rows


# Extrema, variances, products and log-sum-exp of a sharded reduced dim are not sums of
# per-rank results, and they are nonlinear, so only kept dims may be sharded.
@register(
    aten.amax.default,
    aten.amin.default,
    aten.max.dim,
    aten.min.dim,
    aten.argmax.default,
    aten.argmin.default,
    aten.var.dim,
    aten.var.correction,
    aten.std.dim,
    aten.std.correction,
    aten.var_mean.correction,
    aten.std_mean.correction,
    aten.prod.dim_int,
    aten.logsumexp.default,
    aten.any.dim,
    aten.all.dim,
)
def kept_dim_rule(info: OpInfo) -> list[Row]:
    if info.target in (aten.argmax.default, aten.argmin.default) and info.kw.get("dim") is None:
        return [replicate_row(info)]  # the index into the flattened tensor depends on every dim
    reduced, keepdim = _dim_and_keepdim(info)
    return kept_rows(info, reduced, keepdim)


@register(aten.max.default, aten.min.default, aten.prod.default, aten.var.default, aten.std.default)
def full_reduction_rule(info: OpInfo) -> list[Row]:
    return [replicate_row(info)]


# A running sum along dim: other dims shard freely, and it is linear, so P → P.
@register(aten.cumsum.default)
def cumsum_rule(info: OpInfo) -> list[Row]:
    scanned = info.kw["dim"] % max(info.inputs[0].ndim, 1)
    rows = [replicate_row(info)]
    rows += [Row((S(d),), S(d)) for d in range(info.inputs[0].ndim) if d != scanned]
    rows.append(Row((P,), P))
    return rows


__all__ = ["reduced_dims", "kept_rows"]
