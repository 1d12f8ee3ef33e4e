"""One rewritten graph per module mode: ``train()`` and ``eval()`` run the graph of their mode.

A model's code branches on ``self.training`` (batch norm's batch or running statistics, dropout,
any ``if self.training:`` of its own), and export records one branch. The compiled module keeps a
``ModeGraph`` per mode: the graph traced with the model in that mode, its plan and its inputs.
The mode it was compiled in is made by ``compile``; the other is made the first time it is
called, by a builder ``compile`` hands over, which traces the model in that mode and plans it
with every parameter and buffer pinned to the placements it already has, so that both graphs read
and write the same shards (running statistics written in train mode are read in eval mode).

A mode is the whole model's (``ModeKey``): the root's flag and the modules whose own flag differs
(a frozen backbone's ``pm.module.backbone.eval()`` in a training model, batch norms held in eval
mode, dropout kept on in eval for Monte Carlo sampling), since eager runs each module in its own
mode. A call in a mode no graph was traced in gets one of its own, traced with every module's flag
as the call has it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autopar.errors import ModelError
from autopar.ir.plan import Plan
from autopar.trace import TracedModel


@dataclass(frozen=True)
class ModeGraph:
    """What a forward in one mode runs: the module's submodule ``attr`` (the rewritten graph),
    its plan and its traced model (for the inputs' order, the constants and the outputs'
    structure)."""

    traced: TracedModel
    plan: Plan
    attr: str = "graph_module"

    @property
    def inputs(self) -> list[tuple[str, str, str | None]]:
        return [(gi.name, gi.kind, gi.fqn) for gi in self.traced.inputs]


# The root's training flag and the names of the modules whose flag differs from it ("" is the root's
# own module: ``pm.module``'s, where ``pm``'s is the root).
ModeKey = tuple[bool, frozenset[str]]

# Made by ``compile``: (mode key, examples=None) -> (traced model, rewritten graph, plan) of that
# mode, traced on the example inputs, or on ``examples`` ((args, kwargs): ``runtime.shapes``).
ModeBuilder = Callable[..., tuple[TracedModel, torch.fx.GraphModule, Plan]]


def pinned_placements(traced: TracedModel, plan: Plan) -> dict[str, Any]:
    """Placeholder name → the spec ``plan`` gives its parameter or buffer, for every parameter
    and buffer of ``traced``: the ``forced`` specs that plan another mode's graph on the shards
    the module already holds. A tensor the plan does not hold is an error that names it."""
    pinned = {}
    for graph_input in traced.inputs:
        if graph_input.kind not in ("param", "buffer"):
            continue
        fqn = graph_input.fqn
        spec = plan.params.get(fqn, plan.params.get(traced.ties.get(fqn, fqn)))
        if spec is None:
            raise ModelError(
                f"the model reads {'parameter' if graph_input.kind == 'param' else 'buffer'} {fqn!r} in this mode but not in the mode it was compiled in, so "
                "the compiled module holds no shard of it: compile the model in the mode that reads every "
                "parameter and buffer (model.train() or model.eval() before autopar.compile)"
            )
        pinned[graph_input.name] = spec
    return pinned


def mode_name(training: bool) -> str:
    return "train" if training else "eval"


def mode_key(training: bool, modules: Iterable[tuple[str, torch.nn.Module]]) -> ModeKey:
    """The mode of a model whose root is in ``training`` mode and whose modules are ``modules``."""
    return training, frozenset(name for name, module in modules if module.training != training)


def describe_mode(key: ModeKey) -> str:
    """``"eval"``, or ``"train (with 'backbone' in eval mode)"``."""
    training, odd = key
    if not odd:
        return mode_name(training)
    # the topmost of them: 'backbone', not each of its modules too
    names = sorted(name for name in odd if not any(name.startswith(f"{other}.") for other in odd if other))
    listed = ", ".join(repr(name) if name else "the model's root" for name in names[:3])
    listed += f" and {len(names) - 3} more" if len(names) > 3 else ""
    return f"{mode_name(training)} (with {listed} in {mode_name(not training)} mode)"


@contextlib.contextmanager
def in_mode(model: torch.nn.Module, key: ModeKey) -> Iterator[None]:
    """``model`` with every module's flag as ``key`` has it; each module's own flag back after."""
    modules = list(model.named_modules())
    was = [module.training for _, module in modules]
    training, odd = key
    for name, module in modules:
        module.training = training != (name in odd)
    try:
        yield
    finally:
        for (_, module), flag in zip(modules, was):
            module.training = flag
