"""Sharded checkpoints of a compiled module and its optimizer (``autopar.runtime.checkpoint``)::

autopar.checkpoint.save(path, pm, optimizer)     # every rank; a directory
autopar.checkpoint.load(path, pm, optimizer)     # every rank; any mesh, any plan
"""

from autopar.errors import CheckpointError
from autopar.runtime.checkpoint import load, save

__all__ = ["CheckpointError", "load", "save"]
