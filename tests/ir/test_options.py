"""The options' string choices are typed as ``Literal`` and each type holds exactly what its
checker accepts; the keywords of the facades each name a field of ``PlanOptions``."""

from __future__ import annotations

import inspect
import typing

import autopar
from autopar.cli.main import CHECKPOINTING
from autopar.cost.cluster import COMPUTE_MODES
from autopar.ir import options
from autopar.ir.memory import CHECKPOINT_POLICIES
from autopar.ir.pipeline import PLANNED_SCHEDULES
from autopar.solver.search.backends import SOLVERS


def test_each_literal_is_what_its_checker_accepts():
    assert typing.get_args(options.SolverName) == SOLVERS
    assert typing.get_args(options.ComputeMode) == COMPUTE_MODES
    assert typing.get_args(options.CheckpointPolicy) == CHECKPOINT_POLICIES
    assert typing.get_args(options.ScheduleName) == PLANNED_SCHEDULES
    assert typing.get_args(options.PrecisionName) == tuple(options.PRECISIONS)
    for offload in typing.get_args(options.OffloadTarget):
        options.MemoryOptions(offload=offload)  # each one passes the check
    # the CLI spells its words without importing torch: every policy is one of them
    assert {policy: policy for policy in CHECKPOINT_POLICIES}.items() <= CHECKPOINTING.items()


def test_every_planning_keyword_of_the_facades_sets_one_field():
    fields = set(options.KEYWORD_FIELDS)
    for facade in (autopar.plan, autopar.compile, autopar.hand_plan):
        names = set(inspect.signature(facade).parameters)
        assert "options" in names
        planning = names - {"model", "mesh", "kind", "example_inputs", "example_kwargs", "cluster", "compiler", "options"}
        planning -= {"plan", "init", "weights", "parallel"}  # compile's and hand_plan's own
        assert planning <= fields, planning - fields
    plan_options = options.PlanOptions()
    for path in options.KEYWORD_FIELDS.values():
        value = plan_options
        for name in path.split("."):
            value = getattr(value, name)  # every path exists
