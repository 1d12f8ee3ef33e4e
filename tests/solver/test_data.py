"""Per-rank data in the plan (``autopar.solver.planners.data``)."""

from __future__ import annotations

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
