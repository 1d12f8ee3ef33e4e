"""The solver chooses context parallelism for causal attention when, and only when, it pays.

Offline planning on meta tensors (no process group): a causal GPT (``is_causal=True``) at
1 x 131,072 tokens on mesh (8, 8) of H100s, with 4 heads, has no other way to use 64 devices
for its attention. The controls keep the same model where something cheaper exists.
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.ir.spec import Shard
from autopar.report.explain import explain_text
from autopar.zoo.models import GPT

SDPA = "aten.scaled_dot_product_attention.default"


def _plan(seq: int, batch: int, mesh: tuple[int, ...]) -> autopar.Plan:
    with torch.device("meta"):
        model = GPT(vocab_size=512, block_size=seq, n_layer=2, n_head=4, n_embd=256)
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return autopar.plan(model, mesh=mesh, example_inputs=(idx, idx), cluster="h100-80g")


def _attention(plan: autopar.Plan) -> dict:
    nodes = {name: node for name, node in plan.nodes.items() if node.op == SDPA}
    assert len(nodes) == 2
    return nodes


def test_long_causal_gpt_splits_attention_by_sequence():
    plan = _plan(131072, 1, (8, 8))
    for name, node in _attention(plan).items():
        assert node.kernel == "sdpa_context_parallel", f"{name}: {node.outs} {node.kernel}"
        assert any(p == Shard(2) for p in node.outs[0]), f"{name}: output not split by sequence: {node.outs}"
        assert node.ins[0] == node.ins[1] == node.ins[2] == node.outs[0], "q, k, v and out share the split"
    summary = plan.summary()
    assert "context parallel over axes" in summary and "most loaded rank" in summary
    text = explain_text(plan, "scaled_dot_product_attention")
    assert "kernel sdpa_context_parallel" in text and "kernel comm" in text


@pytest.mark.parametrize(
    "seq,batch,mesh,why",
    [
        (2048, 64, (8, 8), "the batch splits 64 ways"),
        (131072, 1, (4,), "4 heads on 4 devices: the head split needs no K/V traffic"),
        (512, 1, (8, 8), "a short sequence: the gathers' latency outweighs the attention"),
    ],
)
def test_context_parallel_only_where_it_pays(seq, batch, mesh, why):
    for name, node in _attention(_plan(seq, batch, mesh)).items():
        assert node.kernel is None, f"{name} ({why}): {node.outs} {node.kernel}"
