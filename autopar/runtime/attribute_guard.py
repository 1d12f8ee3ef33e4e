"""A plain attribute the traced forward read, set after ``compile``, is refused, not silently kept.

The graph holds the values its forward read from the model's Python attributes
(``trace.reads``: ``self.scale``, ``self.use_extra``, ``layer.gradient_checkpointing``) as
constants. Eager reads them at every call, so a script that sets one later (a temperature, a
drop-path rate, a switch) would compute otherwise than the compiled module, which would not
say so. ``AttributeGuard.check`` runs at each call and compares each such attribute, where a
user may set it (on ``pm.module``'s module of that name, on the model's own, kept weakly, and
for the root on ``pm`` itself), with the value the graph holds; a change raises ``ConfigError``
naming the attribute, both values and the fixes: compile again, or hold a value that changes in
a buffer (a graph input, read at every call).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from autopar.errors import ConfigError

_MISSING = object()


def _same(a: Any, b: Any) -> bool:
    """Whether ``a`` is ``b``'s value: equal scalars of one type, or the very tensor (which the graph
    holds: a change in place reaches it)."""
    if type(a) is not type(b) or isinstance(a, torch.Tensor):
        return a is b
    return a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


class AttributeGuard:
    """The attributes the graphs of one compiled module read, and where to look for a change."""

    def __init__(self, owner: torch.nn.Module, view: torch.nn.Module, model: torch.nn.Module, reads: Iterable[tuple]):
        self._roots = (("pm.module", weakref.ref(view)), ("model", weakref.ref(model)))
        self._owner = weakref.ref(owner)
        self._own = frozenset(owner.__dict__)  # the compiled module's own attributes: not the model's
        self._held: dict[tuple[str, str], Any] = {}
        self._checks: list[tuple[str, weakref.ref, list[tuple[str, Any]]]] | None = None
        self.add(reads)

    def add(self, reads: Iterable[tuple]) -> None:
        """Guard ``reads`` too ((module FQN, name, value) of a graph's trace: ``TracedModel.reads``)."""
        for fqn, name, value in reads:
            self._held.setdefault((fqn, name), value)
        self._checks = None

    def check(self) -> None:
        """ConfigError where a guarded attribute holds another value than the graph's (a few
        dictionary reads an attribute where none changed)."""
        if self._checks is None:
            self._checks = self._resolved()
        for where, ref, items in self._checks:
            module = ref()
            if module is None:
                continue
            attributes = module.__dict__
            for name, held in items:
                current = attributes.get(name, _MISSING)
                if current is held or current is _MISSING or _same(current, held):
                    continue
                raise ConfigError(_changed(f"{where}.{name}", current, held))

    def _resolved(self) -> list[tuple[str, weakref.ref, list[tuple[str, Any]]]]:
        """(how a message names the module, a weak reference to it, its guarded (name, value)s) for
        each place a user may set an attribute: ``pm.module``'s modules, the model's own, and for the
        root, ``pm`` itself (but its own attributes)."""
        by_fqn: dict[str, list[tuple[str, Any]]] = {}
        for (fqn, name), held in self._held.items():
            by_fqn.setdefault(fqn, []).append((name, held))
        checks = []
        for fqn, items in by_fqn.items():
            for prefix, root in self._roots:
                module = _submodule(root(), fqn)
                if module is not None:
                    checks.append((f"{prefix}.{fqn}" if fqn else prefix, weakref.ref(module), items))
            owner = self._owner()
            if not fqn and owner is not None:
                checks.append(("pm", weakref.ref(owner), [(n, v) for n, v in items if n not in self._own]))
        return checks


def _changed(where: str, current: Any, held: Any) -> str:
    """The message of a guarded attribute that changed."""
    if isinstance(held, torch.Tensor):
        return (
            f"{where} is another tensor than the one the compiled graph holds, which its forward read when "
            "autopar.compile traced it: eager would compute with the new one. Copy into it in place "
            f"({where}.copy_(new), which the graph sees), register it as a buffer, or compile the model again"
        )
    return (
        f"{where} is {current!r}, but the compiled graph holds {held!r}, the value its forward read when "
        f"autopar.compile traced it: eager would compute with {current!r}. Compile the model again after setting "
        "it, or keep a value that changes in a buffer (register_buffer), which the graph reads at every call"
    )


def _submodule(root: torch.nn.Module | None, fqn: str) -> torch.nn.Module | None:
    if root is None:
        return None
    try:
        return root.get_submodule(fqn) if fqn else root
    except AttributeError:
        return None


__all__ = ["AttributeGuard"]
