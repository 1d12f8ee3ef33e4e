"""Run the rewrite passes from an explicit list, timing and linting after each one."""

from __future__ import annotations

import functools
import logging
import time
from typing import Callable, Mapping, Sequence

import torch
import torch.fx

from autopar.errors import PassError, PlanError
from autopar.passes.memory import checkpoint_segments, offload_activations, offload_params
from autopar.passes.rewrite import insert_collectives, localize_shapes, use_kernels
from autopar.passes.schedule import schedule_communication
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

Pass = Callable[[torch.fx.GraphModule, Plan], torch.fx.GraphModule]


def default_passes(groups: Sequence[str], offloader=None, fqns: Mapping[str, str] | None = None,
                   comm: CommOptions | None = None) -> list[Pass]:
    """The passes ``compile`` runs, in order. ``groups`` are the mesh axes' process-group names;
    ``offloader`` (``autopar.runtime.offload.Offloader``) and ``fqns`` (placeholder name →
    canonical parameter FQN) serve a plan that offloads parameters, and the communication
    schedule (``comm``), which needs parameters to bind."""
    return [
        localize_shapes,
        functools.partial(use_kernels, groups=tuple(groups)),
        functools.partial(insert_collectives, groups=tuple(groups)),
        functools.partial(schedule_communication, groups=tuple(groups), fqns=fqns, options=comm),
        functools.partial(offload_params, offloader=offloader, fqns=fqns),
        functools.partial(offload_activations, offloader=offloader),
        checkpoint_segments,
    ]


def pass_name(fn: Pass) -> str:
    return getattr(fn, "func", fn).__name__


def run_passes(gm: torch.fx.GraphModule, plan: Plan, passes: Sequence[Pass]) -> torch.fx.GraphModule:
    done: list[str] = []
    for fn in passes:
        name = pass_name(fn)
        start = time.perf_counter()
        try:
            gm = fn(gm, plan)
            gm.graph.lint()
            gm.recompile()
        except Exception as error:
            before = ", ".join(done) or "none"
            raise PassError(f"pass {name} failed (passes run before it: {before}): {type(error).__name__}: {error}") from error
        log.debug("pass %s took %.3f s", name, time.perf_counter() - start)
        done.append(name)
    return gm


def check_plan_matches(chosen: Plan, traced: TracedModel, mesh_shape: tuple[int, ...]) -> None:
    """The plan was made for this torch, this mesh and this graph: a PlanError naming what differs otherwise."""
    made_with, running = chosen.torch_version.split("+")[0], torch.__version__.split("+")[0]
    if made_with != running:
        raise PlanError(
            f"the plan was made with torch {chosen.torch_version}, and this is torch {torch.__version__}: "
            "traced graphs (and node names) differ between versions; re-plan with this torch"
        )
    if tuple(chosen.mesh_shape) != tuple(mesh_shape):
        raise PlanError(f"the plan was made for mesh {tuple(chosen.mesh_shape)}, not {tuple(mesh_shape)}: re-plan for this mesh")
    if chosen.graph_hash != traced.graph_hash:
        raise PlanError(
            f"the plan was made for a different graph (hash {chosen.graph_hash}, this model and these inputs "
            f"give {traced.graph_hash}): the model or the example input shapes changed; re-plan"
        )


__all__ = ["check_plan_matches", "default_passes", "run_passes", "insert_collectives", "localize_shapes", "use_kernels", "offload_params",
           "checkpoint_segments", "schedule_communication"]
