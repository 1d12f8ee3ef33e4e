"""torch's tools over a pipelined module's parameters, which a rank holds one stage of: the whole
model's answer, or refused.

A rank of a pipeline holds its stage's parameters alone, so ``torch.nn.utils.clip_grad_norm_(
pm.parameters(), max_norm)`` took the norm of that stage's gradients and clipped each stage by its
own: on 2 stages of the zoo GPT the norms were 1.37 and 1.15 where eager's is 1.68, and the
weights 0.0027 off eager after three steps, without a word; ``torch.optim.LBFGS``, whose steps
come from dot products over every gradient, trained 0.77 off eager (a plan without stages holds
DTensor parameters, on which torch computes over the whole model).

``watch`` (from each pipelined module) registers the module, which its parameters lead to through
``optim.owner_of``; once a process it wraps torch's ``clip_grad_norm_`` under the names scripts
call it by (``torch.nn.utils.clip_grad_norm_``, ``torch.nn.utils.clip_grad.clip_grad_norm_``, which
Hugging Face's ``accelerate`` and nanoGPT call) and registers an optimizer step pre-hook. A clip over a
pipelined module's parameters runs the module's own ``clip_grad_norm_`` (the whole model's norm,
the same on every rank) where they hold every gradient the module has, and is refused naming it
where they hold a part; any other call is torch's own, after an owner lookup per parameter.
Code that bound torch's function to another name before the first ``compile`` (``from
torch.nn.utils import clip_grad_norm_``) calls torch's own. The first step of an ``LBFGS`` over a
pipelined module's parameters is refused, naming a plan without stages.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.utils.clip_grad as clip_grad
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import UsageError
from autopar.runtime.optim import owner_of

_PIPELINED: weakref.WeakSet = weakref.WeakSet()  # the pipelined modules of this process
_TORCH: dict[str, Any] = {}  # torch's own clip_grad_norm_, once wrapped


def watch(module: torch.nn.Module) -> None:
    """Route ``clip_grad_norm_`` over ``module``'s parameters to ``module.clip_grad_norm_``, and
    refuse an ``LBFGS`` over them."""
    _PIPELINED.add(module)
    if not _TORCH:
        _TORCH["clip"] = clip_grad.clip_grad_norm_
        wrapped = functools.wraps(_TORCH["clip"])(_clip_grad_norm_)
        clip_grad.clip_grad_norm_ = torch.nn.utils.clip_grad_norm_ = wrapped
        _TORCH["hook"] = register_optimizer_step_pre_hook(_refuse_lbfgs)


def _refuse_lbfgs(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if isinstance(optimizer, torch.optim.LBFGS) and _owner(optimizer.param_groups[0]["params"]) is not None:
        raise UsageError(
            "torch.optim.LBFGS over a pipelined module's parameters: a rank holds its stage's parameters alone, "
            "so LBFGS's dot products and line search would each see a part of the model. Compile without "
            "pipeline= (LBFGS over a plan's DTensor parameters sees the whole model), or step with an "
            "elementwise optimizer (AdamW, SGD)"
        )


def _owner(params: list[torch.Tensor]) -> torch.nn.Module | None:
    """The live pipelined module that holds any of ``params`` (``optim.owner_of``), or None."""
    return next((module for module in map(owner_of, params) if module in _PIPELINED), None)


def _clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None) -> torch.Tensor:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    module = _owner(params)
    if module is None:
        return _TORCH["clip"](params, max_norm, norm_type, error_if_nonfinite, foreach)
    given = set(map(id, params))
    missing = [name for name, param in module.named_parameters() if param.grad is not None and id(param) not in given]
    others = len(given - {id(param) for param in module.parameters()})
    refused = torch.tensor(float(bool(missing or others)), device=params[0].device)
    dist.all_reduce(refused, op=dist.ReduceOp.MAX)  # every rank refuses alike, or none does
    if refused.item():
        parts = [f"leave out {len(missing)} of its parameters with a gradient ({missing[0]}, ...)"] if missing else []
        parts += [f"add {others} tensors of no stage of it"] if others else []
        held = " and ".join(parts) or "on another rank leave out some of its gradients"
        raise UsageError(
            f"clip_grad_norm_ over a pipelined module's parameters that {held}: a rank holds its stage's parameters "
            "alone, so torch's clip would take the norm of a part of the model on each. Call pm.clip_grad_norm_(max_norm) "
            "on every rank (the whole model's norm), or clip over all of pm.parameters()"
        )
    return module.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)


__all__ = ["watch"]
