"""One Trainer run (train with checkpoints, evaluate) of a tiny Llama on rows of several lengths, padded per batch
by the collator: eager on one process, or compiled by autopar on each rank of a process group;
used by tests/runtime/test_hf_trainer.py."""

from __future__ import annotations

import torch

VOCAB, SEQ, GLOBAL_ROWS, WORLD, PAD = 64, 16, 4, 2, 2
# Bytes per device: under this the plan shards some parameters (the embedding, some projections)
# and still splits the batch over both ranks (unbounded, it replicates every parameter). The
# model is float64, and so are its AdamW moments (priced so since 4e30bc7; 560 kB was enough when
# they were priced as fp32, and now keeps the batch whole).
SHARDING_BUDGET = 700_000


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
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


def dataset(rows: int, seed: int) -> list[dict]:
    """Rows of 4 to 16 tokens, with a column the model does not take (Trainer drops it)."""
    generator = torch.Generator().manual_seed(seed)
    made = []
    for _ in range(rows):
        length = int(torch.randint(4, SEQ + 1, (), generator=generator))
        ids = torch.randint(3, VOCAB, (length,), generator=generator)
        made.append({"input_ids": ids, "labels": ids.clone(), "unused_column": 7})
    return made


def pad_to_longest(rows: list[dict]) -> dict[str, torch.Tensor]:
    """A batch padded to its own longest row, as DataCollatorWithPadding pads (labels with -100)."""
    longest = max(len(row["input_ids"]) for row in rows)
    batch: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for row in rows:
        pad = longest - len(row["input_ids"])
        batch["input_ids"].append(torch.cat([row["input_ids"], torch.full((pad,), PAD)]))
        batch["attention_mask"].append(
            torch.cat([torch.ones(len(row["input_ids"]), dtype=torch.long), torch.zeros(pad, dtype=torch.long)])
        )
        batch["labels"].append(torch.cat([row["labels"], torch.full((pad,), -100)]))
    return {key: torch.stack(values) for key, values in batch.items()}


def example_batch() -> dict[str, torch.Tensor]:
    """The largest batch a step passes: the planned maximum."""
    ids = torch.randint(3, VOCAB, (GLOBAL_ROWS, SEQ))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def arguments(
    output_dir: str, distributed: bool, max_steps: int = 4, save: bool = True, label_smoothing: float = 0.0, accumulation: int = 1
):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        label_smoothing_factor=label_smoothing,
        gradient_accumulation_steps=accumulation,  # above 1: micro-steps under pm.no_sync(), as under DDP
        per_device_train_batch_size=GLOBAL_ROWS,
        per_device_eval_batch_size=GLOBAL_ROWS,
        # Rank 0 collates each global batch (one padded length) and sends each rank its rows.
        accelerator_config={"split_batches": True, "dispatch_batches": True} if distributed else None,
        max_steps=max_steps,
        learning_rate=1e-2,
        weight_decay=0.1,  # Trainer's groups: none on the norms (they pair modules and parameters by name)
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps" if save else "no",  # Trainer's own checkpoints, every 2 steps
        save_steps=2,
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


def run(
    model,
    output_dir: str,
    distributed: bool,
    resume: str | None = None,
    callbacks=(),
    save: bool = True,
    label_smoothing: float = 0.0,
    own_loss: bool = False,
    accumulation: int = 1,
) -> dict:
    """Train to step 4 with clipping and a scheduler (from step 0, or resumed from the checkpoint
    ``resume``), saving checkpoints every 2 steps where ``save``, then evaluate; the logged losses
    of steps 1 to 4. ``label_smoothing`` (Trainer's label smoother) or ``own_loss`` (a
    ``compute_loss_func``, the causal LM loss): Trainer computes the loss on the logits of a call
    without the labels. ``accumulation``: Trainer's gradient accumulation steps."""
    from transformers import Trainer

    trainer = Trainer(
        model=model,
        args=arguments(output_dir, distributed, save=save, label_smoothing=label_smoothing, accumulation=accumulation),
        train_dataset=dataset(32, 1),
        # One eval batch: over several, accelerate 1.15's split and dispatched loader keeps only a process's share
        # of the last batch's gathered losses (a model-independent weighting, DDP's too).
        eval_dataset=dataset(GLOBAL_ROWS, 2),
        data_collator=pad_to_longest,
        callbacks=list(callbacks),
        compute_loss_func=causal_lm_loss if own_loss else None,
    )
    trainer.train(resume_from_checkpoint=resume)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"losses": losses, "eval_loss": trainer.evaluate()["eval_loss"], "columns": trainer._signature_columns}


def causal_lm_loss(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func``: the model's own loss, from its logits and the labels Trainer kept."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = outputs["logits"]
    return ForCausalLMLoss(logits, labels, vocab_size=logits.shape[-1], num_items_in_batch=num_items_in_batch)


def predictions(model, output_dir: str, distributed: bool):
    """``Trainer.predict``'s logits and labels over three batches, what ``compute_metrics`` is
    given: with ``prediction_loss_only=False`` accelerate gathers each rank's outputs."""
    from transformers import Trainer

    args = arguments(output_dir, distributed, save=False)
    args.prediction_loss_only = False
    predicted = Trainer(model=model, args=args, data_collator=pad_to_longest).predict(dataset(3 * GLOBAL_ROWS, 5))
    logits = predicted.predictions[0] if isinstance(predicted.predictions, tuple) else predicted.predictions
    return torch.from_numpy(logits), torch.from_numpy(predicted.label_ids)
