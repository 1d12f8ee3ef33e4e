"""torch's ``GradScaler`` over a compiled module's gradients: one skip decision on every rank.

``GradScaler`` looks for non-finite gradients in the optimizer's ``.grad`` and skips
``optimizer.step()`` where it found one (``GradScaler._unscale_grads_``, which ``unscale_`` and
``step`` call). Each rank looks at what it holds. A rank of a plan that shards a parameter holds a
piece of its gradient, and a pipeline stage's ranks hold their stage's parameters alone, so an
overflow that eager's step skips was found by some ranks only: they skipped the step while their
peers took it, and the ranks' weights parted without a word (after four steps on 2 ranks, 0.04 off
eager under Megatron's layout, whose norms are replicated beside its split projections; 0.027 under
a 2-stage pipeline). DTensor's own handler of the check combines the ranks' findings only over
the mesh dims that split the *first* gradient of each list.

``watch`` registers a module that shards some parameters or pipelines (one that replicates every
parameter holds the whole, equal gradient on every rank, as DDP does) and wraps
``_unscale_grads_`` once a process, so that, for an optimizer over any of its parameters (found
by ``optim.owner_of``), the findings are combined (their max, one scalar all-reduce over the world)
before ``step`` reads them: every rank skips where eager skips, since an overflow in any rank's
piece is one in eager's gradient. Other optimizers pay an owner lookup per parameter.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist

from autopar.runtime.optim import owner_of

_WATCHED: weakref.WeakSet = weakref.WeakSet()  # modules whose ranks each hold a part of the gradients
_TORCH: dict[str, Any] = {}  # GradScaler's own _unscale_grads_, once wrapped


def watch(module: torch.nn.Module) -> None:
    """Combine every rank's finding for an optimizer over any of ``module``'s parameters (and wrap
    ``GradScaler`` once a process)."""
    _WATCHED.add(module)
    if not _TORCH:
        scaler = torch.amp.GradScaler
        _TORCH["unscale"] = scaler._unscale_grads_
        scaler._unscale_grads_ = functools.wraps(_TORCH["unscale"])(_unscale_grads_)


def _unscale_grads_(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> dict[torch.device, torch.Tensor]:
    found = _TORCH["unscale"](self, optimizer, *args, **kwargs)
    if any(owner_of(param) in _WATCHED for group in optimizer.param_groups for param in group["params"]):
        anywhere = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in found.values():
            torch.maximum(anywhere, flag.to(anywhere.device), out=anywhere)
        dist.all_reduce(anywhere, op=dist.ReduceOp.MAX)
        for flag in found.values():
            flag.copy_(anywhere)
    return found


__all__ = ["watch"]
