"""Published model shapes, built on the meta device."""

from __future__ import annotations

import pytest
import torch

from autopar.zoo.shapes import PRESETS, build_preset


# Published parameter counts (LLaMA: untied head; GPT-2: tied embedding, vocabulary 50257).
@pytest.mark.parametrize(
    "name, billions",
    [
        ("gpt2", 0.124),
        ("gpt2-xl", 1.56),
        ("llama-2-7b", 6.74),
        ("llama-2-70b", 68.98),
        ("llama-3-8b", 8.03),
    ],
)
def test_presets_have_the_published_sizes(name, billions):
    model, inputs = build_preset(name, batch_size=2)
    params = {id(p): p for p in model.parameters()}
    count = sum(p.numel() for p in params.values())
    assert count / 1e9 == pytest.approx(billions, rel=0.01)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in params.values())
    assert all(t.is_meta for t in inputs)
    assert inputs[0].shape == (2, PRESETS[name].seq_len)


def test_overrides_and_errors():
    model, inputs = build_preset("llama-2-70b", batch_size=4, seq_len=32, num_layers=2)
    assert len(model.model.layers) == 2 and inputs[0].shape == (4, 32)
    assert model.model.layers[0].mlp.up_proj.weight.shape == (28672, 8192)
    with pytest.raises(ValueError, match="unknown model preset"):
        build_preset("llama-9-1t", 1)
    with pytest.raises(ValueError, match="at most 1024 tokens"):
        build_preset("gpt2", 1, seq_len=2048)
