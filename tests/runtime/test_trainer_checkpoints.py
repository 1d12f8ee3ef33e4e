"""Trainer's checkpoints of a compiled module (``autopar.runtime.trainer_checkpoints``): what it
refuses at once, on every rank (best-model tracking: tests/test_errors.py). The save and resume
themselves, on 2 ranks against one eager process, are in tests/runtime/test_hf_trainer.py."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")


def _args(**overrides):
    base = {"load_best_model_at_end": False, "save_strategy": "steps"}
    return types.SimpleNamespace(**{**base, **overrides})


def test_a_model_that_is_not_compiled_is_refused_with_the_fix() -> None:
    import autopar

    callback = autopar.checkpoint.trainer_callback()
    with pytest.raises(autopar.checkpoint.CheckpointError, match=r"Trainer\(model=pm\).*given Linear"):
        callback.on_init_end(_args(), None, None, model=torch.nn.Linear(2, 2))
