"""Module hooks added after ``compile`` are refused, not silently skipped; so are submodules,
parameters and buffers replaced in a way the graph would not follow.

The compiled module runs one traced graph: the modules under ``pm.module`` hold its parameters
but are never called, so a forward, forward-pre or backward hook registered on one of them after
``compile`` would never run. Hooks registered before ``compile`` met the trace
(``autopar.trace.hooks``): a forward hook's result is in the graph, backward hooks were refused.

``HookGuard.install`` gives every module under ``pm.module`` hook tables that refuse a new
entry, or the removal of one that was traced in, at the ``register_*_hook`` (or
``handle.remove()``) call, with the fix. Global hooks (``register_module_forward_hook`` and the
like) cannot be guarded that way without changing every other model of the process, so the
guard remembers the global tables at ``compile`` and ``check`` refuses a call after one of them
changed (and after a handle made before ``compile`` removed a hook that the graph still runs). Hooks on the compiled module itself (``pm.register_forward_hook``) run as
on any module: they see the call's whole inputs and outputs.

Submodules alike: the graph ran the modules the model had at ``compile``, so one replaced or
removed after it (``resize_token_embeddings``, PEFT's ``get_peft_model``, ``model.head =
nn.Linear(...)``, an activation swapped) would never run, where eager would run the new one.
Each module's submodule table refuses that at the assignment; a new submodule may be added (the
graph never calls it: code that calls it itself, a head applied to ``pm``'s outputs, runs it).
Parameters and buffers: the graph reads each from its module's table at every call, so one
removed (a parametrization such as ``weight_norm``, pruning) or replaced by a tensor of another
layout (shape, dtype, device, or a whole tensor where the plan holds a shard) is refused at the
assignment, naming ``pm.load_state_dict``; one of the same layout is read from the next call on.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.errors import HookError, UsageError

_TABLES = {
    "_forward_hooks": "register_forward_hook",
    "_forward_pre_hooks": "register_forward_pre_hook",
    "_backward_hooks": "register_full_backward_hook",
    "_backward_pre_hooks": "register_full_backward_pre_hook",
}
_GLOBAL_TABLES = {
    "_global_forward_hooks": "register_module_forward_hook",
    "_global_forward_pre_hooks": "register_module_forward_pre_hook",
    "_global_backward_hooks": "register_module_full_backward_hook",
    "_global_backward_pre_hooks": "register_module_full_backward_pre_hook",
}
_FIX = (
    "the compiled module runs a traced graph and never calls its submodules, so the hook would not run. "
    "Register module hooks on the model before autopar.compile (a forward hook's result is traced into the "
    "graph; its other effects run only while tracing), or a hook on the compiled module itself "
    "(pm.register_forward_hook), which runs at every call"
)


class _CheckedTable(OrderedDict):
    """A table whose every change passes ``_check(key, value)`` first (``value`` None: a removal),
    once built (OrderedDict's own ``__init__`` fills it through ``__setitem__``). A copy (deepcopy,
    pickling) is a plain table: the guard belongs to this module only."""

    _armed = False

    def _check(self, key: Any, value: Any = None) -> None:
        raise NotImplementedError

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._armed:
            self._check(key, value)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._check(key)
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self._check(key)
        return super().pop(key, *default)

    def popitem(self, last: bool = True) -> Any:
        self._check((next(reversed(self)) if last else next(iter(self))) if self else None)
        return super().popitem(last)

    def clear(self) -> None:
        for key in self:
            self._check(key)
        super().clear()

    def __reduce_ex__(self, protocol: int):
        return (OrderedDict, (list(self.items()),))


class _GuardedHooks(_CheckedTable):
    """A module's hook table after ``compile``: what it held stays, nothing is added or removed."""

    def __init__(self, held: dict, where: str, register: str) -> None:
        super().__init__(held)
        self._where = (where, register)
        self._armed = True

    def _check(self, key: Any, value: Any = None) -> None:
        self._refuse("removed from" if value is None else "on")

    def _refuse(self, action: str) -> None:
        where, register = self._where
        raise HookError(f"{register} {action} module {where!r} of a compiled module after autopar.compile: {_FIX}")

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self._refuse("on")
        return self[key]


_REPLACED_FIX = (
    "Load new values with pm.load_state_dict({{{path!r}: tensor}}, strict=False) (a whole tensor is cut into "
    "the plan's shards), or copy into it in place under torch.no_grad()"
)
_REMOVED_FIX = (
    "A parametrization (weight_norm, spectral_norm) or pruning goes on the model before autopar.compile; or compile again"
)
_MODULE_FIX = (
    "Make it on the model before autopar.compile (resize_token_embeddings, get_peft_model, a new head or "
    "activation), or compile again; a new submodule that the forward does not call may be added"
)


def _describe(value: Any) -> str:
    if isinstance(value, DTensor):
        return f"a DTensor {tuple(value.placements)} of global shape {tuple(value.shape)}, {value.dtype}"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
    return type(value).__name__


