"""``ops.causal_mask``: attention whose mask, seen at run time, is only causal takes the causal
kernel, and gives what the mask gives; any other mask is passed on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.ops import causal_mask
from autopar.ops.causal_mask import attention_causal_when_it_is

SDPA = torch.ops.aten.scaled_dot_product_attention.default
L = 6


@pytest.fixture
def calls(monkeypatch):
    """The (mask passed?, is_causal) of each aten SDPA call."""
    seen: list[tuple[bool, bool]] = []

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        seen.append((attn_mask is not None, is_causal))
        return SDPA(q, k, v, attn_mask, dropout_p, is_causal, **kw)

    class Aten:
        scaled_dot_product_attention = type("Packet", (), {"default": staticmethod(recorded)})

    monkeypatch.setattr(causal_mask, "aten", Aten)
    return seen


def _qkv():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(2, 2, L, 4, dtype=torch.float64, generator=generator) for _ in range(3)]


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)


CAUSAL = torch.ones(L, L, dtype=torch.bool).tril()


@pytest.mark.parametrize(
    "mask, causal",
    [
        (CAUSAL.expand(2, 1, L, L), True),  # Hugging Face's: batch-expanded, one head
        (_additive(CAUSAL)[None, None], True),
        (torch.cat([CAUSAL[None], CAUSAL[None] & (torch.arange(L) > 0)])[:, None], False),  # row 2 pads key 0
        (torch.ones(L, L, dtype=torch.bool).tril(-1) | torch.eye(L, dtype=torch.bool).roll(1, 1), False),
        (torch.ones(L, L, dtype=torch.bool), False),
    ],
    ids=["bool", "additive", "padded", "shifted", "full"],
)
def test_the_causal_kernel_where_the_mask_is_only_causal_and_the_same_numbers(calls, mask, causal):
    q, k, v = _qkv()
    got = attention_causal_when_it_is(q, k, v, mask)
    assert calls == [(not causal, causal)]
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, mask), rtol=0, atol=1e-12)


def test_a_mask_written_in_place_is_checked_again_and_one_with_a_gradient_stays(calls):
    q, k, v = _qkv()
    mask = CAUSAL.clone()
    attention_causal_when_it_is(q, k, v, mask)
    attention_causal_when_it_is(q, k, v, mask)  # every layer reads the same mask: checked once
    mask[3, 0] = False  # padding written into the same tensor
    got = attention_causal_when_it_is(q, k, v, mask)
    assert calls == [(False, True), (False, True), (True, False)]
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, mask), rtol=0, atol=1e-12)
    learned = _additive(CAUSAL).requires_grad_()
    attention_causal_when_it_is(q, k, v, learned)
    assert calls[-1] == (True, False), "a mask that needs a gradient keeps it"
