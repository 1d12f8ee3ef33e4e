"""The model's plain attributes that its forward reads while tracing (``model_reads``).

A traced graph holds the values its forward read from Python attributes (``self.scale = 0.5``,
``self.use_bias_trick = True``, ``self.drop_path_rate``) as constants: set one after ``compile``
and eager would compute otherwise, while the graph would not, without a word. While tracing,
each module of the model reads its attributes through a recording subclass of its own class
(same name, module and behaviour, so the graph and its metadata are what export gives), and the
trace keeps the (module FQN, name) of every instance attribute read whose value is a bool, int,
float, str or None, or a plain tensor attribute (neither parameter nor buffer: the graph holds
that tensor, so a change in place reaches it, another tensor assigned does not), but ``training``
(each mode has a graph of its own: ``runtime.modes``) and those forward sets itself (eager sets
them again at each call, whatever a script set).
``runtime.attribute_guard`` compares them at each call. Those forward reads before it sets them
are state one call leaves to the next (``self.calls += 1``), which a graph cannot carry:
``Reads.carried``, which ``compile`` refuses (``runtime.compile_checks.check_carried_state``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

SCALARS = (bool, int, float, str, type(None))
GUARDED = (*SCALARS, torch.Tensor)  # what a read attribute may hold to be guarded (``runtime.attribute_guard``)
_SUBCLASSES: dict[type, type] = {}


def _recording(cls: type, reads: set[tuple[int, str]], writes: set[tuple[int, str]], early: set[tuple[int, str]]) -> type:
    """A subclass of ``cls`` that adds (id(module), name) to the active ``reads`` for a scalar or
    tensor instance attribute read (and to ``early`` where forward had not set it yet), and to
    ``writes`` for any attribute set; one class per module class, whose sets are the trace's."""
    made = _SUBCLASSES.get(cls)
    if made is None:

        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 - the protocol's name
            value = object.__getattribute__(self, name)
            if name != "training" and isinstance(value, GUARDED):  # each mode has its own graph
                attributes = object.__getattribute__(self, "__dict__")
                if name in attributes:
                    made = type(self)
                    made._autopar_reads.add((id(self), name))
                    if (id(self), name) not in made._autopar_writes:
                        made._autopar_early.add((id(self), name))
            return value

        def __setattr__(self: Any, name: str, value: Any) -> None:  # noqa: N807
            type(self)._autopar_writes.add((id(self), name))
            cls.__setattr__(self, name, value)

        namespace = {
            "__getattribute__": __getattribute__,
            "__setattr__": __setattr__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        }
        made = _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    made._autopar_reads, made._autopar_writes, made._autopar_early = reads, writes, early
    return made


@dataclasses.dataclass
class Reads:
    """What ``model_reads`` found, as (module FQN, attribute name) pairs: the attributes forward
    read and did not set (``read``), those it read before setting them (``carried``: state one
    call leaves to the next, a counter or a cached length), and the public ones it set otherwise
    (``sets``: a compiled module leaves them as they were, ``self.last_attention = ...``)."""

    read: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    carried: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    sets: set[tuple[str, str]] = dataclasses.field(default_factory=set)  # set by forward, not carried


@contextlib.contextmanager
def model_reads(model: torch.nn.Module) -> Iterator[Reads]:
    """While tracing ``model``: record its modules' scalar attribute reads. The yielded ``Reads`` is
    filled on exit. A module whose class cannot be swapped (a TorchScript or C++ module) is not
    recorded."""
    seen: set[tuple[int, str]] = set()
    written: set[tuple[int, str]] = set()
    early: set[tuple[int, str]] = set()
    names = {id(module): fqn for fqn, module in model.named_modules()}
    swapped = []
    for module in {id(m): m for m in model.modules()}.values():
        cls = type(module)
        if cls in _SUBCLASSES.values():  # a nested trace of the same model
            continue
        try:
            module.__class__ = _recording(cls, seen, written, early)
        except TypeError:
            continue
        swapped.append((module, cls))
    found = Reads()
    try:
        yield found
    finally:
        for module, cls in swapped:
            module.__class__ = cls
        found.read.update((names[key], name) for key, name in seen - written if key in names)
        found.carried.update((names[key], name) for key, name in early & written if key in names)
        modules = {id(module): module for module, _ in swapped}
        # a private name is the module's own bookkeeping (LSTM's _flat_weights), not a value for the user;
        # a buffer set anew is a mutation the graph writes back, a parameter or submodule is no plain value
        found.sets.update(
            (names[key], name)
            for key, name in written - early
            if key in names and not name.startswith("_") and not _held(modules.get(key), name)
        )


def _held(module: torch.nn.Module | None, name: str) -> bool:
    """Whether ``name`` is one of ``module``'s buffers, parameters or submodules."""
    return module is not None and any(name in getattr(module, table) for table in ("_buffers", "_parameters", "_modules"))


__all__ = ["GUARDED", "Reads", "model_reads"]
