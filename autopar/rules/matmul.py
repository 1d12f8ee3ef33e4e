"""Sharding rules for the matmul family: mm, bmm, addmm, linear, matmul, baddbmm.

Each row is Megatron's algebra on one mesh axis: shard the rows of the left operand (output
rows sharded), shard the columns of the right operand (output columns sharded), or shard the
contracted dim of both (every rank holds a partial sum of the output).
"""

from __future__ import annotations

import torch

from autopar.rules.registry import OpInfo, Row, register
from autopar.spec import P, R, S

aten = torch.ops.aten


@register(aten.mm.default)
def mm_rule(info: OpInfo) -> list[Row]:
    # a[M, K] @ b[K, N]
    return [
        Row((R, R), R),
        Row((S(0), R), S(0)),
        Row((R, S(1)), S(1)),
        Row((S(1), S(0)), P),
        Row((P, R), P),
        Row((R, P), P),
    ]
