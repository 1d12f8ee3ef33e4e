"""An optimizer over a compiled module's parameters that loads a whole state steps its shards.

A checkpoint written as one process writes it (Hugging Face Trainer's ``optimizer.pt``, the
whole tensors that ``autopar.checkpoint.trainer_callback()`` gathers, a plain model's optimizer
state) holds each state tensor whole. ``optimizer.load_state_dict`` puts those whole plain
tensors beside parameters that are DTensor shards, and the next ``step()`` would mix the two
(torch refuses it, or a foreach kernel reads the wrong rows). Trainer's resume loads the optimizer
that way on every rank, so ``track`` registers a module's DTensor parameters, and a global
optimizer step pre-hook cuts each whole plain state tensor of one of them to this rank's shard
(``pm.shard_like``: a DTensor with the parameter's placements) at the first step of each
optimizer (Trainer builds it, loads the checkpoint, then steps), and registers on that optimizer a
``load_state_dict`` post-hook that cuts a state loaded later at once. Every later step costs one
lookup. Parameters and optimizers are held weakly, as their modules are.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import CheckpointError

# id(parameter) -> (a weak reference to it, to its compiled module; its FQN in that module)
_TRACKED: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}
_SEEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # optimizers that stepped since tracking
_HOOK: list[Any] = []


def track(pm: Any, params: dict[str, torch.Tensor]) -> None:
    """Cut whole state loaded for any of ``params`` (FQN -> ``pm``'s parameter) to its shard."""
    owner = weakref.ref(pm)
    for fqn, param in params.items():
        if isinstance(param, DTensor):
            key = id(param)
            _TRACKED[key] = (weakref.ref(param, lambda _, key=key: _TRACKED.pop(key, None)), owner, fqn)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_cut_loaded_state))


def _cut_loaded_state(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if not _TRACKED or optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    cut_whole_state(optimizer)  # a state loaded before the first step
    optimizer.register_load_state_dict_post_hook(cut_whole_state)  # one loaded after it


@torch.no_grad()
def cut_whole_state(optimizer: torch.optim.Optimizer) -> int:
    """Replace each whole plain state tensor of a tracked parameter by this rank's shard; how many."""
    cut = 0
    for param, state in optimizer.state.items():
        entry = _TRACKED.get(id(param))
        pm = entry[1]() if entry is not None and entry[0]() is param else None
        if pm is not None:
            cut += cut_state(pm, entry[2], param, state)
    return cut


def cut_state(pm: Any, fqn: str, param: torch.Tensor, state: dict) -> int:
    """Replace, in ``state`` (one parameter's optimizer state), each whole plain tensor by this
    rank's shard where ``param`` is a DTensor (a plain parameter keeps it whole); refuse one shaped
    neither like the parameter nor as a shard. Returns how many were cut."""
    cut = 0
    for key, value in list(state.items()):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.dim() > 0:
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"optimizer state {key!r} of parameter {fqn} was loaded as a plain tensor of shape "
                    f"{tuple(value.shape)}, neither the parameter's whole shape {tuple(param.shape)} nor a DTensor "
                    "shard, so it cannot be cut to this rank's shard (only state shaped like its parameter can, as "
                    "AdamW's and SGD's): was it saved from another model? Save and load the optimizer with "
                    "autopar.checkpoint.save/load(path, pm, optimizer)"
                )
            if isinstance(param, DTensor):
                state[key] = pm.shard_like(fqn, value)
                cut += 1
    return cut
