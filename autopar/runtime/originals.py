"""The parameters of a model passed to ``autopar.compile`` stay the model's own: the compiled
module holds its own shards and never writes gradients into them. An optimizer built from
``model.parameters()`` instead of ``pm.parameters()`` would step tensors that get no gradient,
and train nothing, silently. A torch optimizer step pre-hook (registered at the first
``compile``) refuses the step of an optimizer whose parameters include such originals when none
of those has a gradient (the same model trained eagerly beside ``pm`` has them, and steps), and
the step takes no closure (which makes the gradients inside it). Each optimizer is checked when
its parameter count changes, not at every step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_ORIGINALS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []


def watch(model: torch.nn.Module) -> None:
    """Remember ``model``'s parameters (weakly): the ones a compiled module does not train."""
    for param in model.parameters():
        _ORIGINALS[id(param)] = param
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check))


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    # LBFGS and the like make their gradients inside the step (args[0] is the optimizer)
    if args[1:] or kwargs.get("closure") is not None:
        return
    num_params = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED.get(optimizer) == num_params:
        return
    originals = [p for group in optimizer.param_groups for p in group["params"] if _ORIGINALS.get(id(p)) is p]
    if originals and all(p.grad is None for p in originals):
        raise RuntimeError(
            f"{type(optimizer).__name__} steps {len(originals)} parameters of the model passed to autopar.compile, "
            "which the compiled module does not use: they get no gradients, and nothing would train. Build the "
            "optimizer from the compiled module's parameters: "
            f"opt = torch.optim.{type(optimizer).__name__}(pm.parameters(), ...)"
        )
    _CHECKED[optimizer] = num_params
