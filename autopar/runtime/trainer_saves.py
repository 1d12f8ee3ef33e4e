"""Hugging Face Trainer's own save of a compiled module is refused, at once and early, with the fix.

On several processes Trainer writes the model from rank 0 alone: ``Trainer._save`` returns at
once on the other ranks, and rank 0 then reads ``model.state_dict()`` and writes it with
safetensors. Trainer's all-rank saves are reserved to accelerate's own backends (FSDP, DeepSpeed:
its ``DistributedType`` is a closed list, with no plugin for another one) and to models that
transformers itself sharded at load time (whose full checkpoints Trainer refuses). A compiled
module's state is DTensor shards on every rank, which rank 0 cannot gather alone (safetensors
would fail on the first DTensor with "invalid python storage"). So:

- ``refuse_trainer_save``, called by ``ShardedModule.state_dict``, raises where its caller is
  Trainer's ``_save`` (``trainer.save_model()``, a checkpoint); every other caller (DCP, a script)
  gets the DTensors as before;
- ``watch_trainers`` registers a global optimizer step pre-hook that, at the first step of each
  optimizer, looks up the stack for a Trainer of a compiled module that will save checkpoints
  (any ``save_strategy`` but "no": with "steps", Trainer also saves at the last step) without
  ``autopar.checkpoint.trainer_callback()``, and raises on every rank then, not hours later at
  the first save.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import CheckpointError

_FIX = (
    "Pass Trainer(..., callbacks=[autopar.checkpoint.trainer_callback()]): every rank then saves Trainer's "
    "checkpoints in its own layout (save_pretrained's files, optimizer.pt, ...), which resume_from_checkpoint "
    "loads; and save the final model with pm.module.save_pretrained(output_dir) on every rank, not "
    "trainer.save_model()"
)
_MODULES: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # the compiled modules watched
_CHECKED: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
_HOOK: list[Any] = []
_MAX_DEPTH = 40  # frames between a Trainer's training loop and the step hook: a handful


def refuse_trainer_save() -> None:
    """Raise ``CheckpointError`` where the caller's caller is Hugging Face Trainer's ``_save``."""
    caller = sys._getframe(2)  # 0: here, 1: state_dict, 2: whoever asked for the state dict
    if caller.f_code.co_name != "_save" or not str(caller.f_globals.get("__name__", "")).startswith("transformers."):
        return
    raise CheckpointError(
        "Hugging Face Trainer saves the model from rank 0 alone, and a compiled module's weights are shards "
        f"(DTensors) on every rank that rank 0 cannot gather by itself. {_FIX}"
    )


def watch_trainers(pm: torch.nn.Module) -> None:
    """Refuse, at its first optimizer step, a Trainer of ``pm`` that would save without the callback
    (``autopar.checkpoint.trainer_callback()``, marked ``saves_compiled_modules``)."""
    _MODULES.add(pm)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_trainer))


def _check_trainer(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED[optimizer] = True
    trainer = calling_trainer()
    if trainer is None:
        return
    strategy = str(getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy))
    callbacks = trainer.callback_handler.callbacks
    own_save = type(trainer)._save_checkpoint is sys.modules["transformers.trainer"].Trainer._save_checkpoint
    if (
        trainer.model in _MODULES
        and own_save  # a subclass that saves its own way is left to it (its _save still refuses, at a save)
        and strategy != "no"
        and not any(getattr(callback, "saves_compiled_modules", False) for callback in callbacks)
    ):
        raise CheckpointError(
            f"this Hugging Face Trainer saves checkpoints (save_strategy={strategy!r}) from rank 0 alone, and a "
            f"compiled module's weights are shards (DTensors) on every rank that rank 0 cannot gather by itself: "
            f"refused at the first step rather than at the first save. {_FIX}; or save_strategy='no'"
        )


def takes_loss_kwargs(model: torch.nn.Module, signature: inspect.Signature | None) -> bool:
    """Trainer's test of whether ``model`` takes ``num_items_in_batch``: its ``accepts_loss_kwargs``,
    else a ``**kwargs`` in its forward (``signature``)."""
    declared = getattr(type(model), "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    return signature is not None and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())


def per_process_count(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the ``num_items_in_batch`` a Trainer passes (every rank's label tokens)
    multiplied by the factor Trainer then multiplies the model's loss by (its process count, where
    it averages tokens across devices), since the compiled module's loss sums the whole batch
    already: the loss Trainer backpropagates is then one process's. Unchanged outside Trainer's own
    ``compute_loss`` (a subclass's scales its loss as it chooses)."""
    trainer = calling_trainer("compute_loss")
    if trainer is None or not getattr(trainer.args, "average_tokens_across_devices", False):
        return kwargs
    factor = trainer.accelerator.num_processes // trainer.get_tp_size()
    count = kwargs["num_items_in_batch"]
    return kwargs if factor == 1 or count is None else {**kwargs, "num_items_in_batch": count * factor}


def calling_trainer(method: str | None = None) -> Any:
    """The ``transformers.Trainer`` whose method is on the stack above this call (the nearest one,
    and only where it is its own ``method``, where one is named), or None."""
    module = sys.modules.get("transformers.trainer")
    if module is None:
        return None
    frame = sys._getframe(1)
    for _ in range(_MAX_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self") if frame.f_globals.get("__name__") == "transformers.trainer" else None
        if isinstance(candidate, module.Trainer):
            return candidate if method is None or frame.f_code.co_name == method else None
        frame = frame.f_back
    return None
