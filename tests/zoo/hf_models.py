"""Tiny Hugging Face models built from configs, shared by the tests that compile them.

Sizes are small and divisible by 4, so that every width can be sharded on a (2, 2) mesh. Each
builder returns ``(model, example_kwargs)``: the model in float32 with ``use_cache=False`` (GPT-2
and LLaMA take ``use_cache=True``, the configs' default, as an override), and
keyword inputs that include ``labels``, so that ``model(**kwargs).loss`` is the training loss.
Input ids and labels are distinct tensors (export would merge two arguments that are the same
tensor into one graph input).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 128
SEQ = 16
# Token ids 0..3 are the special tokens; the configs' defaults point outside the tiny vocab.
SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}


def _ids(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch_size, SEQ), generator=generator)
    labels = torch.randint(4, VOCAB, (batch_size, SEQ), generator=generator)
    return ids, labels


def _seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build().float().train()


def gpt2(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """GPT2LMHeadModel: fused c_attn (Conv1D = addmm), tied LM head, dropout off (its masks are
    drawn per rank)."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
        **SPECIAL,
        **{"use_cache": False, **overrides},
    )
    model = _seeded(lambda: transformers.GPT2LMHeadModel(config), seed)
    ids, labels = _ids(batch_size, seed + 1)
    return model, {"input_ids": ids, "labels": labels}


def llama(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """LlamaForCausalLM: RMSNorm, RoPE, grouped-query attention (4 query, 2 kv heads), SwiGLU."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
        **SPECIAL,
        **{"use_cache": False, **overrides},
    )
    model = _seeded(lambda: transformers.LlamaForCausalLM(config), seed)
    ids, labels = _ids(batch_size, seed + 1)
    return model, {"input_ids": ids, "labels": labels}


BUILDERS: dict[str, Callable[..., tuple[torch.nn.Module, dict]]] = {"gpt2": gpt2, "llama": llama}


def bert(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """BertForMaskedLM: an encoder with a masked-LM head (tied to the word embeddings)."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
        pad_token_id=SPECIAL["pad_token_id"],
        **overrides,
    )
    model = _seeded(lambda: transformers.BertForMaskedLM(config), seed)
    ids, labels = _ids(batch_size, seed + 1)
    labels = labels.masked_fill(torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed)) < 0.85, -100)
    return model, {"input_ids": ids, "labels": labels}


def vit(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """ViTForImageClassification: a conv patch embedding, a class token, an encoder, a head."""
    config = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=8,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
        **overrides,
    )
    model = _seeded(lambda: transformers.ViTForImageClassification(config), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    pixels = torch.randn(batch_size, 3, 16, 16, generator=generator)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 8, (batch_size,), generator=generator)}


def mixtral(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """MixtralForCausalLM: 4 experts, top-2 routing (topk, sort, histc, index_put: data-dependent
    indexing), on LLaMA's attention."""
    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        use_cache=False,
        attn_implementation="sdpa",
        **SPECIAL,
        **overrides,
    )
    model = _seeded(lambda: transformers.MixtralForCausalLM(config), seed)
    ids, labels = _ids(batch_size, seed + 1)
    return model, {"input_ids": ids, "labels": labels}


COVERAGE: dict[str, Callable[..., tuple[torch.nn.Module, dict]]] = {"bert": bert, "vit": vit, "mixtral": mixtral}


def mistral(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """MistralForCausalLM: LLaMA's layout with grouped-query attention (4 query, 2 kv heads)."""
    return _gqa_decoder(transformers.MistralConfig, transformers.MistralForCausalLM, batch_size, seed, overrides)


def _gqa_decoder(config_class, model_class, batch_size: int, seed: int, overrides: dict) -> tuple[torch.nn.Module, dict]:
    """A two-layer decoder of LLaMA's layout with 4 query and 2 key-value heads, and its batch."""
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
        attn_implementation="sdpa",
        **SPECIAL,
        **overrides,
    )
    model = _seeded(lambda: model_class(config), seed)
    ids, labels = _ids(batch_size, seed + 1)
    return model, {"input_ids": ids, "labels": labels}


class LossOnly(torch.nn.Module):
    """A Hugging Face model that returns its loss alone, as a pipelined model must."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def loss_only(model: torch.nn.Module) -> torch.nn.Module:
    return LossOnly(model)


def qwen2(batch_size: int = 8, seed: int = 0, **overrides: Any) -> tuple[torch.nn.Module, dict]:
    """Qwen2ForCausalLM: LLaMA's layout with biased q/k/v projections and grouped-query attention."""
    return _gqa_decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, batch_size, seed, overrides)
