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
at its first ``step()``: one that keeps more state per parameter than the declared kind (Adam's
``amsgrad`` keeps a third moment), or runs foreach Adam(W) (half its state again while it steps,
``cost.optimizer.step_temporary``) where the plan priced none, raises ``ConfigError`` naming the
declaration that fits it. A plan priced for torch's default AdamW (nothing declared) is held to
its memory budget instead: the state an optimizer keeps beyond the priced, summed over the
module's optimizers, may fill the room between the predicted peak and the budget, and no more
(``AdamW(amsgrad=True)`` under a budget that binds: half the state again, over the budget, without
a word before). An optimizer class autopar does not price (Adagrad, RMSprop, a third party's) is
measured instead: the bytes of the tensors it keeps per parameter after its first step.

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

import math
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from autopar.cost.memory import OPTIMIZER_STATES
from autopar.cost.optimizer import FOREACH_TEMPORARY
from autopar.errors import ConfigError, OffloadError
from autopar.ir.options import DEFAULT_OPTIMIZER, parse_optimizer
from autopar.ops.params import LocalLeaf, hold_leaves, holds_leaves, leaf_of
from autopar.runtime.originals import rebind_optimizer

# id(parameter) -> (a weak reference to it, its canonical FQN, what the plan offloads of it)
_GUARDED: dict[int, tuple[weakref.ref, str, str]] = {}
_HOOK: list[Any] = []  # the global step pre-hook's handle, once registered
# id(parameter) -> (a weak reference to it, what its module's plan priced of the optimizer)
_DECLARED: dict[int, tuple[weakref.ref, Promise]] = {}
_CHECKED: weakref.WeakSet = weakref.WeakSet()  # optimizers already held to their plan
_MEASURE: weakref.WeakSet = weakref.WeakSet()  # optimizers of unpriced classes, measured after a step
_UNHELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its parameters, none a plan's


@dataclass
class Promise:
    """What one compiled module's plan priced of the optimizers over its parameters: the
    optimizer declared (``PlanOptions.optimizer``) and the implementation priced for it on the
    plan's cluster; where nothing was declared (torch's default), the bytes a rank may hold beyond
    the predicted peak under the budget (None: no budget, or a plan over it), and the budget."""

    declared: str
    implementation: str
    room: float | None = None
    budget: float | None = None
    # optimizer -> the state bytes it keeps beyond the priced, over the parameters it steps (at
    # least 0: one that keeps less frees nothing another one over the same parameters keeps)
    kept: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)

    @property
    def strict(self) -> bool:
        """A declared optimizer is held to its kind; the default only to the budget."""
        return self.declared != DEFAULT_OPTIMIZER

    @property
    def states(self) -> int:
        """Tensors the size of a parameter the plan priced the optimizer's state at."""
        return OPTIMIZER_STATES[parse_optimizer(self.declared)[0]]


def refuse_torch_optimizers(params: dict[str, torch.Tensor], offloaded: dict[str, str]) -> None:
    """Make a torch optimizer's ``step()`` over any of ``params`` (canonical FQN -> parameter)
    named in ``offloaded`` (FQN -> what the plan offloads of it, for the message) raise."""
    for fqn, param in params.items():
        if fqn not in offloaded:
            continue
        key = id(param)
        _GUARDED[key] = (weakref.ref(param, lambda _, key=key: _GUARDED.pop(key, None)), fqn, offloaded[fqn])
    _ensure_hook()


def hold_to_optimizer(
    params: dict[str, torch.Tensor], declared: str, implementation: str, budget: float | None, peak: float | None
) -> None:
    """Check each torch optimizer over any of ``params`` at its first ``step()`` against
    ``declared``, the optimizer the plan was priced for as ``implementation``, or, where that is
    torch's default, against the room ``peak`` (the plan's predicted peak bytes) leaves under
    ``budget`` (None: no budget; module docstring)."""
    room = None
    if declared == DEFAULT_OPTIMIZER:
        if budget is None or peak is None or peak > budget:  # nothing promised: no budget, or a plan made over it
            return
        room = budget - peak
    promise = Promise(declared, implementation, room, budget)
    for param in params.values():
        key = id(param)
        _DECLARED[key] = (weakref.ref(param, lambda _, key=key: _DECLARED.pop(key, None)), promise)
    _ensure_hook()


