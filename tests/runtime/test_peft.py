"""LoRA fine-tuning (``peft.get_peft_model``): the frozen base weights and the adapters, compiled
on 2 gloo ranks under a plan that shards the base weights, train as the same model does in one
process: the adapters alone move, to eager's values."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.runtime.hf_trainer_job import SEQ, VOCAB, tiny_llama

pytest.importorskip("peft")
pytest.importorskip("transformers")

STEPS = 3  # float64 weights


def _lora():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = get_peft_model(tiny_llama(), config).double()  # peft keeps its adapters in float32: cast after
    with torch.no_grad():  # B starts at zero, where A gets no gradient
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
    return model


def _train(model, batches) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _run(rank: int, world: int) -> dict:
    import autopar

    generator = torch.Generator().manual_seed(2)
    batches = [torch.randint(3, VOCAB, (4, SEQ), generator=generator) for _ in range(STEPS)]
    model, eager = _lora(), _lora()
    before = copy.deepcopy(eager.state_dict())
    example = {"input_ids": batches[0], "labels": batches[0]}
    plan = autopar.hand_plan("fsdp", model, (world,), example_kwargs=example, cluster="cpu")
    pm = autopar.compile(model, (world,), example_kwargs=example, plan=plan)
    losses = (_train(pm, batches), _train(eager, batches))
    full = pm.full_state_dict()
    return {
        "losses": losses,
        "diff": max(float((full[name] - value).abs().max()) for name, value in eager.state_dict().items()),
        "keys": sorted(full) == sorted(eager.state_dict()),
        "moved": sorted(name for name, value in full.items() if not torch.equal(value, before[name])),
        "sharded": sum(any(p.is_shard() for p in spec) for spec in plan.params.values()),
        "trainable": sum(p.numel() for p in pm.parameters() if p.requires_grad),
        "eager_trainable": sum(p.numel() for p in eager.parameters() if p.requires_grad),
    }


@pytest.mark.multiproc
def test_lora_adapters_train_as_eager_over_sharded_frozen_weights(rank_pool) -> None:
    for result in rank_pool(2).run(_run, timeout_s=300):
        got, want = result["losses"]
        # Hugging Face's loss casts the logits to float32: agreement to float32's precision
        assert got == pytest.approx(want, rel=1e-6)
        assert result["diff"] < 1e-6 and result["keys"]
        assert result["moved"] and all("lora_" in name for name in result["moved"]), result["moved"]
        assert result["sharded"] > 0
        assert result["trainable"] == result["eager_trainable"] > 0
