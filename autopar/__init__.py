"""autopar: an auto-parallel compiler for PyTorch training.

plan = autopar.plan(model, mesh=(2, 4), example_inputs=(x,))       # offline, no process group
pm = autopar.compile(model, mesh=(2, 4), example_inputs=(x,))      # under torch.distributed
autopar.checkpoint.save(path, pm, optimizer); autopar.checkpoint.load(path, pm, optimizer)
pm = autopar.compile(meta_model, mesh, example_inputs=(x,), init=autopar.SeededInit(seed))
pm = autopar.compile(model, mesh=(2, 2), example_inputs=(x, y), pipeline=2, num_microbatches=4)
plan = autopar.plan(model, (2, 4), example_inputs=(x,), options=autopar.PlanOptions(...))  # options whole
"""

# The public names are loaded on first use (PEP 562), for start-up speed: `import autopar` and
# `autopar --help` load no torch. `from autopar import plan` and `autopar.Plan` work as before.
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar import checkpoint as checkpoint
    from autopar import optim as optim
    from autopar.api import compile, hand_plan, plan
    from autopar.errors import (
        AutoparError,
        CheckpointError,
        ClusterSpecError,
        ConfigError,
        InfeasibleError,
        InputError,
        MeshError,
        ModelError,
        OffloadError,
        PassError,
        PlanError,
        TraceError,
    )
    from autopar.ir.data import DataOptions
    from autopar.ir.options import CommOptions, MemoryOptions, MixedPrecision, PipelineOptions, PlanOptions, SolveOptions
    from autopar.ir.plan import Plan
    from autopar.runtime.materialize import FromCheckpoint, SeededInit
    from autopar.runtime.module import ParallelModule

__version__ = "0.1.0"

from autopar import _moved  # noqa: E402 - old module paths (autopar.models, ...) keep importing

_moved.install()

# public name -> the module that defines it (a module of its own where the name is the module).
_EXPORTS = {
    "plan": "autopar.api",
    "compile": "autopar.api",
    "hand_plan": "autopar.api",
    "Plan": "autopar.ir.plan",
    "MixedPrecision": "autopar.ir.options",
    "CommOptions": "autopar.ir.options",
    "PlanOptions": "autopar.ir.options",
    "SolveOptions": "autopar.ir.options",
    "MemoryOptions": "autopar.ir.options",
    "PipelineOptions": "autopar.ir.options",
    "DataOptions": "autopar.ir.data",
    "SeededInit": "autopar.runtime.materialize",
    "FromCheckpoint": "autopar.runtime.materialize",
    "ParallelModule": "autopar.runtime.module",
    "AutoparError": "autopar.errors",
    "TraceError": "autopar.errors",
    "MeshError": "autopar.errors",
    "PlanError": "autopar.errors",
    "InfeasibleError": "autopar.errors",
    "PassError": "autopar.errors",
    "OffloadError": "autopar.errors",
    "CheckpointError": "autopar.errors",
    "ConfigError": "autopar.errors",
    "ClusterSpecError": "autopar.errors",
    "ModelError": "autopar.errors",
    "InputError": "autopar.errors",
    "checkpoint": "autopar.checkpoint",
    "optim": "autopar.optim",
}

__all__ = [
    "CommOptions",
    "PlanOptions",
    "SolveOptions",
    "MemoryOptions",
    "PipelineOptions",
    "DataOptions",
    "plan",
    "compile",
    "hand_plan",
    "Plan",
    "MixedPrecision",
    "SeededInit",
    "FromCheckpoint",
    "ParallelModule",
    "AutoparError",
    "TraceError",
    "MeshError",
    "PlanError",
    "InfeasibleError",
    "PassError",
    "CheckpointError",
    "OffloadError",
    "ConfigError",
    "ClusterSpecError",
    "ModelError",
    "InputError",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    value = module if module_name == f"autopar.{name}" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
