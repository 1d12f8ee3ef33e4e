"""Hugging Face Trainer's own save of a compiled module is refused at once, with the fix.

On several processes Trainer writes the model from rank 0 alone: ``Trainer._save`` returns at
once on the other ranks, and rank 0 then reads ``model.state_dict()`` and writes it with
safetensors. Trainer's all-rank saves are reserved to accelerate's own backends (FSDP, DeepSpeed:
its ``DistributedType`` is a closed list, with no plugin for another one) and to models that
transformers itself sharded at load time (whose full checkpoints Trainer refuses). A compiled
module's state is DTensor shards on every rank, which rank 0 cannot gather alone (safetensors
would fail on the first DTensor with "invalid python storage"). ``ShardedModule.state_dict``
therefore calls ``refuse_trainer_save``, which raises where its caller is Trainer's ``_save``:
every other caller (DCP, a script) gets the DTensors as before.
``autopar.checkpoint.trainer_callback()`` saves Trainer's checkpoints from every rank instead.
"""

from __future__ import annotations

import sys

from autopar.errors import CheckpointError


def refuse_trainer_save() -> None:
    """Raise ``CheckpointError`` where the caller's caller is Hugging Face Trainer's ``_save``."""
    caller = sys._getframe(2)  # 0: here, 1: state_dict, 2: whoever asked for the state dict
    if caller.f_code.co_name != "_save" or not str(caller.f_globals.get("__name__", "")).startswith("transformers."):
        return
    raise CheckpointError(
        "Hugging Face Trainer saves the model from rank 0 alone, and a compiled module's weights are shards "
        "(DTensors) on every rank that rank 0 cannot gather by itself. Pass "
        "Trainer(..., callbacks=[autopar.checkpoint.trainer_callback()]): every rank then saves Trainer's "
        "checkpoints in its own layout (save_pretrained's files, optimizer.pt, ...), which resume_from_checkpoint "
        "loads; and save the final model with pm.module.save_pretrained(output_dir) on every rank, not "
        "trainer.save_model()"
    )
