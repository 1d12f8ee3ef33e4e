"""Sharding rules for elementwise losses (mse_loss, l1_loss, smooth_l1_loss, huber_loss).

Input and target have the same shape (export broadcasts them first), so any dim may be sharded
on both. With reduction "none" the loss keeps that sharding; "sum" leaves each rank a partial
sum; "mean" divides the local sum by the *global* element count (kernels ``<loss>_mean``)
so that the partial values still add up to the mean.
"""

from __future__ import annotations

import torch

from autopar.ir.spec import P, R, S
from autopar.rules.registry import OpInfo, Row, register

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2


@register(aten.mse_loss.default, aten.l1_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default)
def elementwise_loss_rule(info: OpInfo) -> list[Row]:
    if len(info.inputs) != 2 or info.inputs[0].shape != info.inputs[1].shape:
        return [Row((R, R), R)]
    reduction = info.kw["reduction"]
    rows = [Row((R, R), R)]
    for dim in range(info.inputs[0].ndim):
        if reduction == _NONE:
            rows.append(Row((S(dim), S(dim)), S(dim)))
        elif reduction == _SUM:
            rows.append(Row((S(dim), S(dim)), P))
        else:
            rows.append(Row((S(dim), S(dim)), P, kernel=f"{info.target._schema.name.split('::')[1]}_mean"))
    return rows
