"""``compile``'s refusals of padded parameter shards where the runtime cannot move them
(``autopar.runtime.padded``), and ``autopar check`` of plans that hold them, single-process."""

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


def _padded_hand_plan(kind: str, mesh: tuple[int, ...], precision: str | None = None):
    """WideNet's hand plan ``kind`` on ``mesh``: 3 ranks divide none of its dims, so its shards are padded."""
    return autopar.hand_plan(kind, WideNet().double(), mesh, example_inputs=wide_batch(0), cluster="cpu", precision=precision)


@pytest.fixture(scope="module")
def padded():
    return _padded_hand_plan("fsdp", (3,)), trace(WideNet().double(), wide_batch(0))


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


@pytest.mark.parametrize("precision", [None, "bf16-mixed"])
def test_autopar_check_gathers_padded_shards_as_the_runtime_does(padded, precision):
    """``autopar check`` runs the graph unscheduled on a fake group: each padded shard's gather is
    made as the runtime's scheduled one makes it (pad to ``ceil(n / k)`` rows, gather, cut back), and
    each rank must hold its own rows of ``torch.chunk``'s cut (22, 22, 20 of 64; 1, 1, 0 of 2)."""
    from autopar.runtime.tools.check import check_plan

    model, batch = WideNet().double(), wide_batch(0)
    plan = padded[0] if precision is None else _padded_hand_plan("fsdp", (3,), precision)  # a cast before the gather
    for rank in range(3):
        result = check_plan(plan, model, batch, rank=rank)
        assert result.ok, result.text()
        assert result.num_collectives >= 4  # a gather of each padded parameter at least
    two_axes = _padded_hand_plan("tp_fsdp", (3, 2), precision)  # padded on axis 0 of 3 beside a replicated axis
    assert two_axes.params["down.bias"] == (Shard(0), Replicate())
    for rank in (0, 5):
        assert check_plan(two_axes, model, batch, rank=rank).ok
    # A parameter held otherwise than its graph takes it (whole, where the plan pads it) is named.
    wrong = dataclasses.replace(plan, params={**plan.params, "down.bias": (Replicate(),)})
    result = check_plan(wrong, model, batch, rank=2)
    assert not result.ok and result.mismatches[0].startswith("p_down_bias (param) output 0: local shape (2,)"), result.text()
