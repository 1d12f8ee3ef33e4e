"""The model's own ``torch.utils.checkpoint`` calls (``autopar.trace.checkpoints``): traced as
plain forward code, and planned as a checkpoint policy for every layer."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, checkpoint_sequential, create_selective_checkpoint_contexts

import autopar
from autopar.errors import TraceError
from autopar.trace import trace, trace_repeated


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x):  # the norm and the activation: what a selective policy recomputes
        return x + self.down(F.gelu(self.norm(self.up(x))))


def _keep_matmuls(ctx, op, *args, **kwargs):
    return (
        CheckpointPolicy.MUST_SAVE
        if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


class Net(nn.Module):
    """Three blocks, each run through ``how``: None (plainly), "non_reentrant", "selective" (a
    ``context_fn``), "reentrant" (its input needs grad: the embedding's output), "reentrant_no_grad"
    (the raw input: eager gives the blocks no gradient), "sequential" (``checkpoint_sequential``,
    whose functions are closures), "every_other" (blocks 0 and 2 only, as Hugging Face's
    ``every_n_layers=2``) or "inner" (each block's ``down`` projection only)."""

    def __init__(self, how: str | None):
        super().__init__()
        self.embed = nn.Embedding(10, 16)
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(16, 10)
        self.how = how

    def forward(self, ids, y):
        x = self.embed(ids)
        if self.how == "reentrant_no_grad":
            x = x.detach()
        if self.how == "sequential":
            x = checkpoint_sequential(self.blocks, 3, x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = self._run(block, x)
        return F.cross_entropy(self.head(x), y)

    def _run(self, block, x):
        if self.how is None or (self.how == "every_other" and block is self.blocks[1]):
            return block(x)
        if self.how == "inner":
            return x + checkpoint(block.down, F.gelu(block.norm(block.up(x))), use_reentrant=False)
        if self.how == "selective":
            context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
            return checkpoint(block, x, use_reentrant=False, context_fn=context)
        return checkpoint(block, x, use_reentrant=self.how.startswith("reentrant"))


def _batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 10, (8,), generator=generator), torch.randint(0, 10, (8,), generator=generator)


def _ops(traced) -> list[str]:
    return [str(node.target) for node in traced.gm.graph.nodes if node.op == "call_function"]


BLOCKS = ("blocks.0", "blocks.1", "blocks.2")


@pytest.mark.parametrize(
    "how,policy,calls,modules",
    [
        ("non_reentrant", "full", 3, BLOCKS),
        ("reentrant", "full", 3, BLOCKS),
        ("selective", "selective", 3, BLOCKS),
        ("sequential", "full", 2, ()),  # closures: every layer
        ("every_other", "full", 2, ("blocks.0", "blocks.2")),
        ("inner", "full", 3, ("blocks.0.down", "blocks.1.down", "blocks.2.down")),
    ],
)
def test_a_checkpointed_forward_traces_as_the_plain_one_and_asks_for_its_policy(how, policy, calls, modules):
    plain = trace(Net(None), _batch())
    traced = trace(Net(how), _batch())
    assert _ops(traced) == _ops(plain)  # no recompute ops, no no-grad cut, no opaque Function
    assert plain.checkpointing is None and not plain.notes
    assert (traced.checkpointing, traced.checkpointed) == (policy, modules)
    where = f"the layers of {', '.join(modules)}" if modules else "every layer"
    assert traced.notes == (
        f"the model checkpoints activations itself ({calls} torch.utils.checkpoint calls while tracing): traced as "
        f"plain forward code, and planned as checkpointing={policy!r} for {where} where checkpointing= "
        "is not given (None) and no pipeline is",
    )
    assert torch_checkpoint.CheckpointFunction.__module__ == "torch.utils.checkpoint"  # torch's own, restored


def test_a_reentrant_checkpoint_whose_inputs_need_no_grad_is_refused_with_the_fix():
    model = Net("reentrant_no_grad")
    with pytest.raises(
        TraceError, match=r"use_reentrant=True\) of Block takes no tensor that requires grad.*use_reentrant=False"
    ):
        trace(model, _batch())


def test_the_plan_recomputes_each_layer_the_model_checkpoints_unless_told_otherwise():
    model = Net("non_reentrant")
    plan = autopar.plan(model, (1,), example_inputs=_batch(), cluster="cpu")
    assert [(s.name, s.policy) for s in plan.memory.checkpoint] == [(f"blocks.{i}", "full") for i in range(3)]
    assert any("checkpoints activations itself" in note for note in plan.notes)
    for how, policy in (("non_reentrant", "full"), ("selective", "selective")):  # as that checkpointing= plans
        asked = autopar.plan(Net(how), (1,), example_inputs=_batch(), cluster="cpu")
        told = autopar.plan(Net(None), (1,), example_inputs=_batch(), cluster="cpu", checkpointing=policy)
        assert asked.memory == told.memory and asked.nodes == told.nodes, how
        assert {segment.policy for segment in asked.memory.checkpoint} == {policy}
    for how, layers in (("every_other", ["blocks.0", "blocks.2"]), ("inner", list(BLOCKS)), ("sequential", list(BLOCKS))):
        asked = autopar.plan(Net(how), (1,), example_inputs=_batch(), cluster="cpu")
        assert [s.name for s in asked.memory.checkpoint] == layers, how
    everywhere = autopar.plan(Net("every_other"), (1,), example_inputs=_batch(), cluster="cpu", checkpointing="full")
    assert [s.name for s in everywhere.memory.checkpoint] == list(BLOCKS)  # the user's policy: every layer
    off = autopar.plan(model, (1,), example_inputs=_batch(), cluster="cpu", checkpointing=False)
    assert off.memory is None or not off.memory.checkpoint
    assert autopar.plan(Net(None), (1,), example_inputs=_batch(), cluster="cpu").memory is None


def test_a_deep_model_built_from_a_few_layers_checkpoints_what_they_show():
    from autopar.trace.repeat import _deepened

    few = ("head", "layers.0", "layers.1", "layers.2")
    assert _deepened(few, "layers", 3, 5) == ("head", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4")
    inner = ("layers.0.mlp", "layers.1.mlp")
    assert _deepened(inner, "layers", 2, 3) == ("layers.0.mlp", "layers.1.mlp", "layers.2.mlp")
    assert _deepened(("layers.0", "layers.2"), "layers", 3, 8) == ()  # by index: unknown past the few, every layer
    assert _deepened((), "layers", 3, 8) == ()


def test_a_deep_hf_model_with_checkpointing_plans_every_layer_it_checkpoints():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=6, num_attention_heads=2, use_cache=False
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 32, (2, 8))
    kwargs = {"input_ids": ids, "labels": ids}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    traced = trace_repeated(model, (), kwargs)  # built from a few layers' export
    assert traced.checkpointed == tuple(f"model.layers.{i}" for i in range(6))
    plan = autopar.plan(model, (1,), example_kwargs=kwargs, cluster="cpu")
    assert [s.name for s in plan.memory.checkpoint] == [f"model.layers.{i}" for i in range(6)]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=2)
    traced = trace_repeated(model, (), kwargs)  # three layers differ from two: traced whole
    assert traced.checkpointed == ("model.layers.0", "model.layers.2", "model.layers.4")
