"""``compile``'s refusals of padded parameter shards where the runtime cannot move them
(``autopar.runtime.padded``), single-process: the check reads the plan and the trace alone."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.errors import PlanError
from autopar.ir.options import CommOptions, PlanOptions
from autopar.runtime.padded import check_padded_plan, padded_params
from autopar.trace import trace
from tests.conftest import WideNet, wide_batch


@pytest.fixture(scope="module")
def padded():
    from autopar.ir import spec as spec_module

    model, batch = WideNet().double(), wide_batch(0)
    allowed, spec_module.PADDED_PARAM_SHARDS = spec_module.PADDED_PARAM_SHARDS, True
    try:
        plan = autopar.hand_plan("fsdp", model, (3,), example_inputs=batch, cluster="cpu")
    finally:
        spec_module.PADDED_PARAM_SHARDS = allowed
    return plan, trace(model, batch)


def test_padded_params_are_the_uneven_dim_0_shards(padded):
    plan, traced = padded
    assert padded_params(plan, traced) == ["up.weight", "up.bias", "down.weight", "down.bias"]
    even = dataclasses.replace(plan, params={fqn: (Replicate(),) for fqn in plan.params})
    assert padded_params(even, traced) == []
    summary = plan.summary()  # the plan's text says which shards are padded, and how
    assert (
        "up.weight    (S(0))  padded: 22 of 64 rows a rank" in summary and "down.bias    (S(0))  padded: 1 of 2 rows" in summary
    )
    assert "  scale        (R)\n" in summary and "padded" not in even.summary()


def test_a_plan_with_padded_shards_compiles_only_where_the_scheduled_gather_moves_them(padded):
    plan, traced = padded
    check_padded_plan(plan, traced, PlanOptions(), None)  # one axis, the schedule on, eager: runs
    with pytest.raises(PlanError, match=r"up\.weight, up\.bias, down\.weight, down\.bias as padded shards.*compiler='inductor'"):
        check_padded_plan(plan, traced, PlanOptions(), "inductor")
    with pytest.raises(PlanError, match=r"communication schedule is off"):
        check_padded_plan(plan, traced, PlanOptions(comm=CommOptions(enabled=False)), None)
    two_axes = dataclasses.replace(
        plan, mesh_shape=(2, 3), params={fqn: (Replicate(), *spec) for fqn, spec in plan.params.items()}
    )
    assert two_axes.params["up.weight"] == (Replicate(), Shard(0))
    check_padded_plan(two_axes, traced, PlanOptions(), None)  # beside a replicated axis (HSDP's): runs
    with pytest.raises(PlanError, match=r"compiler='inductor' traces its gathers unpadded"):
        check_padded_plan(two_axes, traced, PlanOptions(), "inductor")


def test_autopar_check_refuses_padded_shards_it_cannot_simulate(padded):
    """``autopar check`` runs the graph unscheduled on a fake group, where no gather pads the
    pieces: it says so instead of reporting shapes the runtime never has."""
    from autopar.runtime.tools.check import check_plan

    plan, _ = padded
    with pytest.raises(PlanError, match="does not check plans with padded parameter shards"):
        check_plan(plan, WideNet().double(), wide_batch(0), rank=2)
