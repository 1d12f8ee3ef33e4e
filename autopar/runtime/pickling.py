"""A compiled module is not pickled: ``torch.save(pm)`` fails at once, naming what to save.

``pm`` holds this rank's shards, its process groups' names, a device mesh and rewritten graphs:
nothing another process could run, and its class (like ``pm.module``'s ``Distributed<Model>``,
made per model class as FSDP2 makes its own) is made at compile time, so pickle would stop on it
with "attribute lookup ... failed". ``NotPickled`` refuses pickling with the fix instead, and
keeps ``copy.deepcopy`` (a copy in this process, as ``swa_utils.AveragedModel`` makes one), which
goes through the same ``__reduce_ex__`` unless a class has its own ``__deepcopy__``.

The hooks autopar puts on the user's model (``runtime.stale_model``, ``runtime.originals``) watch
that model and its compiled module: a copy or pickle of the model keeps an ``InertHook`` instead.
"""

from __future__ import annotations

import copy
from typing import Any

from autopar.errors import CheckpointError


class NotPickled:
    """Mixed into the compiled module's class and ``pm.module``'s: pickling either raises the fix."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise CheckpointError(
            f"a compiled module cannot be pickled (torch.save or pickle of {type(self).__name__}): it holds this "
            "rank's shards, process groups and rewritten graphs, which no other process can use. Save its "
            "state instead: the whole model with state = pm.module.state_dict() on every rank, then "
            "torch.save(state, path) on rank 0 (a plain model loads it; so does pm.load_state_dict), or a "
            "sharded checkpoint with autopar.checkpoint.save(path, pm, optimizer) (torch.distributed.checkpoint) "
            "on every rank; compile the model again to train it"
        )

    def __deepcopy__(self, memo: dict) -> Any:
        # what copy.deepcopy does without this method, from object's own reduction (not the refusal above)
        return copy._reconstruct(self, memo, *object.__reduce_ex__(self, 4))  # type: ignore[attr-defined]


class InertHook:
    """What a copied or unpickled model keeps of a hook autopar put on it: nothing to run. Such a
    hook's ``__reduce__`` returns ``(InertHook, ())``."""

    autopar_guard = True  # not the model's own hook (trace.hooks)

    def __call__(self, *args: Any) -> None:
        return None
