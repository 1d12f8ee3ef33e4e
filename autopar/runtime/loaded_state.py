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

A DTensor state is another script's checkpoint: ``opt.state_dict()`` saved by rank 0 alone, as DDP
scripts save, then loaded on every rank. Each unpickled DTensor keeps rank 0's shard and mesh
coordinate, and the other ranks would step rank 0's slice of the moments (0.15 off eager after
one AdamW step, without a word). The same cut refuses it, and where the optimizer steps a tracked
parameter it runs under one agreement over the ranks (at the first step, once per optimizer, and
at each later load), so that every rank raises the refusal.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import CheckpointError
from autopar.runtime.checkpoint import agreed, check_own_shard

_WHOLE_STATE = (
    "save the whole state: torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(pm, optimizer, "
    "options=StateDictOptions(full_state_dict=True)) on every rank, torch.save on rank 0, and "
    "set_optimizer_state_dict(pm, optimizer, that, options=StateDictOptions(full_state_dict=True)) on every rank "
    "to load it; or each rank saves and loads its own opt.state_dict()"
)

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
    _cut_on_every_rank(optimizer)  # a state loaded before the first step
    optimizer.register_load_state_dict_post_hook(_cut_on_every_rank)  # one loaded after it


def _cut_on_every_rank(optimizer: torch.optim.Optimizer) -> None:
    """``cut_whole_state``, told to every rank where the optimizer steps a tracked parameter (as
    every rank's does: they hold one plan), so that a refusal on one rank (another rank's shard)
    is raised on all, instead of the others waiting for it in the next collective."""
    if any(_tracked(param) is not None for group in optimizer.param_groups for param in group["params"]):
        agreed("the optimizer's loaded state", lambda: cut_whole_state(optimizer))


def _tracked(param: torch.Tensor) -> tuple[weakref.ref, weakref.ref, str] | None:
    entry = _TRACKED.get(id(param))
    return entry if entry is not None and entry[0]() is param and entry[1]() is not None else None


@torch.no_grad()
def cut_whole_state(optimizer: torch.optim.Optimizer) -> int:
    """Replace each whole plain state tensor of a tracked parameter by this rank's shard; how many."""
    cut = 0
    for param, state in optimizer.state.items():
        if (entry := _tracked(param)) is not None and (pm := entry[1]()) is not None:
            cut += cut_state(pm, entry[2], param, state)
    return cut


def cut_state(pm: Any, fqn: str, param: torch.Tensor, state: dict) -> int:
    """Replace, in ``state`` (one parameter's optimizer state), each whole plain tensor by this
    rank's shard where ``param`` is a DTensor (a plain parameter keeps it whole); refuse one shaped
    neither like the parameter nor as a shard, and a DTensor shard another rank saved. Returns how
    many were cut."""
    cut = 0
    for key, value in list(state.items()):
        if isinstance(value, DTensor):  # one rank's torch.save of opt.state_dict(), loaded on every rank
            check_own_shard(f"optimizer state {key!r} of parameter {fqn}", value, pm.device_mesh, _WHOLE_STATE)
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
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
