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

Which parameters train is part of a mode too. Export records the gradient path of the parameters
that required grad, and the plan places them and their gradients' reductions by it: a parameter
frozen at ``compile`` and unfrozen later (gradual unfreezing) would get a gradient no reduction
was planned for (an FSDP plan's was local to each rank: wrong, without a word). A call with such
parameters trainable, grad enabled, gets a graph traced with them trainable (``ModeKey.unfrozen``).
A parameter frozen after ``compile`` needs none: the planned graph computes no gradient for it
(``ops.buckets``), as eager.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.fx

from autopar.errors import ModelError
from autopar.ir.plan import Plan
from autopar.trace import TracedModel, requires_grad


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

    @functools.cached_property
    def row_outputs(self) -> frozenset[int]:
        """The positions of the graph's outputs that leave split, each rank its own rows (the
        batched outputs under ``batch="per_rank"``: ``solver.planners.data``)."""
        output = next(reversed(self.traced.gm.graph.nodes))
        decision = self.plan.nodes.get(output.name)
        if decision is None:
            return frozenset()
        split = {
            producer for (producer, _), spec in zip(decision.inputs, decision.ins) if not all(p.is_replicate() for p in spec)
        }
        values = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
        return frozenset(i for i, value in enumerate(values) if isinstance(value, torch.fx.Node) and value.name in split)

    @functools.cached_property
    def row_inputs(self) -> frozenset[int]:
        """The positions among the user inputs of those that arrive as each rank's rows (the
        batched inputs under ``batch="per_rank"``)."""
        layout = self.plan.data_layout
        batched = set(layout.inputs) if layout.per_rank and layout.axes else set()
        users = [graph_input.name for graph_input in self.traced.inputs if graph_input.kind == "user"]
        return frozenset(i for i, name in enumerate(users) if name in batched)


class ModeKey(NamedTuple):
    """A call's mode: the root's training flag, the names of the modules whose flag differs from it
    (``""`` is the root's own module: ``pm.module``'s, where ``pm``'s is the root), and the
    parameters frozen at ``compile`` that this call trains."""

    training: bool
    odd: frozenset[str]
    unfrozen: frozenset[str] = frozenset()


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


def same_graph(a: TracedModel, b: TracedModel) -> bool:
    """Whether ``a`` and ``b`` are one graph: the same ops and shapes (``graph_hash``), and the
    same parameters trained (which the hash leaves out, and the plan's reductions follow)."""
    return a.graph_hash == b.graph_hash and _trained(a) == _trained(b)


def _trained(traced: TracedModel) -> frozenset[str]:
    return frozenset(node.name for node in traced.gm.graph.find_nodes(op="placeholder") if requires_grad(node))


def mode_name(training: bool) -> str:
    return "train" if training else "eval"


def mode_key(training: bool, modules: Iterable[tuple[str, torch.nn.Module]], unfrozen: frozenset[str] = frozenset()) -> ModeKey:
    """The mode of a model whose root is in ``training`` mode and whose modules are ``modules``,
    training the parameters ``unfrozen`` that were frozen at ``compile``."""
    return ModeKey(training, frozenset(name for name, module in modules if module.training != training), unfrozen)


def frozen_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``module``'s parameters that need no gradient (``requires_grad=False``), by name."""
    return [(name, param) for name, param in module.named_parameters() if not param.requires_grad]


def unfrozen(frozen: list[tuple[str, torch.nn.Parameter]]) -> frozenset[str]:
    """The names of ``frozen`` (``frozen_parameters`` at ``compile``) that a call under grad mode
    trains now: the empty set under ``torch.no_grad()``, where no gradient flows."""
    if not frozen or not torch.is_grad_enabled():
        return frozenset()
    return frozenset(name for name, param in frozen if param.requires_grad)


def describe_mode(key: ModeKey) -> str:
    """``"eval"``, ``"train (with 'backbone' in eval mode)"``, ``"train (training '0.weight', frozen
    at compile)"``."""
    training, odd, thawed = key
    said = []
    if odd:
        # the topmost of them: 'backbone', not each of its modules too
        names = sorted(name for name in odd if not any(name.startswith(f"{other}.") for other in odd if other))
        listed = _listed([repr(name) if name else "the model's root" for name in names])
        said.append(f"with {listed} in {mode_name(not training)} mode")
    if thawed:
        said.append(f"training {_listed([repr(name) for name in sorted(thawed)])}, frozen at compile")
    return mode_name(training) + (f" ({'; '.join(said)})" if said else "")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


@contextlib.contextmanager
def in_mode(model: torch.nn.Module, key: ModeKey) -> Iterator[None]:
    """``model`` with every module's flag as ``key`` has it and its ``unfrozen`` parameters
    trainable; each module's own flag and each parameter's back after."""
    modules = list(model.named_modules())
    was = [module.training for _, module in modules]
    thawed = [model.get_parameter(name) for name in sorted(key.unfrozen)]
    frozen = [param for param in thawed if not param.requires_grad]
    for name, module in modules:
        module.training = key.training != (name in key.odd)
    for param in frozen:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for (_, module), flag in zip(modules, was):
            module.training = flag
        for param in frozen:
            param.requires_grad_(False)
