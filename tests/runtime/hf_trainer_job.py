"""One Trainer run (train, evaluate) of a tiny Llama: eager on one process, or compiled by autopar
on each rank of a process group; used by tests/runtime/test_hf_trainer.py."""

from __future__ import annotations


import torch

VOCAB, SEQ, ROWS_PER_RANK, WORLD = 64, 16, 2, 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def dataset(rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone(), "unused_column": 7} for row in ids]


def arguments(output_dir: str, batch: int, max_steps: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,
        max_steps=max_steps,
        learning_rate=1e-2,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=3,
        data_seed=3,
        prediction_loss_only=True,
        lr_scheduler_type="linear",
        warmup_steps=1,
        dataloader_num_workers=0,
    )


def run(model, output_dir: str, batch: int) -> dict:
    """Train 4 steps with clipping and a scheduler, then evaluate; the logged losses."""
    from transformers import Trainer

    train, held_out = dataset(32, 1), dataset(8, 2)
    trainer = Trainer(model=model, args=arguments(output_dir, batch, 4), train_dataset=train, eval_dataset=held_out)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "eval_loss": trainer.evaluate()["eval_loss"], "columns": trainer._signature_columns}
