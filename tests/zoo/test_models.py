"""Quick single-process checks of the reference models: they run, train, are seeded, and export."""

from __future__ import annotations

import pytest
import torch

from autopar.zoo.models import (
    GPT,
    MODEL_NAMES,
    AttentionBlock,
    MLPBlock,
    build_model,
    example_batch,
)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_forward_backward_gives_finite_scalar_loss_and_all_grads(name):
    model = build_model(name, seed=0)
    loss = model(*example_batch(name, batch_size=8, seed=0))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missing = [fqn for fqn, param in model.named_parameters() if param.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_exports_non_strict(name):
    model = build_model(name, seed=0)
    args = example_batch(name, batch_size=8, seed=0)
    exported = torch.export.export(model, args, strict=False)
    targets = {spec.target for spec in exported.graph_signature.input_specs if spec.target}
    assert {fqn for fqn, _ in model.named_parameters()} <= targets
    torch.testing.assert_close(exported.module()(*args), model(*args))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_init_and_batches_are_deterministic(name):
    first, second = build_model(name, seed=3), build_model(name, seed=3)
    for (fqn, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), fqn
    for a, b in zip(example_batch(name, 8, seed=5), example_batch(name, 8, seed=5)):
        assert torch.equal(a, b)
    state = torch.random.get_rng_state()
    example_batch(name, 8, seed=5)
    assert torch.equal(state, torch.random.get_rng_state()), "example_batch used the global RNG"


def test_gpt_ties_lm_head_to_token_embedding():
    tied, untied = GPT(tied=True), GPT(tied=False)
    assert tied.lm_head.weight is tied.transformer.wte.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert "lm_head.weight" in dict(untied.named_parameters())
    idx, _ = example_batch("gpt", 2, seed=0)
    assert tied(idx).shape == (2, 32, 256)


def test_gpt_fused_and_separate_qkv_compute_the_same_function():
    torch.manual_seed(0)
    separate = GPT(n_layer=1, fused_qkv=False)
    fused = GPT(n_layer=1, fused_qkv=True)
    fused_state = {}
    for fqn, tensor in separate.state_dict().items():
        if ".attn.q_proj." in fqn:
            kind = fqn.rsplit(".", 1)[1]
            prefix = fqn.split(".attn.")[0] + ".attn."
            fused_state[prefix + "c_attn." + kind] = torch.cat(
                [separate.state_dict()[prefix + f"{proj}_proj.{kind}"] for proj in "qkv"]
            )
        elif ".attn.k_proj." not in fqn and ".attn.v_proj." not in fqn:
            fused_state[fqn] = tensor
    fused.load_state_dict(fused_state)
    batch = example_batch("gpt", 2, seed=1)
    torch.testing.assert_close(fused(*batch), separate(*batch))


def test_gpt_rejects_sequences_longer_than_block_size():
    with pytest.raises(ValueError, match="exceeds block_size"):
        GPT(block_size=8)(torch.zeros(1, 9, dtype=torch.long))


def test_blocks_keep_shapes_and_unknown_names_are_rejected():
    x = torch.randn(2, 16, 64)
    assert AttentionBlock(64, 8)(x).shape == x.shape
    assert MLPBlock(64, 256)(x).shape == x.shape
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet")
    with pytest.raises(ValueError, match="unknown config"):
        example_batch("mlp", 8, 0, n_embd=3)
