"""Hugging Face Trainer's own save of a compiled module (rank 0 alone reads ``pm.state_dict()``)
is refused at once with the fix, the callback; other callers of ``pm.state_dict()`` get its DTensors."""

from __future__ import annotations

import pytest

import autopar
from autopar.errors import CheckpointError
from tests.runtime import hf_trainer_job as job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def test_trainers_own_save_names_the_callback_and_save_pretrained(world_of_one, tmp_path):
    from transformers import Trainer

    pm = autopar.compile(job.tiny_llama(), (1,), example_kwargs=job.example_batch(), cluster="cpu")
    assert len(pm.state_dict()) == len(pm.module.state_dict())  # a caller other than Trainer
    trainer = Trainer(model=pm, args=job.arguments(str(tmp_path), distributed=False))
    with pytest.raises(CheckpointError) as info:
        trainer.save_model(str(tmp_path / "final"))
    message = str(info.value)
    assert message.startswith("Hugging Face Trainer saves the model from rank 0 alone")
    assert "callbacks=[autopar.checkpoint.trainer_callback()]" in message
    assert "pm.module.save_pretrained(output_dir) on every rank" in message
    assert not (tmp_path / "final" / "model.safetensors").exists()
