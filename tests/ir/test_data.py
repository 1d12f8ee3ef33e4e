"""The data layout a plan records (``autopar.ir.data``)."""

from __future__ import annotations

import json

import pytest

import autopar
from autopar.ir.data import DataLayout, DataOptions
from autopar.ir.plan import validate_plan_json


def test_data_parallel_rank_is_the_row_major_position_on_the_batch_axes() -> None:
    layout = DataLayout("per_rank", (0, 2), (2, 3, 2))
    assert layout.size == 4
    assert [layout.rank((a, b, c)) for a in range(2) for b in range(3) for c in range(2)] == [0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3]
    assert DataLayout("whole", (), (2, 2)).size == 1
    assert DataLayout("whole", (), (2, 2)).rank((1, 1)) == 0


def test_options_and_layouts_refuse_what_they_cannot_mean() -> None:
    with pytest.raises(ValueError, match="batch must be one of"):
        DataOptions("rows")
    with pytest.raises(ValueError, match="distinct mesh axes in order"):
        DataLayout("whole", (1, 0), (2, 2))
    with pytest.raises(ValueError, match="distinct mesh axes in order"):
        DataLayout("whole", (2,), (2, 2))
    with pytest.raises(ValueError, match="pipeline"):
        autopar.plan(None, (2, 2), pipeline=2, data=DataOptions("per_rank"))


def test_plan_json_records_the_mode_and_data_parallel_size(gpt_plan_2x2) -> None:
    layout = gpt_plan_2x2.data
    assert layout is not None and layout.batch == "whole"
    data = json.loads(gpt_plan_2x2.to_json())
    assert data["data"]["data_parallel_size"] == layout.size and data["data"]["inputs"] == ["idx", "targets"]
    validate_plan_json(data)
    assert autopar.Plan.from_json(gpt_plan_2x2.to_json()).data == layout
    assert f"data_parallel_size {layout.size}" in gpt_plan_2x2.summary()
    data["data"]["batch"] = "sometimes"
    with pytest.raises(autopar.PlanError, match="data/batch"):
        validate_plan_json(data)