def watch_shard_data(leaves: Iterable[LocalLeaf]) -> None:
    """Refuse a step over the parameter of any of ``leaves`` whose ``.data`` was replaced since
    (``LocalLeaf.check``; see the module docstring)."""
    hold_leaves(leaves)
    _ensure_hook()


def _ensure_hook() -> None:
    if not _HOOK and (_GUARDED or _DECLARED or holds_leaves()):
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))
        _HOOK.append(register_optimizer_step_post_hook(_measure))


def _refuse(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if getattr(optimizer, "steps_offloaded_state", False):  # autopar.optim.AdamW: steps as the plan priced
        if holds_leaves():
            _check_shard_data(optimizer)
        return
    if _DECLARED and optimizer not in _CHECKED and _UNHELD.get(optimizer) != _count(optimizer):
        rebind_optimizer(optimizer, args, kwargs)  # one over the model's own parameters steps the module's
        _hold(optimizer)
    if holds_leaves():
        _check_shard_data(optimizer)
        _refuse_zero(optimizer)
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
                    "Step the module with autopar.optim.AdamW, which takes the same arguments as torch.optim.AdamW "
                    "(parameters or param groups, lr=...) and steps each parameter where its state lives; or plan "
                    'without offloading parameters, gradients and optimizer state (offload="off", checkpointing=True), '
                    "or with a larger memory_budget."
                )


def _refuse_zero(optimizer: torch.optim.Optimizer) -> None:
    """torch's ``ZeroRedundancyOptimizer`` steps its part of the parameters on each rank, then
    broadcasts each rank's part whole: over DTensor parameters it stepped its part and then failed
    at the broadcast (torch's ``NotImplementedError`` for ``c10d.broadcast_``), the ranks' weights
    by then different. Refused before it steps, with the fix. (Looked up where a script imported
    it: importing ``torch.distributed.optim`` loads some 600 modules, not for every step hook.)"""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None or not isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return
    if any(isinstance(param, DTensor) for group in optimizer.param_groups for param in group["params"]):
        raise ConfigError(
            "torch's ZeroRedundancyOptimizer over a compiled module whose plan shards its parameters: it broadcasts "
            "whole parameters between ranks, which no rank holds, and the plan already shards the optimizer "
            "state with them. Step a plain optimizer (torch.optim.AdamW(pm.parameters(), ...)), or compile with a "
            'plan that replicates every parameter (autopar.hand_plan("ddp", ...)), over which ZeroRedundancyOptimizer runs'
        )


