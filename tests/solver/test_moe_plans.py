"""Expert parallelism as the solver's choice: a Mixtral-shaped model on 64 H100s.

Hugging Face's Mixtral with Mixtral-8x7B's widths (hidden 4096, SwiGLU 14336, 8 experts, top-2,
32 query and 8 key/value heads, vocabulary 32000), 2 of its 32 layers, built on the meta device
and planned on mesh (8, 8) at ``h100-80g`` for 64 sequences of 4096 tokens. Its expert weights
are 94% of a layer's parameters; replicated they would be 8 experts' worth on every device.
The plan splits every expert weight by expert, runs every experts op as an expert-parallel
kernel, and no experts op falls back to replication.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.ir.summary import EXPERT_PARALLEL_TEXT, node_row
from autopar.report.explain import explain_text
from autopar.rules.moe import EXPERT_PARALLEL_KERNELS
from autopar.zoo.shapes import HF_MIXTRAL_8X7B

transformers = pytest.importorskip("transformers")

MESH = (8, 8)
BATCH, SEQ, NUM_LAYERS = 64, 4096, 2


@pytest.fixture(scope="module")
def mixtral_plan() -> autopar.Plan:
    config = transformers.MixtralConfig(**HF_MIXTRAL_8X7B, num_hidden_layers=NUM_LAYERS, max_position_embeddings=SEQ)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return autopar.plan(model, MESH, example_kwargs={"input_ids": ids, "labels": ids.clone()}, cluster="h100-80g")


def test_mixtral_shape_on_64_h100s_splits_every_expert_weight_by_expert(mixtral_plan) -> None:
    experts = {fqn: spec for fqn, spec in mixtral_plan.params.items() if ".experts." in fqn}
    assert len(experts) == 2 * NUM_LAYERS
    for fqn, spec in experts.items():
        assert Shard(0) in spec, f"{fqn} is not split by expert: {spec}"
    ops = {name: node for name, node in mixtral_plan.nodes.items() if node.op == "autopar.moe_experts.default"}
    assert len(ops) == NUM_LAYERS
    for name, node in ops.items():
        assert node.source == "rule" and node.kernel in EXPERT_PARALLEL_KERNELS, (name, node)
        for axis in node.kernel_axes:  # the kernel runs on the experts as they are stored
            assert node.ins[3][axis] == Shard(0) and node.ins[4][axis] == Shard(0)
    fallbacks = mixtral_plan.solver.fallbacks
    assert not [n for n in fallbacks if "moe" in n or "grouped_mm" in mixtral_plan.nodes[n].op], fallbacks


def test_mixtral_plan_names_expert_parallelism_and_its_cost(mixtral_plan) -> None:
    records = mixtral_plan.predicted.expert_parallel
    assert [r["node"] for r in records] == [n for n, d in mixtral_plan.nodes.items() if d.op == "autopar.moe_experts.default"]
    for record in records:
        assert record["num_experts"] == 8 and record["experts_per_device"] * record["degree"] == 8
        assert 0 <= record["all_to_all_s"] < record["cost_s"]
        if record["kernel"] == "moe_experts_all_to_all":
            # Four exchanges (dispatch and combine, forward and backward) of this device's token
            # copies: 64·4096 tokens over 64 devices, top-2, 4096 bf16 values each, at capacity
            # factor 1.25, of which (k-1)/k leave the device.
            degree = record["degree"]
            copies = BATCH * SEQ // 64 * 2 * 1.25
            sent = 4 * copies * 4096 * 2 * (degree - 1) / degree
            assert record["all_to_all_bytes"] == pytest.approx(sent, rel=0.01)
    summary = mixtral_plan.summary()
    assert "Expert parallelism: 2 experts ops split by expert" in summary
    assert any(text in summary for text in EXPERT_PARALLEL_TEXT.values())
    name = records[0]["node"]
    assert "EXPERT PARALLEL on axes" in node_row(name, mixtral_plan.nodes[name])[5]
    explained = explain_text(mixtral_plan, name)
    assert "expert parallel: experts split by expert on axes" in explained
