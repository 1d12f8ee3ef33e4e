"""The plan's ``predicted`` and ``solver`` objects as frozen values (single process, no solve)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.ir.prediction import Prediction, SolverStats

# The predicted object of a sharded plan with memory decisions, a symbolic batch and an unknown
# key, in the order the planners write them (``solver.planners.sharding``, then ``api.plan``).
SHARDED = {
    "step_time_s": 0.5,
    "compute_s": 0.25,
    "reshard_s": 0.125,
    "grad_sync_s": 0.0625,
    "exposed_grad_sync_s": 0.03,
    "grad_schedule": {"delta_s": 0.0, "delta_bytes": 0, "last_bucket_s": 0.01, "post_solve_s": 0.02},
    "peak_memory_bytes": 123,
    "peak_memory_at": "backward of mm",
    "memory_at_peak_bytes": {"param": 100, "grad": 23},
    "comm_bytes": 4096,
    "comm_bytes_per_axis": [4096, 0],
    "expert_parallel": [{"node": "experts", "degree": 2}],
    "memory_s": 0.1,
    "executor": "eager",
    "symbolic": {"symbol": "B", "batch": 8, "step_time_s": "B/16"},
    "from_a_newer_autopar": [1],
}
PIPELINED = {
    "step_time_s": 1.0,
    "peak_memory_bytes": 7,
    "stage_time_s": [0.25, 0.5],
    "grad_sync_s": 0.1,
    "recompute": [False, True],
    "one_microbatch_unpipelined": {"compute_s": 0.3, "comm_bytes_per_axis": [1, 2]},
}
SOLVED = {
    "status": "Optimal",
    "objective_s": 0.4,
    "num_variables": 10,
    "num_constraints": 12,
    "memory_budget_bytes": None,
    "fallbacks": ["a", "b"],
    "method": "lp_round",
    "backend": "highs",
    "lower_bound_s": None,
    "gap": None,
    "stage_search": {"ilp_solves": 3, "pipelines_priced": 4, "candidate_plans": 2},
}


@pytest.mark.parametrize(
    "kind, data", [(Prediction, SHARDED), (Prediction, PIPELINED), (SolverStats, SOLVED), (SolverStats, {}), (Prediction, {})]
)
def test_json_round_trip_keeps_every_key_and_its_order(kind, data):
    value = kind.from_json(data)
    assert json.dumps(value.to_json(), indent=1) == json.dumps(data, indent=1)
    assert kind.from_json(json.loads(json.dumps(value.to_json()))) == value


def test_fields_are_typed_and_frozen():
    predicted = Prediction.from_json(SHARDED)
    assert predicted.step_time_s == 0.5 and predicted.comm_bytes_per_axis == (4096, 0)
    assert predicted.extra == {"from_a_newer_autopar": [1]} and not predicted.pipelined
    assert Prediction.from_json(PIPELINED).recompute == (False, True) and Prediction.from_json(PIPELINED).pipelined
    with pytest.raises(dataclasses.FrozenInstanceError):
        predicted.step_time_s = 1.0
    stats = SolverStats.from_json(SOLVED)
    assert stats.fallbacks == ("a", "b") and stats.memory_budget_bytes is None
    # A solver object without a status (hand-written) keeps what it has.
    assert SolverStats.from_json({"objective_s": 1.5}).to_json()["objective_s"] == 1.5


def test_a_replaced_field_keeps_its_place_and_a_new_one_goes_where_the_planners_put_it():
    base = {key: value for key, value in SHARDED.items() if key not in ("memory_s", "executor", "symbolic")}
    added = dataclasses.replace(Prediction.from_json(base), step_time_s=0.75, memory_s=0.25, executor="inductor")
    assert list(added.to_json()) == [
        *[k for k in SHARDED if k not in ("symbolic", "from_a_newer_autopar")],
        "from_a_newer_autopar",
    ]
    assert added.to_json()["step_time_s"] == 0.75


def test_dict_style_reads_still_work_with_a_deprecation_warning():
    predicted = Prediction.from_json(SHARDED)
    with pytest.warns(DeprecationWarning, match=r"read \.step_time_s"):
        assert predicted["step_time_s"] == 0.5
    with pytest.warns(DeprecationWarning):
        assert predicted.get("recompute") is None and predicted.get("recompute", 3) == 3
    with pytest.warns(DeprecationWarning):
        assert "comm_bytes" in predicted and "stage_time_s" not in predicted
    with pytest.warns(DeprecationWarning), pytest.raises(KeyError):
        predicted["stage_time_s"]
    with pytest.warns(DeprecationWarning):
        assert SolverStats.from_json(SOLVED)["status"] == "Optimal"


def test_a_plan_refuses_a_dict_naming_the_type_to_use(gpt_plan_2x2):
    with pytest.raises(TypeError, match=r"Prediction\.from_json"):
        dataclasses.replace(gpt_plan_2x2, predicted=gpt_plan_2x2.predicted.to_json())