def _check_shard_data(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for param in group["params"]:
            leaf = leaf_of(param)
            if leaf is not None:
                leaf.check()


def _held(optimizer: torch.optim.Optimizer):
    """(group, parameter, its promise) for each parameter of ``optimizer`` a plan priced."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = _DECLARED.get(id(param))
            if entry is not None and entry[0]() is param:
                yield group, param, entry[1]


def _hold(optimizer: torch.optim.Optimizer) -> None:
    """Raise where ``optimizer`` holds more than the optimizer its parameters' plan was priced for,
    or more than its budget has room for; an unpriced class is measured after its step."""
    excess: dict[int, tuple[Promise, float]] = {}
    held, kind = False, None
    for group, param, promise in _held(optimizer):
        held = True
        kind, implementation = running(optimizer, group, param)
        if kind is None:
            _MEASURE.add(optimizer)
            break
        declared = promise.states
        # foreach Adam(W) holds a temporary where the plan priced none
        temporary = FOREACH_TEMPORARY.get(kind, 0.0) if implementation == "foreach" != promise.implementation else 0.0
        if promise.strict and (OPTIMIZER_STATES[kind] > declared or temporary):
            what = (
                "more state per parameter"
                if OPTIMIZER_STATES[kind] > declared
                else "half its state again while it steps (foreach)"
            )
            raise ConfigError(
                f"{_name(optimizer)} runs as {kind}:{implementation}, which holds {what} than the optimizer the plan "
                f"was priced for, optimizer={promise.declared!r}: the plan's memory budget would not hold. Plan and "
                f"compile with optimizer={f'{kind}:{implementation}'!r}, or step as declared "
                "(torch.optim.AdamW(..., fused=True) for 'adamw:fused')"
            )
        _add(excess, promise, (OPTIMIZER_STATES[kind] * (1 + temporary) - declared) * _local_bytes(param))
    _charge(optimizer, excess.values(), kind and f"{kind}:{implementation}")
    if held:
        _CHECKED.add(optimizer)
    else:  # over no module's parameters: looked at again once it has more (``add_param_group``)
        _UNHELD[optimizer] = _count(optimizer)


def _count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _measure(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """After the first step of an optimizer class autopar does not price: charge the bytes it keeps
    per parameter beyond the declared kind's state to its module's promise."""
    if optimizer not in _MEASURE:
        return
    excess: dict[int, tuple[Promise, float]] = {}
    kept_all = stepped = 0
    for _, param, promise in _held(optimizer):
        kept = sum(_local_bytes(v) for v in optimizer.state.get(param, {}).values() if isinstance(v, torch.Tensor) and v.dim())
        _add(excess, promise, kept - promise.states * _local_bytes(param))
        kept_all, stepped = kept_all + kept, stepped + _local_bytes(param)
    states = math.ceil(kept_all / max(stepped, 1) - 1e-9)  # tensors the size of a parameter it keeps for each
    _charge(optimizer, excess.values(), _KIND_BY_STATES.get(states), measured=True)
    _MEASURE.discard(optimizer)  # measured once it fits (a step after a refusal is measured again)


# The priced kind that keeps as many tensors a parameter as a measured optimizer (its step is
# priced with AdamW's passes over those bytes, ``cost.optimizer``).
_KIND_BY_STATES = {OPTIMIZER_STATES[k]: k for k in ("sgd", "sgd-momentum", "adamw", "adamw-amsgrad")}


def _add(excess: dict[int, tuple[Promise, float]], promise: Promise, extra: float) -> None:
    excess[id(promise)] = (promise, excess.get(id(promise), (promise, 0.0))[1] + extra)


def _charge(
    optimizer: torch.optim.Optimizer, excess: Iterable[tuple[Promise, float]], kind: str | None, measured: bool = False
) -> None:
    """Record each promise's ``excess`` bytes for ``optimizer`` (which runs as ``kind``, the nearest
    priced one where measured), or raise where they exceed a declared kind's state or, with the
    other live optimizers', the room under the budget (then nothing is recorded: a step again is
    checked again)."""
    after = ", measured after its first step" if measured else ""
    declare = (
        f"Plan and compile with optimizer={kind!r}{' (as many tensors a parameter)' if measured else ''}"
        if kind
        else "Plan and compile"
    )
    for promise, extra in excess:
        if promise.strict and extra > 0:
            raise ConfigError(
                f"{_name(optimizer)} keeps {extra / 2**20:.4g} MiB more state on this rank{after} than the optimizer "
                f"the plan was priced for, optimizer={promise.declared!r}: the plan's memory budget would not hold. "
                f"{declare}, or step as declared"
            )
        total = sum(b for o, b in promise.kept.items() if o is not optimizer) + max(extra, 0.0)
        if promise.room is not None and total > promise.room:
            others = f" (the module's optimizers {total / 2**20:.4g} MiB in all)" if total > max(extra, 0.0) else ""
            raise ConfigError(
                f"{_name(optimizer)} holds {max(extra, 0.0) / 2**20:.4g} MiB more optimizer state on this rank{after} "
                f"than the plan priced for torch's AdamW (two moments a parameter){others}, where the plan's "
                f"predicted peak leaves {promise.room / 2**20:.4g} MiB under its memory budget of "
                f"{promise.budget / 2**30:.4g} GiB: the budget would not hold. {declare} so that the plan makes room "
                "for its state, or with a larger memory_budget"
            )
    for promise, extra in excess:
        promise.kept[optimizer] = max(extra, 0.0)


def _name(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _local_bytes(tensor: torch.Tensor) -> int:
    """Bytes of this rank's part of ``tensor`` (a parameter's state is priced in its dtype, as torch keeps it)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def running(optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor) -> tuple[str | None, str | None]:
    """(kind, implementation) ``optimizer`` steps ``param`` (of ``group``) as, in the names of
    ``PlanOptions.optimizer``; None for what autopar does not price (another optimizer class)."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        kind = ("adamw" if isinstance(optimizer, torch.optim.AdamW) else "adam") + ("-amsgrad" if group.get("amsgrad") else "")
    elif isinstance(optimizer, torch.optim.SGD):
        kind = "sgd-momentum" if group.get("momentum") else "sgd"
    else:
        return None, None
    if group.get("fused"):
        return kind, "fused"
    if group.get("foreach") or (group.get("foreach") is None and param.device.type == "cuda"):
        return kind, "foreach"  # None: torch's default, the list kernels on CUDA tensors
    return kind, "for-loop"
