"""``compile`` without ``cluster=`` splits the batch at least (``solver.planners.split_batch``):
where the local preset prices the whole batch on every rank below data parallelism (a small GPT
on "cpu-gloo"), the plan is solved again with the batch pinned, and says why in one note."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Shard

from autopar.cost.cluster import cpu_cluster
from autopar.cost.comm import collectives_cost
from autopar.ir.options import PlanOptions
from autopar.solver.planners.dispatch import trace_model
from autopar.solver.planners.split_batch import batch_pins, split_batch_at_least
from autopar.solver.planners.traced import plan_traced
from autopar.zoo.models import build_model, example_batch


@pytest.fixture(scope="module")
def traced_gpt():
    return trace_model(build_model("gpt", seed=0), example_batch("gpt", 8, seed=1), None)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_a_plan_that_keeps_the_batch_whole_is_solved_again_with_it_split(traced_gpt, mesh):
    cluster = cpu_cluster(threads_per_rank=1, cores=2)
    options = PlanOptions.from_keywords()
    priced = plan_traced(traced_gpt, mesh, cluster, options)
    assert priced.data_layout.size == 1  # the preset's price: replicate this small model
    (whole,) = [n for n in priced.notes if "whole batch" in n]  # ...and the plan says so
    assert "every rank computes the whole batch" in whole and "cluster=" in whole, whole
    split = split_batch_at_least(priced, traced_gpt, lambda pins: plan_traced(traced_gpt, mesh, cluster, options, pins))
    assert split.data_layout.size == 4 if mesh == (2, 2) else split.data_layout.size == 2
    # the compute is split, not only the input: the embedding's output is cut along the batch
    assert split.nodes["embedding"].outs[0] == tuple(Shard(0) for _ in mesh)
    if mesh == (2,):  # two ranks on two cores: each computes half the batch
        # (the split loss's own all-reduce of its sum and denominator counts as its kernel's time)
        loss_s = collectives_cost([("all_reduce", 16, 0)], mesh, cluster)[0]
        assert split.predicted.compute_s - loss_s < priced.predicted.compute_s
    (note,) = [n for n in split.notes if "batch split" in n]
    assert "no cluster=" in note and "pass cluster=" in note and f"{priced.predicted.step_time_s * 1e3:.3g} ms" in note


def test_a_plan_that_splits_the_batch_or_cannot_stays(traced_gpt):
    cluster = cpu_cluster(threads_per_rank=1, cores=2)
    options = PlanOptions.from_keywords()
    whole = plan_traced(traced_gpt, (2,), cluster, options)
    split = split_batch_at_least(whole, traced_gpt, lambda pins: plan_traced(traced_gpt, (2,), cluster, options, pins))
    assert split_batch_at_least(split, traced_gpt, lambda pins: pytest.fail("solved again")) is split
    assert batch_pins(traced_gpt, (3,)) == {}  # a batch of 8 does not split 3 ways
    one = dataclasses.replace(whole, mesh_shape=(1,))
    assert split_batch_at_least(one, traced_gpt, lambda pins: pytest.fail("solved again")) is one


def test_a_batch_that_enters_whole_but_is_split_further_in_is_not_called_whole():
    # LLaMA-3-8B widths on (16, 8): the embedding takes the tokens split along the sequence, and
    # the layers' matmuls split the batch on axis 0. Every rank loads the whole batch; none
    # computes it (before, the note said each did).
    import autopar
    from autopar.zoo.shapes import build_preset

    model, batch = build_preset("llama-3-8b", 128, seq_len=4096, num_layers=2)
    plan = autopar.plan(model, (16, 8), example_inputs=batch, cluster="h100-80g", precision="bf16-mixed")
    assert plan.data_layout.size == 1
    assert not [n for n in plan.notes if "computes the whole batch" in n], plan.notes
    (note,) = [n for n in plan.notes if "enters whole" in n]
    assert "mesh axes (0,)" in note and "loads the whole batch" in note, note
    linear = next(node for node in plan.nodes.values() if node.op == "aten.linear.default")
    assert linear.outs[0][0] == Shard(0)  # what the note says: the batch split on axis 0 further in
