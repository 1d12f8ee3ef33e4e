"""Refuse a torch optimizer that breaks what the plan priced: over parameters whose plan offloads
their state, value or gradient, or holding more than the optimizer the plan was priced for.

A module that offloads a parameter holds an empty stub for it, or sends its gradient to the
store as backward makes it (``runtime.offload``): ``torch.optim.AdamW(pm.parameters())`` would
see no gradient and skip it, and where only the optimizer state is offloaded it would create
that state on the device, over the memory budget, without a word (on an H200: 25.0 GiB against
a 19.3 GiB budget). ``autopar.optim.AdamW(pm)`` steps such parameters where their state lives.

``refuse_torch_optimizers`` registers the parameters, and once per process a global
``torch.optim.Optimizer`` step pre-hook that raises ``OffloadError`` at the first ``step()`` of
any torch optimizer holding one of them. Parameters are held weakly: a module that goes frees
its entries, and a process with none left pays one dictionary check per step.

A plan priced for a declared optimizer (``PlanOptions.optimizer``, such as "adamw:fused", which
holds no temporary while it steps) promises its memory budget for that one. ``hold_to_optimizer``
registers the module's parameters, and the same hook checks each torch optimizer over them once,
at its first ``step()``: one that keeps more state per parameter than the declared kind, or runs
foreach Adam(W) (half its state again while it steps, ``cost.optimizer.step_temporary``) where the
plan priced none, raises ``ConfigError`` naming the declaration that fits it.

A DTensor parameter ignores ``p.data = value``: torch replaces the wrapper's storage, never its
local shard (FSDP2's parameters alike), so the graph and the optimizer go on with the old values.
A SAM-style restore (``p.data = old_p`` before the base step) gave weights 0.075 off eager on 2
ranks, without a word. Each DTensor parameter's ``ops.params.LocalLeaf`` records its wrapper's
storage and refuses it at every call once that changed; ``watch_shard_data`` registers the leaves
(``ops.params.hold_leaves``), so that the same hook runs that check at the step of an optimizer
over one, naming the in-place fix, before the step uses the old values. It costs a storage read
per such parameter per step.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.cost.memory import OPTIMIZER_STATES
from autopar.errors import ConfigError, OffloadError
from autopar.ir.options import DEFAULT_OPTIMIZER, parse_optimizer
from autopar.ops.params import LocalLeaf, hold_leaves, holds_leaves, leaf_of

# id(parameter) -> (a weak reference to it, its canonical FQN, what the plan offloads of it)
_GUARDED: dict[int, tuple[weakref.ref, str, str]] = {}
_HOOK: list[Any] = []  # the global step pre-hook's handle, once registered
# id(parameter) -> (a weak reference to it, the optimizer its plan was priced for)
_DECLARED: dict[int, tuple[weakref.ref, str]] = {}
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers already held to their plan


def refuse_torch_optimizers(params: dict[str, torch.Tensor], offloaded: dict[str, str]) -> None:
    """Make a torch optimizer's ``step()`` over any of ``params`` (canonical FQN -> parameter)
    named in ``offloaded`` (FQN -> what the plan offloads of it, for the message) raise."""
    for fqn, param in params.items():
        if fqn not in offloaded:
            continue
        key = id(param)
        _GUARDED[key] = (weakref.ref(param, lambda _, key=key: _GUARDED.pop(key, None)), fqn, offloaded[fqn])
    _ensure_hook()


def hold_to_optimizer(params: dict[str, torch.Tensor], declared: str) -> None:
    """Check each torch optimizer over any of ``params`` at its first ``step()`` against
    ``declared``, the optimizer the plan was priced for (module docstring). The default
    ("adamw", torch's own on the devices) is what torch runs unless told otherwise: nothing to hold."""
    if declared == DEFAULT_OPTIMIZER:
        return
    for param in params.values():
        key = id(param)
        _DECLARED[key] = (weakref.ref(param, lambda _, key=key: _DECLARED.pop(key, None)), declared)
    _ensure_hook()


def watch_shard_data(leaves: Iterable[LocalLeaf]) -> None:
    """Refuse a step over the parameter of any of ``leaves`` whose ``.data`` was replaced since
    (``LocalLeaf.check``; see the module docstring)."""
    hold_leaves(leaves)
    _ensure_hook()


def _ensure_hook() -> None:
    if not _HOOK and (_GUARDED or _DECLARED or holds_leaves()):
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))


def _refuse(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if _DECLARED and optimizer not in _CHECKED:
        _hold(optimizer)
    if holds_leaves():
        _check_shard_data(optimizer)
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


def _check_shard_data(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            leaf = leaf_of(param)
            if leaf is not None:
                leaf.check()


def _hold(optimizer: torch.optim.Optimizer) -> None:
    """Raise where ``optimizer`` holds more than the optimizer its parameters' plan was priced for."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _DECLARED.get(id(param))
            if entry is None or entry[0]() is not param:
                continue
            kind, implementation = running(optimizer, group, param)
            declared_kind, declared_implementation = parse_optimizer(entry[1])
            more_state = kind is not None and OPTIMIZER_STATES[kind] > OPTIMIZER_STATES[declared_kind]
            temporary = kind in ("adam", "adamw") and implementation == "foreach" and declared_implementation != "foreach"
            if more_state or temporary:
                name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
                what = "more state per parameter" if more_state else "half its state again while it steps (foreach)"
                raise ConfigError(
                    f"{name} runs as {kind}:{implementation}, which holds {what} than the optimizer the plan was "
                    f"priced for, optimizer={entry[1]!r}: the plan's memory budget would not hold. Plan and compile "
                    f"with optimizer={f'{kind}:{implementation}'!r}, or step as declared "
                    "(torch.optim.AdamW(..., fused=True) for 'adamw:fused')"
                )
    _CHECKED.add(optimizer)


def running(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> tuple[str | None, str | None]:
    """(kind, implementation) ``optimizer`` steps ``param`` (of ``group``) as, in the names of
    ``PlanOptions.optimizer``; None for what autopar does not price (another optimizer class)."""
    if isinstance(optimizer, torch.optim.AdamW):
        kind = "adamw"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "adam"
    elif isinstance(optimizer, torch.optim.SGD):
        kind = "sgd-momentum" if group.get("momentum") else "sgd"
    else:
        return None, None
    if group.get("fused"):
        return kind, "fused"
    if group.get("foreach") or (group.get("foreach") is None and param.device.type == "cuda"):
        return kind, "foreach"  # None: torch's default, the list kernels on CUDA tensors
    return kind, "for-loop"
