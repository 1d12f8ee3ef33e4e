"""Run the rewrite passes from an explicit list, timing and linting after each one."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx

from autopar.errors import PassError, PlanError
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan, placeholder_names
from autopar.passes.held import HeldChains, hold_param_collectives
from autopar.passes.memory import checkpoint_segments, offload_activations, offload_params
from autopar.passes.precision import cast_after_collectives, gather_in_param_dtype
from autopar.passes.rewrite import insert_collectives, localize_shapes, use_kernels
from autopar.passes.schedule import schedule_communication, schedule_in_graph
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

Pass = Callable[[torch.fx.GraphModule, Plan], torch.fx.GraphModule]


def default_passes(
    groups: Sequence[str],
    offloader=None,
    fqns: Mapping[str, str] | None = None,
    comm: CommOptions | None = None,
    compiler: str | None = None,
    held: HeldChains | None = None,
) -> list[Pass]:
    """The passes ``compile`` runs, in order. ``groups`` are the mesh axes' process-group names;
    ``offloader`` (``autopar.runtime.offload.Offloader``) and ``fqns`` (placeholder name →
    canonical parameter FQN) serve a plan that offloads parameters, and the communication
    schedule (``comm``), which needs parameters to bind. ``compiler="inductor"`` schedules in
    the graph (``schedule_in_graph``) instead of in the runtime's buckets and gathers."""
    schedule = schedule_in_graph if compiler == "inductor" else schedule_communication
    return [
        localize_shapes,
        functools.partial(use_kernels, groups=tuple(groups)),
        functools.partial(insert_collectives, groups=tuple(groups)),
        cast_after_collectives,
        functools.partial(schedule, groups=tuple(groups), fqns=fqns, options=comm),
        gather_in_param_dtype,
        functools.partial(offload_params, offloader=offloader, fqns=fqns),
        functools.partial(offload_activations, offloader=offloader),
        *([functools.partial(hold_param_collectives, held=held)] if held is not None else []),
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
            raise PassError(
                f"pass {name} failed (passes run before it: {before}): {type(error).__name__}: {error}\n"
                "  This is a bug in autopar: please report it with the plan JSON (plan.save(path))"
            ) from error
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
        changes = graph_input_changes(chosen, traced)
        raise PlanError(
            f"the plan was made for a different graph (hash {chosen.graph_hash}, this model and these inputs "
            f"give {traced.graph_hash}):\n" + "\n".join(f"  {line}" for line in changes) + "\n"
            "  The model or its example inputs changed since planning: re-plan for them (autopar.plan, or `autopar plan`)"
        )


def graph_input_changes(chosen: Plan, traced: TracedModel, limit: int = 8) -> list[str]:
    """What differs between the plan's inputs and parameters and the traced graph's: inputs and
    parameters added, removed, reshaped or of another dtype (the plan records each placeholder's
    op and shape, and ``input_dtypes``)."""
    planned = {name: node for name, node in chosen.nodes.items() if node.op in ("user", "param", "buffer")}
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    now = {gi.name: gi for gi in traced.inputs if gi.kind in ("user", "param", "buffer")}

    def label(name: str, kind: str, fqn: str | None) -> str:
        return {"user": f"input {name!r}", "param": f"parameter {fqn or name!r}"}.get(kind, f"buffer {fqn or name!r}")

    fqn_of = {name: node_fqn for node_fqn in chosen.params for name in placeholder_names(node_fqn)}
    changes: list[str] = []
    for name, gi in now.items():
        val = placeholders[name].meta.get("val") if name in placeholders else None
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        dtype = f", dtype {val.dtype}" if isinstance(val, torch.Tensor) else ""
        what = label(name, gi.kind, gi.fqn if gi.kind != "user" else None)
        planned_dtype = chosen.input_dtypes.get(name)
        if name not in planned:
            changes.append(f"{what} is new: shape {shape}{dtype} (not in the plan)")
        elif shape is not None and planned[name].shapes and tuple(planned[name].shapes[0]) != shape:
            changes.append(f"{what} has shape {shape}{dtype}; the plan was made for {tuple(planned[name].shapes[0])}")
        elif isinstance(val, torch.Tensor) and planned_dtype and planned_dtype != str(val.dtype):
            changes.append(f"{what} has dtype {val.dtype}; the plan was made for {planned_dtype}")
    for name, node in planned.items():
        if name not in now:
            what = label(name, node.op, fqn_of.get(name))
            changes.append(f"{what} is gone: the plan has it with shape {tuple(node.shapes[0]) if node.shapes else '?'}")
    if not changes:
        changes = [
            "every input and parameter has its planned shape: an input's or a parameter's dtype, or "
            "the model's code (the ops it runs), changed"
        ]
    return changes[:limit] + ([f"... and {len(changes) - limit} more"] if len(changes) > limit else [])


__all__ = [
    "check_plan_matches",
    "default_passes",
    "run_passes",
    "insert_collectives",
    "localize_shapes",
    "use_kernels",
    "offload_params",
    "checkpoint_segments",
    "schedule_communication",
    "schedule_in_graph",
    "cast_after_collectives",
    "gather_in_param_dtype",
]
