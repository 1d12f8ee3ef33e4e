"""Kernels for losses whose mean is over a sharded tensor."""

from __future__ import annotations

import math
from typing import Any

import torch

from autopar.ops.collectives import group_size
from autopar.ops.kernels import register_kernel
from autopar.rules.registry import call_with_kw

_LOSSES = {
    "mse_loss": torch.ops.aten.mse_loss.default,
    "l1_loss": torch.ops.aten.l1_loss.default,
    "smooth_l1_loss": torch.ops.aten.smooth_l1_loss.default,
    "huber_loss": torch.ops.aten.huber_loss.default,
}


def _mean_kernel(op: Any):
    def kernel(*, axis_groups: tuple[str, ...], **kw: Any) -> torch.Tensor:
        """The local sum of the loss over the global element count: a partial sum of the mean."""
        total = kw["self"].numel() * math.prod(group_size(g) for g in axis_groups)
        return call_with_kw(op, {**kw, "reduction": 2}) / total

    return kernel


for _name, _op in _LOSSES.items():
    register_kernel(f"{_name}_mean")(_mean_kernel(_op))
