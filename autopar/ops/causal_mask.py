"""Attention that takes the causal kernel when its mask, seen at run time, is only causal.

A mask built from the batch (Hugging Face's from ``attention_mask`` or ``position_ids``) cannot be
proved causal when the model is traced (``trace.attention``): one batch may pad, the next not.
Eager decides per call: Hugging Face calls ``scaled_dot_product_attention`` with ``is_causal=True``
and no mask where ``attention_mask`` is all ones (what a ``Trainer`` passes for unpadded batches),
and the kernels take their fast causal path (cuDNN's backward three times faster on an H200).
``attention_causal_when_it_is`` makes the same decision on the mask itself: where it lets each
query attend exactly the keys ``is_causal=True`` would (``trace.attention.is_causal_pattern``,
per rank on its own shard), it attends causally without it; otherwise with it. The two give the
same numbers (a masked entry's weight is zero either way), so the result is the mask's whatever
the decision. A mask that needs a gradient always stays.

Every layer reads the same mask tensor: it is checked once per call of the model (the answer is
kept for the tensor while its version is unchanged). The check reads the mask's own elements (an
expanded batch dim counts once) and, on a GPU, waits for them once, as Hugging Face's own check of
``attention_mask`` does.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

from autopar.trace.attention import allowed_positions, is_causal_pattern

aten = torch.ops.aten

# (a weak reference to the mask last checked, its version, queries, keys, whether it is causal)
_LAST: list = [None, -1, -1, -1, False]


def _is_causal(mask: torch.Tensor, queries: int, keys: int) -> bool:
    ref, version, last_queries, last_keys, causal = _LAST
    if ref is not None and ref() is mask and (version, last_queries, last_keys) == (mask._version, queries, keys):
        return causal
    allowed = allowed_positions(mask)
    try:
        causal = allowed is not None and is_causal_pattern(allowed, queries, keys)
    except RuntimeError:  # a mask that does not broadcast to these scores: SDPA says so itself
        causal = False
    _LAST[:] = [weakref.ref(mask), mask._version, queries, keys, causal]
    return causal


def _has_values(mask: torch.Tensor) -> bool:
    """Whether the mask's values can be read here: not on the meta device, not a fake tensor,
    not while torch.compile traces (a data-dependent branch there would break its graph)."""
    return not torch.compiler.is_compiling() and mask.device.type != "meta" and not is_fake(mask)


def attention_causal_when_it_is(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``aten.scaled_dot_product_attention``, with ``is_causal=True`` and no mask where
    ``attn_mask`` is exactly the causal mask of this call's query and key positions (module
    docstring)."""
    if attn_mask is not None and not is_causal and not attn_mask.requires_grad and _has_values(attn_mask):
        if _is_causal(attn_mask, query.shape[-2], key.shape[-2]):
            attn_mask, is_causal = None, True
    return aten.scaled_dot_product_attention.default(
        query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


__all__ = ["attention_causal_when_it_is"]
