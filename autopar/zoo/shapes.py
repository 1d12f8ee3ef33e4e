"""Published model shapes the CLI can plan by name, built on the meta device.

``PRESETS`` maps a name such as ``llama-2-70b`` to a family of ``autopar.zoo.models`` and its
configuration. The models hold no real tensors (meta device), so planning a 70B model takes no
memory; the shapes, dtypes and graph are those of the real model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.errors import ConfigError
from autopar.zoo import models


@dataclass(frozen=True, slots=True)
class ModelPreset:
    family: str  # a name of autopar.zoo.models.MODEL_NAMES
    config: dict[str, Any] = field(default_factory=dict)
    seq_len: int = 1024
    dtype: torch.dtype = torch.bfloat16
    note: str = ""

    def __post_init__(self) -> None:
        if self.family not in ("gpt", "llama", "moe"):
            raise ConfigError(f"presets are gpt, llama or moe shapes, got family {self.family!r}")


def _gpt2(n_layer: int, n_head: int, n_embd: int) -> dict[str, Any]:
    # GPT-2's sizes with separate q/k/v projections (the same parameters and FLOPs as its fused
    # c_attn) and its tied embedding.
    return dict(
        vocab_size=50257, block_size=1024, n_layer=n_layer, n_head=n_head, n_embd=n_embd, tied=True, fused_qkv=False, bias=True
    )


PRESETS: dict[str, ModelPreset] = {
    "gpt2": ModelPreset("gpt", _gpt2(12, 12, 768), seq_len=1024, note="GPT-2 small, 124M"),
    "gpt2-xl": ModelPreset("gpt", _gpt2(48, 25, 1600), seq_len=1024, note="GPT-2 XL, 1.5B"),
    "llama-2-7b": ModelPreset("llama", models.LLAMA_SHAPES["llama-2-7b"], seq_len=4096, note="LLaMA-2 7B"),
    "llama-2-70b": ModelPreset("llama", models.LLAMA_SHAPES["llama-2-70b"], seq_len=4096, note="LLaMA-2 70B"),
    "llama-3-8b": ModelPreset("llama", models.LLAMA_SHAPES["llama-3-8b"], seq_len=8192, note="LLaMA-3 8B"),
    "mixtral-8x7b": ModelPreset(
        "moe", models.MOE_SHAPES["mixtral-8x7b"], seq_len=4096, note="Mixtral 8x7B, 47B (8 experts, top-2)"
    ),
}


# Mixtral-8x7B's published Hugging Face configuration, as keyword arguments of
# ``transformers.MixtralConfig`` (the zoo imports no transformers); the caller adds
# ``num_hidden_layers`` and ``max_position_embeddings``.
HF_MIXTRAL_8X7B: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    use_cache=False,
    attn_implementation="sdpa",
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def build_preset(
    name: str, batch_size: int, seq_len: int | None = None, num_layers: int | None = None
) -> tuple[torch.nn.Module, tuple]:
    """``(model, example_inputs)`` of preset ``name`` on the meta device, in the preset's dtype.

    ``num_layers`` overrides the depth (a 2-layer LLaMA-2-70B has the real widths and plans fast).
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    preset = PRESETS[name]
    config = dict(preset.config)
    if num_layers is not None:
        config["n_layer"] = num_layers
    seq = seq_len or preset.seq_len
    if preset.family == "gpt" and seq > config["block_size"]:
        raise ConfigError(f"{name} takes at most {config['block_size']} tokens, got --seq-len {seq}")
    with torch.device("meta"):
        model = models.build_model(preset.family, **config).to(preset.dtype)
    inputs = tuple(
        torch.empty_like(t, device="meta") for t in models.example_batch(preset.family, batch_size, seq_len=seq, **config)
    )
    return model, inputs


__all__ = ["ModelPreset", "PRESETS", "HF_MIXTRAL_8X7B", "build_preset"]
