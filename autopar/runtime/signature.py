"""The compiled module's ``forward`` shows the model's own signature.

Code that inspects a model's forward to decide what to pass it reads ``inspect.signature(
model.forward)``: Hugging Face's ``Trainer`` keeps only the dataset columns named there (with
``forward(*args, **kwargs)`` it would drop every column) and passes loss keywords where the
signature takes ``**kwargs``. The compiled module takes the same call as the model, so it shows the
same signature: its class becomes a subclass of its own class (as FSDP2's ``fully_shard`` makes
one per model class) whose ``forward`` carries the model's signature and runs the module's.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch


def forward_signature(model: torch.nn.Module) -> inspect.Signature | None:
    """``inspect.signature(model.forward)``, or None for a builtin or C forward, which has none."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def adopt_signature(pm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Make ``inspect.signature(pm.forward)`` that of ``model.forward`` (nothing where it has none)."""
    signature = forward_signature(model)
    if signature is None:  # keep the module's own
        return
    base = type(pm)
    run = base.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run(self, *args, **kwargs)

    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])  # type: ignore[attr-defined]
    forward.__doc__ = run.__doc__
    subclass = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__})
    subclass.__qualname__ = base.__qualname__
    pm.__class__ = subclass
