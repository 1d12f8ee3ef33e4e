"""The model's own activation checkpointing (``torch.utils.checkpoint``), traced as plain code and
handed to the planner.

A model may recompute parts of its forward in backward itself: Hugging Face's
``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``, a hand-written
``checkpoint(block, x)``. Export would trace such a call as plain forward ops (the non-reentrant
kind: its recompute is lost without a word) or as a Function under no-grad (the reentrant kind:
the graph then cuts the region from autograd). While tracing (``model_checkpoints``), each call
runs its function directly and is counted instead, so the graph is the model's forward as it
computes, and the plan recomputes what the model asked for: the planner's checkpoint policy
(``TracedModel.checkpointing``: "full", or "selective" where every call passed a ``context_fn``,
torch's selective checkpointing) for the layers that hold the modules it checkpointed (all of
them where a call's function is no module's: ``checkpoint_sequential``'s), unless
``checkpointing=`` says otherwise (``solver.planners.sharding``).

One case is refused, not traced: a reentrant checkpoint (``use_reentrant=True``, torch's old
default) none of whose tensor inputs requires grad. Eager autograd then gives the region's
parameters no gradient at all (torch only warns "None of the inputs have requires_grad=True"); a
plan would train them, and the two would differ silently.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from autopar.errors import TraceError


@dataclass
class Checkpoints:
    """The ``torch.utils.checkpoint`` calls one trace saw."""

    names: dict[int, str]  # id of each module of the model -> its FQN
    calls: int = 0
    selective: int = 0  # those with a ``context_fn`` (a selective checkpoint policy)
    modules: set[str] = field(default_factory=set)  # the FQNs of the modules they ran
    unnamed: int = 0  # those whose function is no module's (a closure)

    @property
    def layers(self) -> tuple[str, ...]:
        """The FQNs of the modules the model checkpointed; () where some call's is unknown."""
        return () if self.unnamed else tuple(sorted(self.modules))

    @property
    def policy(self) -> str | None:
        """The checkpoint policy the model asks for: None where it made no call."""
        if not self.calls:
            return None
        return "selective" if self.selective == self.calls else "full"

    def note(self) -> str:
        shown = ", ".join(self.layers[:3]) + (" ..." if len(self.layers) > 3 else "")
        where = f"the layers of {shown}" if self.layers else "every layer"
        return (
            f"the model checkpoints activations itself ({self.calls} torch.utils.checkpoint call"
            f"{'s' if self.calls > 1 else ''} while tracing): traced as plain forward code, and planned as "
            f"checkpointing={self.policy!r} for {where} where checkpointing= is not given (None) "
            "and no pipeline is"
        )

    def saw(self, function: Any) -> None:
        """Count a call of ``function``, and the module it runs where it is one's: a module, a bound
        method such as ``layer.__call__``, or a ``functools.partial`` of either or of a function
        given the module first (Hugging Face's ``partial(forward, layer, **kwargs)``)."""
        self.calls += 1
        fqn = self.names.get(id(_module_of(function)))
        if fqn is None:
            self.unnamed += 1
        else:
            self.modules.add(fqn)


def _module_of(function: Any) -> torch.nn.Module | None:
    """The module ``function`` runs (``Checkpoints.saw``), or None."""
    while isinstance(function, functools.partial):
        if function.args and isinstance(function.args[0], torch.nn.Module):
            return function.args[0]
        function = function.func
    module = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return module if isinstance(module, torch.nn.Module) else None


class _Reentrant:
    """Stands for ``torch.utils.checkpoint.CheckpointFunction`` while tracing."""

    seen: Checkpoints

    @classmethod
    def apply(cls, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
        if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            raise TraceError(
                f"torch.utils.checkpoint(use_reentrant=True) of {_name(function)} takes no tensor that requires grad, "
                "so eager autograd gives the parameters inside it no gradient (torch warns 'None of the inputs have "
                "requires_grad=True') and a plan would train them. Pass use_reentrant=False to checkpoint (Hugging "
                "Face: gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), or "
                "model.enable_input_require_grads()), or leave checkpointing to autopar (checkpointing=)"
            )
        cls.seen.saw(function)
        return function(*args)


def _name(function: Any) -> str:
    module = _module_of(function)
    return type(module).__name__ if module is not None else getattr(function, "__qualname__", repr(function))


@contextlib.contextmanager
def model_checkpoints(model: torch.nn.Module) -> Iterator[Checkpoints]:
    """While tracing ``model``: ``torch.utils.checkpoint`` calls run their function directly,
    counted in the yielded ``Checkpoints``. Where this torch names its two kinds otherwise, calls
    trace as export traces them."""
    seen = Checkpoints(names={id(module): fqn for fqn, module in model.named_modules()})

    def non_reentrant(function: Any, preserve_rng_state: bool, context_fn: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        seen.saw(function)
        seen.selective += context_fn is not torch_checkpoint.noop_context_fn
        yield  # checkpoint() runs the function between its two next() calls; a second one ends it

    reentrant = type("CheckpointFunction", (_Reentrant,), {"seen": seen})
    names = {"CheckpointFunction": reentrant, "_checkpoint_without_reentrant_generator": non_reentrant}
    saved = {name: getattr(torch_checkpoint, name) for name in names if hasattr(torch_checkpoint, name)}
    if len(saved) < len(names):  # another torch's internals: leave them alone
        yield seen
        return
    try:
        for name, shim in names.items():
            setattr(torch_checkpoint, name, shim)
        yield seen
    finally:
        for name, value in saved.items():
            setattr(torch_checkpoint, name, value)


__all__ = ["Checkpoints", "model_checkpoints"]
