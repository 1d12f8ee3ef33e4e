"""``autopar check``: the rewritten forward at full world size on a fake process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

import autopar
from autopar.ir.spec import parse_spec
from autopar.runtime.tools.check import check_plan
from autopar.zoo.models import build_model, example_batch
from tests.conftest import gpt_and_batch


@pytest.fixture(scope="module")
def gpt(gpt_plan_2x2):
    model, batch = gpt_and_batch()
    return model, batch, gpt_plan_2x2


def test_good_plan_checks_on_every_rank(gpt):
    model, batch, plan = gpt
    for rank in (0, 3):  # the first and last mesh coordinates
        result = check_plan(plan, model, batch, rank=rank)
        assert result.ok, result.text()
        assert result.world_size == 4 and result.coordinate == divmod(rank, 2)
        assert result.num_nodes > 50 and result.num_inputs > 50
        assert result.text().startswith("OK:")
    assert not dist.is_initialized(), "the fake process group is torn down"


def test_sharded_plan_runs_collectives_at_large_world_size():
    # A Megatron-like plan (weights sharded on a 16-way axis) puts collectives in the graph;
    # the check builds rank 13 of 32 without any real process.
    model, batch = build_model("mlp", seed=0, d_hidden=256), example_batch("mlp", 32)
    plan = autopar.plan(model, (2, 16), example_inputs=batch, cluster="h100-80g", memory_budget=60_000)
    assert plan.collective_counts(), plan.summary()
    result = check_plan(plan, model, batch, rank=13)
    assert result.ok, result.text()
    assert result.world_size == 32 and result.num_collectives > 0


def test_wrong_plan_names_the_mismatching_node(gpt):
    model, batch, plan = gpt
    # Any linear, given an output placement it does not have (its local shape then differs).
    name = next(n for n, p in plan.nodes.items() if p.op == "aten.linear.default")
    wrong = next(
        spec for spec in (parse_spec(["S(0)", "S(1)"]), parse_spec(["S(1)", "S(0)"])) if spec != plan.nodes[name].outs[0]
    )
    nodes = dict(plan.nodes)
    nodes[name] = dataclasses.replace(nodes[name], outs=(wrong,))
    result = check_plan(dataclasses.replace(plan, nodes=nodes), model, batch, rank=0)
    assert not result.ok
    assert result.mismatches[0].startswith(f"{name} (aten.linear.default) output 0")
    assert "MISMATCH" in result.text()
    assert not dist.is_initialized()


def test_plan_for_another_model_is_refused(gpt):
    _, _, plan = gpt
    other = build_model("gpt", seed=0, n_layer=1)
    with pytest.raises(autopar.PlanError, match="different graph"):
        check_plan(plan, other, example_batch("gpt", 8, seed=1))
    with pytest.raises(autopar.MeshError, match="not in a world of 4"):
        check_plan(plan, gpt[0], gpt[1], rank=4)


def test_a_mixed_precision_plan_checks_with_its_casts():
    model, batch = gpt_and_batch()
    for kind in ("ddp", "fsdp"):
        plan = autopar.hand_plan(kind, model, (2, 2), example_inputs=batch, cluster="cpu", precision="bf16-mixed")
        result = check_plan(plan, model, batch, rank=3)
        assert result.ok, result.text()
