"""A deep model's graph built from a two-layer export (``trace.repeat``) is the full export's:
same nodes, names, arguments, shapes, inputs and metadata, so plans made on it apply to the
real model; a model whose layers are not one layer repeated is traced whole."""

from __future__ import annotations

import logging

import pytest
import torch

import autopar
from autopar.ir.options import precision_policy
from autopar.passes import check_plan_matches
from autopar.trace import trace, trace_repeated
from autopar.trace.repeat import difference, layer_list
from autopar.zoo.models import build_model, example_batch


def _same_as_export(model, args=(), kwargs=None, precision=None, caplog=None):
    with caplog.at_level(logging.INFO, logger="autopar"):
        built = trace_repeated(model, args, kwargs, precision)
    assert "from a 2-layer export" in caplog.text, caplog.text
    real = trace(model, args, kwargs, precision)
    assert built.graph_hash == real.graph_hash
    assert [n.name for n in built.gm.graph.nodes] == [n.name for n in real.gm.graph.nodes]
    assert difference(built, real) is None
    return built, real


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_zoo_decoders_build_the_exported_graph(name, caplog):
    model = build_model(name, n_layer=6)
    assert layer_list(model) == (("transformer.h" if name == "gpt" else "model.layers"), 6)
    built, _ = _same_as_export(model, example_batch(name, 4, n_layer=6), caplog=caplog)
    fqns = {i.fqn for i in built.placeholders("param")}
    assert {n for n, _ in model.named_parameters()} <= fqns


def test_hf_llama_builds_the_exported_graph_also_under_mixed_precision(caplog):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        use_cache=False,
        attn_implementation="sdpa",
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16))
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    _same_as_export(model, (), kwargs, caplog=caplog)
    caplog.clear()
    built, _ = _same_as_export(model, (), kwargs, precision_policy("bf16-mixed"), caplog=caplog)
    casts = [n for n in built.gm.graph.nodes if n.meta.get("autopar", {}).get("cast_of")]
    assert casts[-1].meta["autopar"]["cast_of"].startswith(("model.layers.5.", "model.norm", "lm_head"))


def test_plan_made_on_the_built_graph_matches_the_real_trace():
    """``compile`` traces the real model and refuses a plan made for another graph."""
    model = build_model("gpt", n_layer=6)
    batch = example_batch("gpt", 4, n_layer=6)
    plan = autopar.plan(model, (2,), example_inputs=batch, cluster="cpu")
    check_plan_matches(plan, trace(model, batch), (2,))
    assert any(name.startswith("p_transformer_h_5_") for name in plan.nodes)


class _Scaled(torch.nn.Module):
    """Identical layers, but forward scales layer i's output by i + 1: the same modules do
    different things at different depths, which only the traces show."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(6))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) * (i + 1)
        return x.sum()


class _Different(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8 if i < 5 else 4) for i in range(6))

    def forward(self, x):
        for layer in self.layers[:5]:
            x = layer(x)
        return self.layers[5](x).sum()


def test_layers_that_differ_are_traced_whole(caplog):
    x = torch.randn(2, 8)
    assert layer_list(_Different()) is None
    model = _Scaled()
    assert layer_list(model) == ("layers", 6)
    with caplog.at_level(logging.DEBUG, logger="autopar"):
        built = trace_repeated(model, (x,))
    assert "tracing all 6 layers of layers" in caplog.text
    assert built.graph_hash == trace(model, (x,)).graph_hash