def _readable(old: Any, new: Any, kind: str) -> bool:
    """Whether the graph can read tensor ``new`` where it was traced with ``old``: a buffer's shard
    of the same layout, or a plain tensor of the same shape, dtype and device. A DTensor parameter
    is not replaced: the graph reads it through its ``LocalLeaf``, and the gradient buckets write
    the old one's ``.grad`` (2 ranks, an FSDP plan: the next call ran the old weights, 0.8 off)."""
    if isinstance(old, DTensor) or isinstance(new, DTensor):
        return (
            kind == "buffer"
            and isinstance(old, DTensor)
            and isinstance(new, DTensor)
            and old._spec == new._spec
            and old.to_local().shape == new.to_local().shape
        )
    return (
        isinstance(old, torch.Tensor)
        and isinstance(new, torch.Tensor)
        and (old.shape, old.dtype, old.device) == (new.shape, new.dtype, new.device)
    )


class _GuardedTable(_CheckedTable):
    """A module's submodule, parameter or buffer table after ``compile``: an entry the graph was
    traced with may not be removed, nor replaced by one the graph would not read as eager would
    (a module it never calls; a tensor of another layout); an entry added later is free."""

    def __init__(self, held: dict, where: str, kind: str) -> None:
        super().__init__(held)
        self._where, self._kind = where, kind
        self._traced = frozenset(held)  # the names the graph was traced with
        self._armed = True

    def _check(self, key: str, value: Any = None) -> None:
        if key not in self._traced:
            return
        old = OrderedDict.get(self, key)
        if old is value or (self._kind != "module" and value is not None and _readable(old, value, self._kind)):
            return
        path = f"{self._where}.{key}" if self._where else key
        if self._kind == "module":
            change = "removed" if value is None else f"replaced ({type(old).__name__} by {type(value).__name__})"
            raise UsageError(
                f"module {path!r} of a compiled module was {change} after autopar.compile: the compiled graph was "
                f"traced with the {type(old).__name__} and runs it still, where eager would run the change. " + _MODULE_FIX
            )
        change, fix = ("removed", _REMOVED_FIX) if value is None else (f"replaced by {_describe(value)}", _REPLACED_FIX)
        raise UsageError(
            f"{self._kind} {path!r} of a compiled module was {change} after autopar.compile, where the graph reads "
            f"{_describe(old)} at every call. " + fix.format(path=path)
        )


_GUARDED = {"_modules": "module", "_parameters": "parameter", "_buffers": "buffer"}


def _guard_tables(module: torch.nn.Module) -> list[tuple[str, dict]]:
    """Give every module under ``module`` (itself included) guarded hook and submodule tables; return the
    tables that held hooks, as (module name, the table itself): a handle made before compile
    removes from that table (it holds a weak reference to it), which the guard checks at calls."""
    held = []
    for name, sub in module.named_modules(remove_duplicate=False):
        for attr, kind in _GUARDED.items():
            entries = sub.__dict__.get(attr)
            if isinstance(entries, dict) and not isinstance(entries, _GuardedTable):
                object.__setattr__(sub, attr, _GuardedTable(entries, name, kind))
        for table, register in _TABLES.items():
            hooks = getattr(sub, table, None)
            if isinstance(hooks, dict) and not isinstance(hooks, _GuardedHooks):
                object.__setattr__(sub, table, _GuardedHooks(hooks, name or "(the root)", register))
                if hooks:
                    held.append((name or "(the root)", hooks))
    return held


@dataclass(frozen=True)
class HookGuard:
    """What ``check`` compares at each call: the keys of torch's global module hook tables at
    ``compile``, and the tables of hooks traced in (with their sizes then)."""

    keys: tuple[frozenset, ...]
    held: tuple[tuple[str, dict, int], ...] = ()

    @classmethod
    def install(cls, module: torch.nn.Module) -> HookGuard:
        """Guard the hook tables of every module under ``module``; remember the global ones."""
        held = tuple((name, hooks, len(hooks)) for name, hooks in _guard_tables(module))
        return cls(_global_keys(), held)

    def check(self) -> None:
        """Refuse a call after a global module hook was added or removed since ``compile``, or
        a hook traced into the graph was removed by its handle."""
        for name, hooks, size in self.held:
            if len(hooks) != size:
                raise HookError(
                    f"a hook of module {name!r} was removed after autopar.compile, but it is traced into the "
                    "graph and still runs there: compile again after removing it"
                )
        now = _global_keys()
        if now == self.keys:
            return
        changed = [register for (_, register), old, new in zip(_GLOBAL_TABLES.items(), self.keys, now) if old != new]
        raise HookError(
            f"a global module hook ({', '.join(changed)}) was added or removed after autopar.compile: {_FIX}. "
            "Remove it before calling the compiled module, or compile again after registering it"
        )


def _global_keys() -> tuple[frozenset, ...]:
    tables = torch.nn.modules.module
    return tuple(frozenset(getattr(tables, table)) for table in _GLOBAL_TABLES)


__all__ = ["HookGuard"]
