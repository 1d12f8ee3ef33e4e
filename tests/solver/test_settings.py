"""Every planner reads the memory budget from one function (``solver.planners.settings``), and the
stage planner's settings are made from ``PlanOptions`` in one place (``StageSettings.of``)."""

from __future__ import annotations

from pathlib import Path

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.options import MemoryOptions, PipelineOptions, PlanOptions
from autopar.solver.planners.settings import memory_budget
from autopar.solver.planners.stages import StageSettings

ROOT = Path(autopar.__file__).resolve().parent


def test_the_budget_is_resolved_in_one_function():
    callers = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.py") if "resolve_budget(" in p.read_text())
    assert callers == ["cost/cluster.py", "solver/planners/settings.py"]


def test_the_budget_of_the_options():
    cluster = get_cluster("h100-80g")
    assert memory_budget(PlanOptions(), cluster) == cluster.default_memory_budget
    assert memory_budget(PlanOptions(memory=MemoryOptions(budget=float("inf"))), cluster) is None
    assert memory_budget(PlanOptions(memory=MemoryOptions(budget="40GB")), cluster) == 40e9


def test_stage_settings_read_the_options():
    cluster = get_cluster("h100-80g")
    options = PlanOptions(
        pipeline=PipelineOptions(stages=4, num_microbatches=8, schedules="auto"),
        memory=MemoryOptions(budget=1e9, checkpointing=False),
    )
    settings = StageSettings.of(options, cluster, devices=16)
    assert (settings.num_stages, settings.num_microbatches, settings.devices) == (4, 8, 16)
    assert settings.memory_budget == 1e9 and settings.remat is False and settings.max_axes == 2
    assert settings.schedules_allowed == options.pipeline.schedules and len(settings.schedules_allowed) == 3
    assert StageSettings.of(options, cluster, num_stages=2).num_stages == 2
