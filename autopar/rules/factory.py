"""Sharding rules for factory ops: tensors made from a size (and a value, a range or the RNG).

``arange``, ``scalar_tensor`` and the random factories are replicated only: each rank makes the
whole tensor. An ``arange`` chunk would need a per-rank start (its values depend on position),
and a random chunk is not a chunk of what another rank would draw (values depend on the RNG
stream), so without a kernel only R is exact. Random factories still need the ranks' RNGs in
step for R to hold the same values everywhere.

Constant fills (``zeros``, ``ones``, ``full``, ``empty``, and the ``new_*`` forms) hold the same
value at every position, so any chunk is the fill of the chunk's shape: they may be made
sharded directly, with the size argument rewritten to the local shape (``SIZE_ARGS``). The
``new_*`` forms only borrow dtype and device from ``self``, so ``self`` may be anywhere.
"""

from __future__ import annotations

import torch

from autopar.ir.spec import P, R, S
from autopar.rules.registry import OpInfo, Row, register

aten = torch.ops.aten


@register(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    aten.scalar_tensor.default,
    aten.rand.default,
    aten.randn.default,
    aten.randint.default,
    aten.randint.low,
    aten.randperm.default,
)
def replicated_factory_rule(info: OpInfo) -> list[Row]:
    return [Row((), R)]


@register(aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format)
def constant_factory_rule(info: OpInfo) -> list[Row]:
    return [Row((), R)] + [Row((), S(d)) for d in range(info.out_ndim)]


@register(aten.new_zeros.default, aten.new_ones.default, aten.new_full.default, aten.new_empty.default)
def new_constant_rule(info: OpInfo) -> list[Row]:
    self_placements = [R, P] + [S(d) for d in range(info.inputs[0].ndim)]
    outs = [R] + [S(d) for d in range(info.out_ndim)]
    return [Row((src,), out) for src in self_placements for out in outs]
