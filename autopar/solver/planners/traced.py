"""The one planning entry on a traced model: ``plan_traced(traced, mesh_shape, cluster, options)``
returns its ``Plan``, pipelined (the stage planner, on a model traced at one microbatch) or not
(the sharding planner and its memory decisions). ``autopar.plan`` reaches it through
``dispatch.plan_model``; ``compile`` and a compiled module's other modes call it on rank 0."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from autopar.cost.cluster import ClusterSpec
from autopar.ir.options import MemoryOptions, PlanOptions
from autopar.ir.plan import Plan
from autopar.solver.planners.data import with_data_layout
from autopar.solver.planners.quiet_gc import quiet_gc
from autopar.solver.planners.sharding import solve_unexplained
from autopar.solver.planners.split_batch import whole_batch_note
from autopar.trace import TracedModel

log = logging.getLogger("autopar")


@quiet_gc()
def plan_traced(
    traced: TracedModel,
    mesh_shape: tuple[int, ...] | None,
    cluster: ClusterSpec,
    options: PlanOptions,
    forced: dict[str, Any] | None = None,
    data_axes: tuple[int, ...] | None = None,
) -> Plan:
    """Plan an already traced model on one mesh (``autopar.plan`` without the tracing); a
    pipeline where ``options.pipeline`` asks for one (``mesh_shape`` None: any mesh of
    ``options.devices``). ``forced`` pins placeholders' specs and ``data_axes`` the
    batch-splitting axes (another mode's graph of a compiled module: ``runtime.modes``).
    ``options.compute`` overrides the cluster's way of pricing ops."""
    if options.compute is not None:
        cluster = dataclasses.replace(cluster, compute=options.compute)
    if options.pipeline.enabled:
        assert forced is None and data_axes is None, "a pipelined plan pins no specs"
        return plan_pipelined(traced, mesh_shape, cluster, options)
    assert mesh_shape is not None, "an unpipelined plan is made on a mesh"
    plan, explained = plan_traced_unexplained(traced, mesh_shape, cluster, options, forced, data_axes)
    return explained(plan)


@quiet_gc()
def plan_traced_unexplained(
    traced: TracedModel,
    mesh_shape: tuple[int, ...],
    cluster: ClusterSpec,
    options: PlanOptions,
    forced: dict[str, Any] | None = None,
    data_axes: tuple[int, ...] | None = None,
) -> tuple[Plan, Callable[[Plan], Plan]]:
    """``plan_traced`` as (plan without its decisions, the function that explains them:
    ``solver.planners.sharding.solve_unexplained``), for the mesh search, which explains only the
    mesh it chooses."""
    start = time.perf_counter()
    result, explained = solve_unexplained(traced, mesh_shape, cluster, options, forced=forced)
    log.info("autopar: planned %d nodes on mesh %s in %.2f s", len(result.nodes), mesh_shape, time.perf_counter() - start)
    result = dataclasses.replace(result, predicted=dataclasses.replace(result.predicted, executor=cluster.executor))
    result = with_notes(traced, with_data_layout(result, traced, options.data, axes=data_axes))
    return (result if forced else whole_batch_note(result, traced)), explained


def plan_pipelined(traced: TracedModel, mesh_shape: tuple[int, ...] | None, cluster: ClusterSpec, options: PlanOptions) -> Plan:
    """The stage planner on a model traced at one microbatch (``mesh_shape`` None: any mesh of
    ``options.devices``)."""
    from autopar.solver.planners.stages import StageSettings, plan_stages  # loads only for pipelines (start-up speed)

    settings = StageSettings.of(options, cluster, devices=options.devices if mesh_shape is None else None)
    return with_notes(traced, plan_stages(traced, mesh_shape, cluster, settings, options.precision))


def with_notes(traced: TracedModel, made: Plan) -> Plan:
    """``made`` carrying what tracing changed about the model's behaviour (``TracedModel.notes``)."""
    return dataclasses.replace(made, notes=tuple(traced.notes), stats=made.stats) if traced.notes else made


def priced_for(cluster: ClusterSpec, compiler: str | None) -> ClusterSpec:
    """``cluster`` with the executor that runs ``compiler``'s graph (``ClusterSpec.executor``)."""
    return dataclasses.replace(cluster, executor="inductor" if compiler == "inductor" else "eager")


def offload_target(offload: str, cluster: ClusterSpec) -> tuple[str | None, str | None]:
    """(target, disk path) of an ``offload`` argument on ``cluster``: "off" gives (None, None)."""
    return MemoryOptions(offload=offload).offload_target(has_host=cluster.host_link is not None)


__all__ = ["plan_traced", "plan_traced_unexplained", "plan_pipelined", "with_notes", "priced_for", "offload_target"]
