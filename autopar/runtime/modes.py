"""One rewritten graph per module mode: ``train()`` and ``eval()`` run the graph of their mode.

A model's code branches on ``self.training`` (batch norm's batch or running statistics, dropout,
any ``if self.training:`` of its own), and export records one branch. The compiled module keeps a
``ModeGraph`` per mode: the graph traced with the model in that mode, its plan and its inputs.
The mode it was compiled in is made by ``compile``; the other is made the first time it is
called, by a builder ``compile`` hands over, which traces the model in that mode and plans it
with every parameter and buffer pinned to the placements it already has, so that both graphs read
and write the same shards (running statistics written in train mode are read in eval mode).
"""

from __future__ import annotations

from collections.abc import Callable
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


# Made by ``compile``: (training, examples=None) -> (traced model, rewritten graph, plan) of that
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
