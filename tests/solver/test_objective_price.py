"""The ILP's objective is the plan's predicted step time (single process).

The ILP prices each parameter's gradient reduction once, bucketed (``ilp.add_param_sync_variables``);
``solver.comm_schedule`` re-prices the solved plan. Both must price the same reductions: the only
terms the ILP does not carry are listed in ``predicted.grad_schedule.post_solve_s`` (one gather per
parameter, FSDP's reduce-scatter, the buckets' whole latencies) and the part of the buckets that
backward hides (``grad_sync_s - exposed_grad_sync_s``). ``compute_s`` carries no parameter
gradient reduction: those are in ``grad_sync_s``."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost.cluster import get_cluster
from tests.conftest import gpt_and_batch


def assert_objective_is_step_time(plan: autopar.Plan) -> None:
    predicted = plan.predicted
    objective = plan.solver["objective_s"]
    post_solve = predicted["grad_schedule"]["post_solve_s"]
    hidden = predicted["grad_sync_s"] - predicted["exposed_grad_sync_s"]
    assert predicted["step_time_s"] == pytest.approx(objective + post_solve - hidden, rel=1e-6)
    # Only the scheduled buckets' latency (at most one bucket's, 2(k-1)·α of the widest axis, on
    # these plans with no FSDP-style gather) is left out of the ILP's price.
    cluster = get_cluster(plan.cluster)
    latency = max(2 * (k - 1) * cluster.axis_link(plan.mesh_shape, a).latency_s
                  for a, k in enumerate(plan.mesh_shape) if k > 1)
    assert 0.0 <= post_solve <= latency * (1 + 1e-9)
    # compute_s is compute (and activation collectives): the per-use parameter reductions,
    # which the bucketed grad_sync_s replaces, are not in it
    assert predicted["compute_s"] + predicted["reshard_s"] + predicted["grad_sync_s"] == pytest.approx(
        objective + post_solve, rel=1e-6)


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_zoo_gpt_objective_is_the_predicted_step(mesh) -> None:
    model, batch = gpt_and_batch()
    plan = autopar.plan(model, mesh, example_inputs=batch, cluster="cpu", solver="highs")
    assert plan.predicted["grad_sync_s"] > 0, "the plan reduces parameter gradients (ddp-like)"
    assert_objective_is_step_time(plan)
