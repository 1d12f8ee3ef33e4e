"""The planning dispatch from a model: ``plan_model`` traces it and chooses the planner (a
pipeline, a mesh search for ``mesh="auto"``, or one mesh: ``traced.plan_traced``), and
``plan_hand`` / ``plan_colossal`` make the hand plans. ``autopar.plan``, ``autopar.hand_plan`` and
``autopar plan`` call these with one ``PlanOptions``; nothing here reads the API."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from autopar.cost.cluster import ClusterSpec
from autopar.errors import ConfigError, InfeasibleError, MeshError
from autopar.ir.options import MixedPrecision, PipelineOptions, PlanOptions, check_mesh_devices
from autopar.ir.pipeline import batch_size_of, first_microbatch, stage_mesh_of
from autopar.ir.plan import Plan
from autopar.solver.planners.data import with_data_layout
from autopar.solver.planners.hand_plans import resolve_kind, solve_hand_plan
from autopar.solver.planners.mesh_search import search_mesh
from autopar.solver.planners.quiet_gc import quiet_gc
from autopar.solver.planners.traced import plan_pipelined, plan_traced, plan_traced_unexplained, with_notes
from autopar.solver.pricing import symbolic
from autopar.solver.problem.op_prices import pricing_for
from autopar.trace import TracedModel, trace_repeated

log = logging.getLogger("autopar")

# (example positional inputs, example keyword inputs or None): what the model is traced with
Examples = tuple[tuple[Any, ...], dict[str, Any] | None]


def parse_mesh(mesh: Sequence[int] | int) -> tuple[int, ...]:
    """The mesh shape of ``mesh`` (a tuple of positive ints, or one int)."""
    if isinstance(mesh, int):
        mesh = (mesh,)
    try:
        shape = tuple(int(n) for n in mesh)
    except (TypeError, ValueError):
        raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), got {mesh!r}") from None
    if not shape or any(n < 1 for n in shape) or any(int(a) != a for a in mesh):
        raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), got {mesh!r}")
    return shape


def plan_model(
    model: torch.nn.Module,
    mesh: Sequence[int] | int | str,
    example_inputs: tuple[Any, ...],
    example_kwargs: dict[str, Any] | None,
    cluster: ClusterSpec,
    options: PlanOptions,
    on_progress: Callable[[str], None] | None = None,
) -> Plan:
    """The one planning dispatch, behind ``autopar.plan`` and ``autopar plan``: a pipeline (the
    stage planner), a mesh search (``mesh="auto"``), or one mesh. ``on_progress`` hears each step
    of a mesh search. (``compile`` knows its mesh and traces the whole model: rank 0 plans it with
    ``traced.plan_traced``, in ``runtime.agreement``.)"""
    examples = (example_inputs, example_kwargs)
    if options.compute is not None:
        cluster = dataclasses.replace(cluster, compute=options.compute)
    if options.pipeline.enabled:
        return _plan_pipeline(model, mesh, examples, cluster, options)
    if isinstance(mesh, str):
        if mesh != "auto":
            raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), or 'auto', got {mesh!r}")
        if options.devices is None:
            raise MeshError("mesh='auto' searches the meshes of a number of devices: pass devices=N as well")
        if options.memory.decides_memory:
            raise MeshError(
                f"offload={options.memory.offload!r}, checkpointing={options.memory.checkpointing!r} "
                "with mesh='auto': the mesh search plans sharding only; pass a mesh such as (2, 4) to "
                "plan checkpointing and offload"
            )
        traced = trace_model(model, *examples, options.precision)
        return search_mesh(traced, options.devices, cluster, options, plan_traced_unexplained, on_progress=on_progress)
    mesh_shape = parse_mesh(mesh)
    check_mesh_devices(mesh_shape, options.devices)
    traced = trace_model(model, *examples, options.precision)
    result = plan_traced(traced, mesh_shape, cluster, options)
    return _with_symbolic(model, examples, traced, result, cluster, options) if options.symbolic_batch else result


def _with_symbolic(
    model: torch.nn.Module, examples: Examples, traced: TracedModel, result: Plan, cluster: ClusterSpec, options: PlanOptions
) -> Plan:
    """``result`` with its costs as functions of the batch size (``symbolic_batch=True``): priced
    again on a trace at twice the batch."""
    example_inputs, example_kwargs = examples
    batch = symbolic.batch_size((example_inputs, example_kwargs))
    doubled = trace_repeated(
        model, symbolic.double_batch(example_inputs), symbolic.double_batch(example_kwargs), options.precision
    )
    with pricing_for(cluster):  # priced as the plan was (``sharding.solve_unexplained``)
        costs = symbolic.symbolic_costs(
            symbolic.price_plan(traced, result, cluster),
            symbolic.price_plan(doubled, result, cluster),
            batch,
            result.predicted,
        )
    return dataclasses.replace(result, predicted=dataclasses.replace(result.predicted, symbolic=costs))


@quiet_gc()
def trace_model(model: torch.nn.Module, example_inputs, example_kwargs, precision: MixedPrecision | None = None) -> TracedModel:
    """``model`` traced on ``examples`` for planning: a deep model's repeated layers are exported
    once and copied (``trace.repeat``)."""
    start = time.perf_counter()
    log.info("tracing ...")
    # ``compile`` traces the whole model, and its graph-hash check would refuse a plan made on any other graph.
    traced = trace_repeated(model, example_inputs, example_kwargs, precision)
    log.info("traced %d graph nodes in %.2f s", len(traced.gm.graph.nodes), time.perf_counter() - start)
    return traced


def _plan_pipeline(model, mesh, examples: Examples, cluster: ClusterSpec, options: PlanOptions) -> Plan:
    """A pipelined plan: trace one microbatch and run the stage planner."""
    devices = options.devices
    mesh_shape = None
    if isinstance(mesh, str):
        if mesh != "auto" or devices is None:
            raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), or 'auto' with devices=N, got {mesh!r}")
    else:
        mesh_shape = parse_mesh(mesh)
        if devices is not None and math.prod(mesh_shape) != devices:
            raise MeshError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices, not devices={devices}: pass one of them")
        if options.pipeline.stages != "auto":
            stage_mesh_of(mesh_shape, options.pipeline.stages)
    if options.pipeline.num_microbatches == "auto":
        return _plan_microbatches(model, mesh_shape, examples, cluster, options)
    log.info("tracing one microbatch of %d ...", options.pipeline.microbatches)
    one = first_microbatch(*examples, options.pipeline.microbatches)
    return plan_pipelined(trace_model(model, *one, options.precision), mesh_shape, cluster, options)


def _plan_microbatches(model, mesh_shape, examples: Examples, cluster: ClusterSpec, options: PlanOptions) -> Plan:
    """``num_microbatches="auto"``: the stage planner at each power-of-two microbatch count that
    divides the batch, smallest first (one trace each), until two in a row are no faster than the
    best; the fastest plan, whose ``pipeline.reason`` lists the counts tried."""
    batch = batch_size_of(*examples)
    counts = [2**k for k in range(batch.bit_length()) if batch % 2**k == 0]
    best: Plan | None = None
    tried: list[str] = []
    worse = 0
    for count in counts:
        trial = options.replace(pipeline=dataclasses.replace(options.pipeline, num_microbatches=count))
        try:
            traced = trace_model(model, *first_microbatch(*examples, count), options.precision)
            made = plan_pipelined(traced, mesh_shape, cluster, trial)
        except InfeasibleError:
            tried.append(f"{count}: none fits")
            continue
        step = made.predicted.step_time_s
        tried.append(f"{count}: {step:.4g} s")
        if best is None or step < best.predicted.step_time_s:
            best, worse = made, 0
        else:
            worse += 1
            if worse == 2:
                break
    if best is None:
        raise InfeasibleError(
            f"no pipeline fits at any microbatch count ({'; '.join(tried)}): raise the budget, use more devices or stages"
        )
    reason = f"{best.pipeline.reason}; microbatches tried {', '.join(tried)}"
    return dataclasses.replace(best, pipeline=dataclasses.replace(best.pipeline, reason=reason))


@quiet_gc()
def plan_hand(
    kind: str, model: torch.nn.Module, mesh_shape: tuple[int, ...], examples: Examples, cluster: ClusterSpec, options: PlanOptions
) -> Plan:
    """The hand plan ``kind`` (``hand_plans.KINDS``) of ``model`` on ``mesh_shape``, priced under
    ``options`` (``compute`` as in ``plan_traced``; a hand plan lays out one mesh: no pipeline,
    and no ``symbolic_batch``)."""
    resolve_kind(kind)
    if options.pipeline.enabled or options.symbolic_batch:
        raise ConfigError(
            f"hand_plan({kind!r}) prices one layout on one mesh: options with pipeline={options.pipeline.stages!r}, "
            f"symbolic_batch={options.symbolic_batch!r} are autopar.plan's (or hand_plan('colossal', ...) with "
            "parallel=dict(pipeline=N) for a pipelined layout)"
        )
    if options.compute is not None:
        cluster = dataclasses.replace(cluster, compute=options.compute)
    traced = trace_repeated(model, *examples, options.precision)
    made = solve_hand_plan(kind, traced, mesh_shape, cluster, options)
    return with_notes(traced, with_data_layout(made, traced, options.data))


@quiet_gc()
def plan_colossal(
    model: torch.nn.Module,
    mesh: Sequence[int] | int | None,
    parallel: dict[str, Any],
    examples: Examples,
    cluster: ClusterSpec,
    options: PlanOptions,
    num_microbatches: int | None = None,
) -> Plan:
    """Colossal-AI's layout of ``parallel`` (its parallel config) for ``model`` on ``mesh`` (only
    the world size; None: pipeline × tensor size). Where it pipelines, ``examples`` are the global
    batch, cut into ``num_microbatches`` (None: ``options``', else one per stage) and traced at one."""
    from autopar.solver.planners.colossal import ColossalParallel, solve_colossal  # for Colossal-AI configs only

    world = None if mesh is None else math.prod(parse_mesh(mesh))
    config = ColossalParallel.from_dict(parallel, world)
    count = num_microbatches if num_microbatches is not None else options.pipeline.num_microbatches
    stages = config.pipeline if config.pipeline > 1 else "off"
    options = options.replace(pipeline=PipelineOptions(stages, count, options.pipeline.schedules))
    if options.pipeline.enabled:
        examples = first_microbatch(*examples, options.pipeline.microbatches)
    log.info("%s", config.describe())
    return solve_colossal(config, trace_model(model, *examples, options.precision), cluster, options)


__all__ = ["Examples", "parse_mesh", "plan_model", "trace_model", "plan_hand", "plan_colossal"]
