"""Hugging Face ``Trainer`` checkpoints of a compiled module (docs/huggingface.md).

On a multi-process run Trainer writes its checkpoints from rank 0 alone: ``_save`` returns at
once on the other ranks, and rank 0 then reads ``model.state_dict()`` and
``optimizer.state_dict()`` by itself. A sharded model cannot be gathered by one rank, and the
DTensors of ``pm.state_dict()`` are this rank's shards, which safetensors refuses and which
``torch.load`` on another rank would read as its own. So this callback, which every rank runs,
takes the save over where Trainer decides to save (``control.should_save``, set by Trainer's
own flow callback just before it), in Trainer's own layout, so that Trainer's own
``resume_from_checkpoint`` reads it back:

- ``checkpoint-N/``: ``save_pretrained`` of ``pm.module`` (``config.json``, ``model.safetensors``)
  with the whole weights, which every rank gathers and rank 0 writes (``from_pretrained`` loads it);
- ``optimizer.pt``: the optimizer's ``state_dict()`` with each DTensor gathered whole (the format
  one process writes); ``scheduler.pt``; ``rng_state_<rank>.pth``; ``trainer_state.json``.

Trainer's resume loads the whole weights into ``pm`` (``pm.load_state_dict`` cuts each rank's
shard) and the whole optimizer state into the optimizer, whose tensors this callback cuts to each
parameter's shard at ``on_train_begin``, before the first step.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from autopar.errors import CheckpointError
from autopar.runtime.loaded_state import cut_state

# Trainer's own file names (transformers.trainer), which its resume looks for.
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"


class TrainerCheckpoints(TrainerCallback):
    """Trainer's checkpoints (``save_strategy`` "steps" or "epoch") of a compiled module, saved by
    every rank and resumed by Trainer's own ``resume_from_checkpoint`` (see the module docstring)."""

    saves_compiled_modules = True  # runtime.trainer_saves lets a Trainer with this callback save

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        _parallel_module(model)
        if args.load_best_model_at_end or args.save_strategy == "best":
            raise CheckpointError(
                "autopar's TrainerCheckpoints saves in Trainer's stead, and Trainer cannot track the best "
                "checkpoint of saves it does not make: leave load_best_model_at_end=False and use save_strategy "
                "'steps' or 'epoch'"
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs):
        if optimizer is not None:  # a resumed run loaded whole tensors: cut each rank's shard before the first step
            shard_whole_state(_parallel_module(model), optimizer)

    # Trainer logs, then evaluates, then saves: the save waits for the last of these that is due, so
    # that the checkpoint's trainer_state.json holds the step's log and metrics, as Trainer's does.
    _pending: str | None = None  # "log" or "evaluate": the event after which a due save runs

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._plan_save(args, state, control, **kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._plan_save(args, state, control, **kwargs)

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending == "log":
            self._save(args, state, **kwargs)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._pending == "evaluate":
            self._save(args, state, **kwargs)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_pending(args, state, **kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_pending(args, state, **kwargs)

    def _plan_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._save_pending(args, state, **kwargs)  # one whose log did not happen (nothing new to log)
        if not control.should_save:
            return
        control.should_save = False  # Trainer's own save runs on rank 0 alone: this one replaces it
        self._pending = "evaluate" if control.should_evaluate else "log" if control.should_log else None
        if self._pending is None:
            self._save(args, state, **kwargs)

    def _save_pending(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self._pending is not None:
            self._save(args, state, **kwargs)

    def _save(self, args: Any, state: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self._pending = None
        save_checkpoint(args, state, _parallel_module(model), optimizer, kwargs.get("lr_scheduler"))


def save_checkpoint(args: Any, state: Any, pm: Any, optimizer: Any, lr_scheduler: Any) -> str:
    """Write ``checkpoint-<global_step>`` under ``args.output_dir`` in Trainer's layout; every rank calls it."""
    output_dir = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
    writer = args.should_save  # rank 0 (or each node's first rank under save_on_each_node)
    # save_pretrained reads the view's state_dict(), the whole weights that every rank gathers
    pm.module.save_pretrained(output_dir, is_main_process=writer)
    whole_optimizer = None
    if optimizer is not None and not args.save_only_model:
        whole_optimizer = whole_optimizer_state(optimizer, keep=writer)
    if writer:
        if whole_optimizer is not None:
            torch.save(whole_optimizer, os.path.join(output_dir, OPTIMIZER_NAME))
        if lr_scheduler is not None and not args.save_only_model:
            torch.save(lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
    if not args.save_only_model:  # as Trainer: each rank's RNG state, in its own file
        name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.random.get_rng_state_all()
        torch.save(rng, os.path.join(output_dir, name))
    if dist.is_initialized():
        dist.barrier()  # the directory is whole before any rank goes on (or rotates it away)
    if writer:
        rotate_checkpoints(
            output_dir=args.output_dir,
            save_total_limit=args.save_total_limit,
            best_model_checkpoint=state.best_model_checkpoint,
            use_mtime=True,
        )
    return output_dir


def whole_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool = True) -> dict[str, Any] | None:
    """``optimizer.state_dict()`` with every DTensor gathered whole, on the CPU (every rank calls
    it, in the same order: the state dict's); plain tensors (AdamW's ``step``) are the same on every
    rank. ``keep=False`` (a rank that writes nothing) takes part in each gather, keeps nothing and
    returns None, so that only the writer ever holds the whole state."""
    out = optimizer.state_dict()
    for index in sorted(out["state"]):
        # state_dict() shares each parameter's state dict with the optimizer: fill a copy
        entry = out["state"][index] = dict(out["state"][index])
        for key, value in entry.items():
            if isinstance(value, DTensor):
                whole = value.full_tensor()
                entry[key] = whole.cpu() if keep else None
    return out if keep else None


@torch.no_grad()
def shard_whole_state(pm: Any, optimizer: torch.optim.Optimizer) -> int:
    """Replace each whole plain state tensor of a DTensor parameter (as ``load_state_dict`` of
    ``whole_optimizer_state`` leaves them) by this rank's shard; return how many were cut. A plain
    parameter (a plan that replicates every parameter) keeps its whole state as loaded."""
    names = {id(param): name for name, param in pm.named_parameters()}
    return sum(
        cut_state(pm, names.get(id(param), "?"), param, optimizer.state[param])
        for group in optimizer.param_groups
        for param in group["params"]
        if param in optimizer.state
    )


def _parallel_module(model: Any) -> Any:
    from autopar.runtime.module import ParallelModule  # at call time: module imports this package's peers

    if not isinstance(model, ParallelModule):
        raise CheckpointError(
            "autopar's TrainerCheckpoints saves a compiled module: pass Trainer(model=pm) with pm from "
            f"autopar.compile, given {type(model).__name__}"
        )
    if model._offloader is not None:
        raise CheckpointError(
            "autopar's TrainerCheckpoints cannot gather an offloading plan's optimizer state: save with "
            "autopar.checkpoint.save(path, pm, optimizer) on every rank instead"
        )
    return model
