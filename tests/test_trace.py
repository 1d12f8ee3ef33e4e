"""Tracing: ATen graph, FQNs, tied weights, composite ops kept whole, stable hashes."""

from __future__ import annotations

import pytest
import torch

from autopar.errors import TraceError
from autopar.models import build_model, example_batch
from autopar.trace import trace


def test_gpt_trace_keeps_composites_and_maps_fqns():
    model = build_model("gpt", seed=0)
    traced = trace(model, example_batch("gpt", 4))
    targets = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    for op in ("linear", "layer_norm", "scaled_dot_product_attention", "embedding", "cross_entropy_loss"):
        assert f"aten.{op}.default" in targets, f"{op} was decomposed"
    params = {i.fqn for i in traced.placeholders("param")}
    assert set(dict(model.named_parameters()).keys()) <= params
    assert traced.ties["lm_head.weight"] == "transformer.wte.weight"
    assert all("val" in n.meta for n in traced.gm.graph.nodes if n.op != "output")


def test_graph_hash_is_stable_and_shape_sensitive():
    model = build_model("mlp", seed=0)
    first = trace(model, example_batch("mlp", 8)).graph_hash
    assert trace(model, example_batch("mlp", 8, seed=5)).graph_hash == first
    assert trace(model, example_batch("mlp", 16)).graph_hash != first


def test_data_dependent_control_flow_names_the_line():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(TraceError, match="test_trace.py") as info:
        trace(Branchy(), (torch.randn(4),))
    assert "torch.where" in str(info.value)
