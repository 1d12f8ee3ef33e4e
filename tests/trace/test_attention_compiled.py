"""Hugging Face LLaMA, Mistral and Qwen2 compiled on mesh (1,) call SDPA as eager does.

Every SDPA call of eager and of the compiled forward is recorded (a ``TorchFunctionMode`` sees both
``F.scaled_dot_product_attention`` and the graph's ``aten`` call) while both train a few AdamW
steps in float64: where eager passes no mask the compiled module must pass none
(``trace.attention``), a padding mask or a sliding window must stay a mask, and losses,
gradients and parameters must equal eager's. (Separate from ``test_attention.py``, whose numerics
guard runs outside the process group these tests hold.)
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import autopar

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _SdpaCalls(TorchFunctionMode):
    """Whether each SDPA call passes a mask, in call order (eager's ``F`` call or the graph's op)."""

    def __init__(self):
        super().__init__()
        self.masks: list[bool] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention or func is SDPA:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.masks.append(mask is not None)
        return func(*args, **kwargs)


def _padding(kwargs: dict) -> dict:
    mask = torch.ones_like(kwargs["input_ids"])
    mask[0, :5] = 0  # left padding in the first row
    return {**kwargs, "attention_mask": mask}


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1]).expand_as(ids)


def _hf_case(name: str):
    from tests.zoo import hf_models

    builders = {
        "llama": lambda: hf_models.llama(batch_size=2),
        "mistral": lambda: hf_models.mistral(batch_size=2),
        "qwen2": lambda: hf_models.qwen2(batch_size=2),
        "llama-padding": lambda: (lambda m, kw: (m, _padding(kw)))(*hf_models.llama(batch_size=2)),
        "mistral-sliding-window": lambda: hf_models.mistral(batch_size=2, sliding_window=4),
        # masks built from the batch, which eager skips where the batch pads nothing: the compiled
        # module attends causally where the mask is causal at run time (``ops.causal_mask``)
        "llama-all-ones": lambda: (lambda m, kw: (m, {**kw, "attention_mask": torch.ones_like(kw["input_ids"])}))(
            *hf_models.llama(batch_size=2)
        ),
        "llama-position-ids": lambda: (lambda m, kw: (m, {**kw, "position_ids": _positions(kw["input_ids"])}))(
            *hf_models.llama(batch_size=2)
        ),
        "bert": lambda: hf_models.bert(batch_size=2),  # an encoder: its all-true mask is dropped
    }
    return builders[name]()


STEPS = 3
TOL = 1e-10  # float64


@pytest.mark.parametrize(
    "name,eager_masked",
    [
        ("llama", False),
        ("mistral", False),
        ("qwen2", False),
        ("bert", False),
        ("llama-padding", True),
        ("llama-all-ones", False),
        ("llama-position-ids", False),
        ("mistral-sliding-window", True),
    ],
)
def test_hf_attention_passes_the_mask_eager_passes_and_trains_as_eager(world_of_one, name, eager_masked):
    model, kwargs = _hf_case(name)
    model = model.double()
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, (1,), example_kwargs=kwargs, cluster="cpu")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, eager)]
    for step in range(STEPS):
        with _SdpaCalls() as compiled_calls:
            loss = pm(**kwargs).loss
        with _SdpaCalls() as eager_calls:
            want = eager(**kwargs).loss
        assert eager_calls.masks == [eager_masked] * 2, eager_calls.masks
        assert compiled_calls.masks == eager_calls.masks, f"{name}: compiled {compiled_calls.masks}, eager {eager_calls.masks}"
        torch.testing.assert_close(loss, want, rtol=TOL, atol=TOL, msg=f"{name}: loss at step {step}")
        loss.backward()
        want.backward()
        grads = dict(eager.named_parameters(remove_duplicate=False))  # tied names too
        for fqn, grad in pm.full_grads().items():
            torch.testing.assert_close(grad, grads[fqn].grad, rtol=TOL, atol=TOL, msg=f"{name}: {fqn}.grad at step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for fqn, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, eager.state_dict()[fqn], rtol=TOL, atol=TOL, msg=f"{name}: {fqn} after {STEPS} steps")


def test_a_batch_mask_attends_causally_only_in_the_calls_that_pad_nothing(world_of_one):
    # compiled with an all-ones attention_mask, then called with padded and unpadded batches in
    # turn: each call masks where eager does, and trains as eager
    model, kwargs = hf_models_llama()
    model = model.double()
    eager = copy.deepcopy(model)
    unpadded = {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    pm = autopar.compile(model, (1,), example_kwargs=unpadded, cluster="cpu")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, eager)]
    for step, batch in enumerate([unpadded, _padding(kwargs), unpadded, _padding(kwargs)]):
        with _SdpaCalls() as compiled_calls:
            loss = pm(**batch).loss
        with _SdpaCalls() as eager_calls:
            want = eager(**batch).loss
        assert eager_calls.masks == [step % 2 == 1] * 2, eager_calls.masks
        assert compiled_calls.masks == eager_calls.masks, (
            f"step {step}: compiled {compiled_calls.masks}, eager {eager_calls.masks}"
        )
        torch.testing.assert_close(loss, want, rtol=TOL, atol=TOL, msg=f"loss at step {step}")
        loss.backward()
        want.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    for fqn, value in pm.full_state_dict().items():
        torch.testing.assert_close(value, eager.state_dict()[fqn], rtol=TOL, atol=TOL, msg=f"{fqn} after 4 steps")


def hf_models_llama():
    from tests.zoo import hf_models

    return hf_models.llama(batch_size=2)
