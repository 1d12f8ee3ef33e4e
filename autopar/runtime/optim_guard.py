"""Refuse a torch optimizer over parameters whose plan offloads their state, value or gradient.

A module that offloads a parameter holds an empty stub for it, or sends its gradient to the
store as backward makes it (``runtime.offload``): ``torch.optim.AdamW(pm.parameters())`` would
see no gradient and skip it, and where only the optimizer state is offloaded it would create
that state on the device, over the memory budget, without a word (on an H200: 25.0 GiB against
a 19.3 GiB budget). ``autopar.optim.AdamW(pm)`` steps such parameters where their state lives.

``refuse_torch_optimizers`` registers the parameters, and once per process a global
``torch.optim.Optimizer`` step pre-hook that raises ``OffloadError`` at the first ``step()`` of
any torch optimizer holding one of them. Parameters are held weakly: a module that goes frees
its entries, and a process with none left pays one dictionary check per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import OffloadError

# id(parameter) -> (a weak reference to it, its canonical FQN, what the plan offloads of it)
_GUARDED: dict[int, tuple[weakref.ref, str, str]] = {}
_HOOK: list[Any] = []  # the global step pre-hook's handle, once registered


def refuse_torch_optimizers(params: dict[str, torch.Tensor], offloaded: dict[str, str]) -> None:
    """Make a torch optimizer's ``step()`` over any of ``params`` (canonical FQN -> parameter)
    named in ``offloaded`` (FQN -> what the plan offloads of it, for the message) raise."""
    for fqn, param in params.items():
        if fqn not in offloaded:
            continue
        key = id(param)
        _GUARDED[key] = (weakref.ref(param, lambda _, key=key: _GUARDED.pop(key, None)), fqn, offloaded[fqn])
    if not _HOOK and _GUARDED:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))


def _refuse(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if not _GUARDED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _GUARDED.get(id(param))
            if entry is not None and entry[0]() is param:
                raise OffloadError(
                    f"{type(optimizer).__module__}.{type(optimizer).__qualname__} steps parameter '{entry[1]}', whose "
                    f"{entry[2]} the plan offloads (plan.memory): a torch optimizer would keep its state on the "
                    "device, over the memory budget, or skip a parameter whose gradient lives in the offload store. "
                    "Step the module with autopar.optim.AdamW(pm, lr=...), which steps each parameter where its "
                    "state lives; or plan without offloading parameters, gradients and optimizer state "
                    '(offload="off", checkpointing=True), or with a larger memory_budget.'
                )
