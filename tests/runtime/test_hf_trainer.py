"""Hugging Face ``Trainer`` takes the compiled module as it takes the model (docs/huggingface.md):
under 2 gloo ranks, with a plan that shards some parameters, it trains (clipping, a scheduler) and
evaluates with the losses of the same Trainer run on one process (batches padded to their own
longest row), keeps the dataset's columns the model's forward names, and accelerate wraps nothing
in DDP. Its own checkpoints (every 2 steps, saved by every rank through
``autopar.checkpoint.trainer_callback()``) resume with Trainer's ``resume_from_checkpoint`` to the
same losses, in a run without the callback that saves nothing; Trainer's label smoothing and a
``compute_loss_func`` (its own loss on the logits of a call without the labels) have the one-process
run's losses; ``Trainer.predict`` gathers the
logits of the one-process run (each rank's own rows, as DDP's model returns them); the weights of the last checkpoint and of ``pm.module.save_pretrained`` load with
``from_pretrained`` and equal the one-process run's."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.runtime import hf_trainer_job as job

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


def _compiled_run(rank: int, world: int, output_dir: str) -> dict:
    from torch.distributed.tensor import Shard

    import autopar

    model = job.tiny_llama()
    result = {}
    pm = autopar.compile(
        model,
        mesh=(world,),
        example_kwargs=job.example_batch(),
        cluster="cpu",
        data=autopar.DataOptions(batch="per_rank"),
        memory_budget=job.SHARDING_BUDGET,  # some parameters sharded: a save must gather them from every rank
    )
    result["sharded"] = sum(isinstance(p.placements[0], Shard) for p in pm.parameters())
    # Every rank saves Trainer's checkpoints (steps 2 and 4) into one output directory.
    callbacks = [autopar.checkpoint.trainer_callback()]
    result.update(job.run(pm, f"{output_dir}/compiled", distributed=True, callbacks=callbacks))
    result["shapes"] = len(pm._by_shape)
    result["data_parallel_size"] = pm.data_parallel_size
    pm.module.save_pretrained(f"{output_dir}/saved")  # every rank gathers; rank 0 writes
    # A new Trainer resumes from step 2: its weights and optimizer state (the module's are step 4's
    # until it loads them), scheduler, RNG and logs; it trains steps 3 and 4 again. It saves
    # nothing, so it needs no callback: the whole optimizer state that Trainer loads is cut to each
    # rank's shards before the first step (runtime.loaded_state).
    resumed = job.run(pm, f"{output_dir}/compiled", distributed=True, resume=f"{output_dir}/compiled/checkpoint-2", save=False)
    result["resumed_losses"], result["resumed_eval_loss"] = resumed["losses"], resumed["eval_loss"]
    result["predictions"] = job.predictions(pm, f"{output_dir}/compiled", distributed=True)
    # Trainer's label smoother, and a compute_loss_func, compute the loss from each rank's rows of the
    # logits (a call without the labels), normalized by the label tokens of every rank, as under DDP.
    # The smoother's run accumulates 2 micro-steps under pm.no_sync(): the planned graph's held
    # gradients are reduced before the graph of the call without labels runs.
    runs = {
        "smoothed": {"label_smoothing": 0.1, "accumulation": 2},
        "own_loss": {"own_loss": True},
        "accumulated": {"accumulation": 2},
    }
    for name, how in runs.items():
        fresh = autopar.compile(
            job.tiny_llama(),
            mesh=(world,),
            example_kwargs=job.example_batch(),
            cluster="cpu",
            data=autopar.DataOptions(batch="per_rank"),
            memory_budget=job.SHARDING_BUDGET,
        )
        result[f"{name}_losses"] = job.run(fresh, f"{output_dir}/{name}", distributed=True, save=False, **how)["losses"]
    return result


@pytest.mark.multiproc
def test_trainer_on_two_ranks_has_the_losses_of_one_process(rank_pool, tmp_path) -> None:
    results = rank_pool(job.WORLD).run(_compiled_run, str(tmp_path), timeout_s=300)
    torch.set_num_threads(1)  # the reference is small; two threads only contend with the ranks
    eager_model = job.tiny_llama()
    eager = job.run(eager_model, str(tmp_path / "eager"), distributed=False)
    assert len(eager["losses"]) == 4
    predictions = job.predictions(eager_model, str(tmp_path / "eager"), distributed=False)
    smoothed = job.run(
        job.tiny_llama(), str(tmp_path / "smoothed"), distributed=False, save=False, label_smoothing=0.1, accumulation=2
    )
    own_loss = job.run(job.tiny_llama(), str(tmp_path / "own_loss"), distributed=False, save=False, own_loss=True)
    accumulated = job.run(job.tiny_llama(), str(tmp_path / "accumulated"), distributed=False, save=False, accumulation=2)
    from transformers import LlamaForCausalLM

    for saved_dir in ("saved", "compiled/checkpoint-4"):
        assert (tmp_path / saved_dir / "model.safetensors").exists()
        saved = LlamaForCausalLM.from_pretrained(tmp_path / saved_dir).state_dict()
        for name, value in eager_model.state_dict().items():  # the parameters after 4 steps
            torch.testing.assert_close(saved[name], value, rtol=1e-9, atol=1e-12, msg=f"{saved_dir}: {name}")
    for result in results:
        assert result["data_parallel_size"] == job.WORLD  # each rank's own rows, as accelerate deals them
        assert result["sharded"] > 0  # so the checkpoints gather shards and the resume cuts them
        assert result["losses"] == pytest.approx(eager["losses"], rel=1e-6)
        assert result["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-6)
        # steps 1 and 2 from the checkpoint's log, 3 and 4 trained again after the resume
        assert result["resumed_losses"] == pytest.approx(eager["losses"], rel=1e-6)
        assert result["resumed_eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-6)
        # each rank's own rows of the logits, gathered by accelerate: the one-process run's, in order
        # (they were the global batch's on every rank: 16 rows of predictions for 12 labels, out of order)
        for got, want in zip(result["predictions"], predictions):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert "input_ids" in result["columns"] and "labels" in result["columns"]
        assert result["shapes"] >= 1  # batches padded to other lengths than the example ran too
        # each rank's tokens' mean, averaged over the ranks, before Trainer counted the tokens of all ranks
        assert result["smoothed_losses"] == pytest.approx(smoothed["losses"], rel=1e-6)
        assert result["own_loss_losses"] == pytest.approx(own_loss["losses"], rel=1e-6)
        # the model's own loss over accumulated micro-batches of unequal token counts: each divided by
        # the whole step's count (Trainer's num_items_in_batch), as in one process
        assert result["accumulated_losses"] == pytest.approx(accumulated["losses"], rel=1e-6)


def test_the_compiled_module_shows_the_model_forward_signature() -> None:
    from autopar.runtime.signature import adopt_signature

    class Model(torch.nn.Module):
        def forward(self, input_ids, labels=None, **kwargs):
            return input_ids

    class Module(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return ("ran", args, kwargs)

    module = Module()
    adopt_signature(module, Model())
    assert list(inspect.signature(module.forward).parameters) == ["input_ids", "labels", "kwargs"]
    assert module(1, labels=2) == ("ran", (1,), {"labels": 2})
    assert isinstance(module, Module) and type(module).__name__ == "Module"


def test_trainer_steps_an_offloading_module_with_autopar_adamw_as_eager(world_of_one, tmp_path) -> None:
    # A plan that offloads parameters, gradients and AdamW state, stepped by the optimizer it
    # needs, which Trainer builds over its own param groups (weight decay 0.1, none on the norms),
    # with Trainer's own scheduler (warmup, linear), clipping (0.5) and zero_grad, then an
    # evaluation; batches padded to their longest row. Before, Trainer failed making the
    # scheduler (autopar.optim.AdamW had no param_groups), its clipping saw the resident
    # gradients alone, and autopar.optim.AdamW took one group: the norms decayed too.
    import copy

    from transformers import Trainer

    import autopar

    model = job.tiny_llama()
    eager = copy.deepcopy(model)
    batch = job.example_batch()
    free = autopar.plan(model, (1,), example_kwargs=batch, cluster="cpu")
    plan = autopar.plan(
        model, (1,), example_kwargs=batch, cluster="cpu", memory_budget=0.4 * free.predicted.peak_memory_bytes, offload="auto"
    )
    assert {entry.kind for entry in plan.memory.offload} == {"param", "grad", "optimizer_state"}
    pm = autopar.compile(model, (1,), example_kwargs=batch, plan=plan, offload=f"disk:{tmp_path / 'store'}")
    runs = {}
    for name, module, optimizer in (("compiled", pm, autopar.optim.AdamW), ("eager", eager, torch.optim.AdamW)):
        args = job.arguments(str(tmp_path / name), distributed=False, save=False)  # weight decay 0.1
        trainer = Trainer(
            model=module,
            args=args,
            train_dataset=job.dataset(32, 1),
            eval_dataset=job.dataset(job.GLOBAL_ROWS, 2),
            data_collator=job.pad_to_longest,
            optimizer_cls_and_kwargs=(optimizer, {"lr": 1e-2}),
        )
        trainer.train()
        groups = trainer.optimizer.param_groups
        assert [group["weight_decay"] for group in groups] == [0.1, 0.0] and all(group["params"] for group in groups)
        runs[name] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        runs[name].append(trainer.evaluate()["eval_loss"])  # in eval mode: a graph of its own
    assert len(runs["eager"]) == 5 and runs["compiled"] == pytest.approx(runs["eager"], rel=1e-10, abs=0)
    want = eager.state_dict()
    for fqn, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, want[fqn], rtol=1e-10, atol=1e-10, msg=fqn)
