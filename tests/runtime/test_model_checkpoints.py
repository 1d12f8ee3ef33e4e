"""A model that checkpoints its own activations (Hugging Face's ``gradient_checkpointing_enable()``)
compiled by autopar: the plan recomputes its layers and trains as eager does, and the switch on
the compiled module holds or names the fix (``runtime.model_view``)."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.errors import ConfigError

STEPS = 3
TOL = 1e-10  # float64


def test_hf_gradient_checkpointing_is_planned_and_trains_as_eager(world_of_one):
    from tests.zoo import hf_models

    model, kwargs = hf_models.llama(batch_size=2)
    model = model.double()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, (1,), example_kwargs=kwargs, cluster="cpu")
    layers = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert [(s.name, s.policy) for s in pm.plan.memory.checkpoint] == [(name, "full") for name in layers]
    # as Trainer(args=TrainingArguments(activation_checkpointing=True)) calls it: holds
    pm.activation_checkpointing_enable(activation_checkpointing_kwargs=None, every_n_layers=1, offload=False)
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
        with pytest.raises(ConfigError, match=rf"{name}\(\) cannot change a compiled module.*checkpointing=False"):
            getattr(pm, name)()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (pm, eager)]
    for step in range(STEPS):
        loss, want = pm(**kwargs).loss, eager(**kwargs).loss
        torch.testing.assert_close(loss, want, rtol=TOL, atol=TOL, msg=f"loss at step {step}")
        loss.backward()
        want.backward()
        grads = dict(eager.named_parameters(remove_duplicate=False))
        for fqn, grad in pm.full_grads().items():
            torch.testing.assert_close(grad, grads[fqn].grad, rtol=TOL, atol=TOL, msg=f"{fqn}.grad at step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def test_switching_checkpointing_on_after_compile_names_the_fix(world_of_one):
    from tests.zoo import hf_models

    model, kwargs = hf_models.llama(batch_size=2)
    pm = autopar.compile(model, (1,), example_kwargs=kwargs, cluster="cpu")
    assert pm.plan.memory is None or not pm.plan.memory.checkpoint
    pm.gradient_checkpointing_disable()  # nothing recomputed: holds
    for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"):
        with pytest.raises(ConfigError, match=rf"{name}\(\) cannot change.*checkpointing='full'.*before autopar\.compile"):
            getattr(pm, name)()
    plain = autopar.compile(torch.nn.Linear(4, 4), (1,), example_inputs=(torch.randn(2, 4),), cluster="cpu")
    with pytest.raises(AttributeError, match="gradient_checkpointing_enable"):
        plain.gradient_checkpointing_enable()  # not a method of the model: not one of the compiled module
