"""Sharded checkpoints of a compiled module and its optimizer (``autopar.runtime.checkpoint``)::

autopar.checkpoint.save(path, pm, optimizer)     # every rank; a directory
autopar.checkpoint.load(path, pm, optimizer)     # every rank; any mesh, any plan

and Hugging Face Trainer's own checkpoints: ``Trainer(model=pm, ...,
callbacks=[autopar.checkpoint.trainer_callback()])`` (``autopar.runtime.trainer_checkpoints``).
"""

from typing import Any

from autopar.errors import CheckpointError
from autopar.runtime.checkpoint import load, save

__all__ = ["CheckpointError", "load", "save", "trainer_callback"]


def trainer_callback() -> Any:
    """A ``transformers.TrainerCallback`` with which every rank saves Trainer's checkpoints of a
    compiled module, and Trainer's ``resume_from_checkpoint`` resumes them (docs/huggingface.md)."""
    from autopar.runtime.trainer_checkpoints import TrainerCheckpoints  # transformers is optional

    return TrainerCheckpoints()
