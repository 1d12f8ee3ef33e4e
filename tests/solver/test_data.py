"""Per-rank data in the plan (``autopar.solver.planners.data``)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.ir.spec import transition_steps
from autopar.solver.planners.data import with_data_layout
from autopar.trace import trace
from tests.conftest import gpt_and_batch


def test_per_rank_plans_split_the_batched_inputs_on_the_batch_axes_and_agree_with_whole_ones(gpt_plan_2x2) -> None:
    model, batch = gpt_and_batch()
    per_rank = autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu", data=autopar.DataOptions(batch="per_rank"))
    whole = gpt_plan_2x2
    assert per_rank.data.batch == "per_rank" and per_rank.data.axes == whole.data.axes
    assert per_rank.data.axes, "the GPT's plan splits its batch"
    spec = tuple(Shard(0) if axis in per_rank.data.axes else Replicate() for axis in range(2))
    for name in ("idx", "targets"):
        assert per_rank.nodes[name].outs == (spec,)
        assert whole.nodes[name].outs == ((Replicate(), Replicate()),)
    # Every other decision is the whole-batch plan's; each consumer's transition from the
    # per-rank placeholder exists (insert_collectives carries it out).
    for name, node in per_rank.nodes.items():
        if name not in ("idx", "targets"):
            assert node == whole.nodes[name], name
        for (producer, _), dst in zip(node.inputs, node.ins):
            if producer in ("idx", "targets"):
                assert transition_steps(spec, dst) is not None, (name, dst)


def test_an_unsplit_batch_leaves_the_plan_as_it_is_and_has_data_parallel_size_one(gpt_plan_2x2) -> None:
    """A plan that splits the batch on no axis: every rank passes the whole batch in either mode."""
    model, batch = gpt_and_batch()
    traced = trace(model, batch)
    made = with_data_layout(gpt_plan_2x2, traced, autopar.DataOptions(batch="per_rank"), axes=())
    assert made.data.size == 1 and made.data.rank((1, 1)) == 0
    assert made.nodes == gpt_plan_2x2.nodes


def _lm_plan(batch: str) -> autopar.Plan:
    """A Hugging Face Llama (large vocabulary, so its logits outweigh its weights) on 8 H100s."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        max_position_embeddings=512,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.zeros(8, 512, dtype=torch.long, device="meta")
    examples = {"input_ids": ids, "labels": ids}
    return autopar.plan(model, (8,), example_kwargs=examples, cluster="h100-80g", data=autopar.DataOptions(batch=batch))


def test_per_rank_logits_leave_as_each_ranks_rows_and_are_priced_so() -> None:
    """Under batch="per_rank" a batched output comes back as the rank's own rows (DDP's contract),
    and the solve prices it so: the logits of a split batch are not gathered. Priced as gathered
    (every output whole, as under batch="whole"), the plan kept the batch whole on every rank."""
    pytest.importorskip("transformers")
    whole, per_rank = _lm_plan("whole"), _lm_plan("per_rank")
    output = next(node for node in per_rank.nodes.values() if node.source == "output")
    loss, logits = output.ins
    assert per_rank.data.axes == (0,) and per_rank.data.size == 8
    assert loss == (Replicate(),) and logits == (Shard(0),)  # the loss whole, the logits each rank's rows
    assert all(spec == (Replicate(),) for spec in next(n for n in whole.nodes.values() if n.source == "output").ins)
    assert per_rank.predicted.step_time_s < 0.8 * whole.predicted.step_time_s
