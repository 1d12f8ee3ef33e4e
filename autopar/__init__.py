"""autopar: an auto-parallel compiler for PyTorch training.

    plan = autopar.plan(model, mesh=(2, 4), example_inputs=(x,))       # offline, no process group
    pm = autopar.compile(model, mesh=(2, 4), example_inputs=(x,))      # under torch.distributed
    autopar.checkpoint.save(path, pm, optimizer); autopar.checkpoint.load(path, pm, optimizer)
    pm = autopar.compile(meta_model, mesh, example_inputs=(x,), init=autopar.SeededInit(seed))
    pm = autopar.compile(model, mesh=(2, 2), example_inputs=(x, y), pipeline=2, num_microbatches=4)
"""

from autopar.api import compile, hand_plan, plan
from autopar.errors import AutoparError, InfeasibleError, MeshError, PassError, PlanError, TraceError
from autopar.runtime.materialize import FromCheckpoint, SeededInit
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan
from autopar.runtime.module import ParallelModule
from autopar import checkpoint, optim

__version__ = "0.1.0"

__all__ = [
    "CommOptions",
    "plan",
    "compile",
    "hand_plan",
    "Plan",
    "SeededInit",
    "FromCheckpoint",
    "ParallelModule",
    "AutoparError",
    "TraceError",
    "MeshError",
    "PlanError",
    "InfeasibleError",
    "PassError",
]
