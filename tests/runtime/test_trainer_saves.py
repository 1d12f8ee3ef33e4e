"""Hugging Face Trainer's own save of a compiled module (rank 0 alone reads ``pm.state_dict()``)
is refused at once with the fix, the callback; other callers of ``pm.state_dict()`` get its
DTensors. A Trainer that will save checkpoints without the callback is refused at its first step."""

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


def test_a_trainer_that_would_save_without_the_callback_stops_at_its_first_step(world_of_one, tmp_path):
    from transformers import Trainer, TrainerCallback

    class Steps(TrainerCallback):
        taken = 0

        def on_step_end(self, args, state, control, **kwargs):
            Steps.taken += 1

    pm = autopar.compile(job.tiny_llama(), (1,), example_kwargs=job.example_batch(), cluster="cpu")
    trainer = Trainer(
        model=pm,
        args=job.arguments(str(tmp_path), distributed=False),  # save_strategy="steps"
        train_dataset=job.dataset(8, 1),
        data_collator=job.pad_to_longest,
        callbacks=[Steps()],
    )
    with pytest.raises(CheckpointError) as info:
        trainer.train()
    message = str(info.value)
    assert "saves checkpoints (save_strategy='steps') from rank 0 alone" in message
    assert "refused at the first step" in message and "callbacks=[autopar.checkpoint.trainer_callback()]" in message
    assert Steps.taken == 0
    quiet = Trainer(
        model=pm,
        args=job.arguments(str(tmp_path), distributed=False, save=False),  # saves nothing: trains
        train_dataset=job.dataset(8, 1),
        data_collator=job.pad_to_longest,
        callbacks=[Steps()],
    )
    quiet.train()
    assert Steps.taken == 4
