"""The public entry points: ``autopar.plan`` (offline) and ``autopar.compile`` (distributed)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from autopar.cost.cluster import ClusterSpec, get_cluster, local_cluster, resolve_budget
from autopar.errors import AutoparError, InfeasibleError, MeshError, PlanError
from autopar.ir.data import DataOptions
from autopar.ir.options import (
    CommOptions,
    MemoryOptions,
    MixedPrecision,
    PipelineOptions,
    PlanOptions,
    check_mesh_devices,
    precision_policy,
    to_dtype,
)
from autopar.ir.pipeline import batch_size_of, first_microbatch, stage_mesh_of
from autopar.ir.plan import Plan, validate_plan_json
from autopar.ops import collectives
from autopar.passes import check_plan_matches, default_passes, run_passes
from autopar.passes.plan_check import check_plan_strategies
from autopar.runtime import checkpoint
from autopar.runtime.compiled import check_compiler, graph_runner
from autopar.runtime.materialize import FromCheckpoint, SeededInit, checkpoint_shards, has_meta_tensors, seeded_shards
from autopar.runtime.modes import mode_name, pinned_placements
from autopar.runtime.module import ParallelModule, mesh_groups
from autopar.runtime.offload import Offloader
from autopar.runtime.pipeline import PipelineParallelModule, compile_pipeline
from autopar.runtime.signature import adopt_signature
from autopar.runtime.store import make_store
from autopar.runtime.weights import check_same_weights
from autopar.solver.planners.data import with_data_layout
from autopar.solver.planners.hand_plans import resolve_kind, solve_hand_plan
from autopar.solver.planners.mesh_search import search_mesh
from autopar.solver.planners.sharding import solve_unexplained
from autopar.solver.planners.split_batch import split_batch_at_least
from autopar.solver.pricing import symbolic
from autopar.trace import TracedModel, trace, trace_repeated

log = logging.getLogger("autopar")


def _mesh_shape(mesh: Sequence[int] | int) -> tuple[int, ...]:
    if isinstance(mesh, int):
        mesh = (mesh,)
    try:
        shape = tuple(int(n) for n in mesh)
    except (TypeError, ValueError):
        raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), got {mesh!r}") from None
    if not shape or any(n < 1 for n in shape) or any(int(a) != a for a in mesh):
        raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), got {mesh!r}")
    return shape


def plan(
    model: torch.nn.Module,
    mesh: Sequence[int] | int | str = "auto",
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    cluster: str | ClusterSpec | os.PathLike | None = None,
    memory_budget: float | None = None,
    time_limit_s: float = 60.0,
    devices: int | None = None,
    max_axes: int = 3,
    symbolic_batch: bool = False,
    compute: str | None = None,
    solver: str = "auto",
    pipeline: str | int = "off",
    num_microbatches: int | str | None = None,
    pipeline_schedules: str | Sequence[str] = ("1F1B",),
    offload: str = "off",
    checkpointing: bool | str | None = None,
    prefetch: bool = True,
    precision: str | MixedPrecision | None = None,
    comm: CommOptions | None = None,
    compiler: str | None = None,
    data: DataOptions | None = None,
) -> Plan:
    """Choose a sharding for every op of ``model`` on ``mesh`` (a tuple of axis sizes, or "auto"
    with ``devices=N``) and return the ``Plan``. Needs no process group and no devices.

    Each keyword is one option, described in docs/api.md: ``cluster`` and ``memory_budget``
    (docs/memory.md), the solver's ``time_limit_s`` and ``solver``, the mesh search's ``devices``
    and ``max_axes``, ``symbolic_batch`` and ``compute`` (docs/cost-model.md), ``pipeline``,
    ``num_microbatches`` and ``pipeline_schedules`` (docs/pipelines.md), ``offload``,
    ``checkpointing`` and ``prefetch`` (docs/memory.md), ``precision`` (docs/precision.md), and
    ``comm``, ``compiler`` and ``data``, which ``compile`` runs under (docs/training.md).
    """
    check_compiler(compiler)
    options = PlanOptions.from_keywords(
        memory_budget=memory_budget,
        time_limit_s=time_limit_s,
        solver=solver,
        pipeline=pipeline,
        num_microbatches=num_microbatches,
        offload=offload,
        checkpointing=checkpointing,
        prefetch=prefetch,
        pipeline_schedules=pipeline_schedules,
        devices=devices,
        max_axes=max_axes,
        symbolic_batch=symbolic_batch,
        compute=compute,
        precision=precision,
        comm=comm or CommOptions(),
        data=data or DataOptions(),
    )
    spec = priced_for(get_cluster(cluster), compiler) if compiler else get_cluster(cluster)
    return plan_model(model, mesh, example_inputs, example_kwargs, spec, options)


@contextlib.contextmanager
def quiet_gc():
    """Leave the objects that exist now out of the garbage collector's passes until the block ends.

    Tracing and planning allocate hundreds of thousands of objects, and every so many of them
    Python runs a full collection, which walks every object in the process: torch's, a model's
    modules, whatever the caller holds. On a 48-layer LLaMA that was 0.3-0.8 s of a 3-5 s plan,
    more the larger the process. ``gc.freeze`` moves what exists into a generation that no pass
    walks (nothing is lost: what becomes garbage in there is collected after ``gc.unfreeze``),
    so that the passes during planning walk only what planning made. Full collections are held
    off until the block ends as well (the young generations are still collected): planning
    keeps what it makes until it returns, and each full pass walked all of it again, 0.7-1 s of
    a 4 s plan of LLaMA-3-8B on (8, 2, 4), whose ILP has 10^5 variables. A caller that froze
    objects itself, or turned the collector off, is left as it is. Tracing and ``plan_traced``
    run under it (a decorator as well as a context manager); a block inside another does nothing
    (``gc.get_freeze_count`` walks every frozen object: 35 ms a plan, asked inside the outer block)."""
    if _QUIET_DEPTH[0] or not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(thresholds[0], thresholds[1], _NO_FULL_COLLECTIONS)
    _QUIET_DEPTH[0] += 1
    try:
        yield
    finally:
        _QUIET_DEPTH[0] -= 1
        gc.set_threshold(*thresholds)
        gc.unfreeze()


# Collections of the middle generation before a full one, within ``quiet_gc``: never, in practice.
_NO_FULL_COLLECTIONS = 1 << 30
# How many ``quiet_gc`` blocks that froze the heap are open (one at most).
_QUIET_DEPTH = [0]


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
    ``plan_traced`` or the stage planner, in ``_resolve_plan``.)"""
    if options.compute is not None:
        cluster = dataclasses.replace(cluster, compute=options.compute)
    if options.pipeline.enabled:
        return _plan_pipeline(model, mesh, example_inputs, example_kwargs, cluster, options)
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
        traced = _trace(model, example_inputs, example_kwargs, options.precision)
        return search_mesh(traced, options.devices, cluster, options, plan_traced_unexplained, on_progress=on_progress)
    mesh_shape = _mesh_shape(mesh)
    check_mesh_devices(mesh_shape, options.devices)
    traced = _trace(model, example_inputs, example_kwargs, options.precision)
    result = plan_traced(traced, mesh_shape, cluster, options)
    if options.symbolic_batch:
        batch = symbolic.batch_size((example_inputs, example_kwargs))
        doubled = trace_repeated(
            model, symbolic.double_batch(example_inputs), symbolic.double_batch(example_kwargs), options.precision
        )
        costs = symbolic.symbolic_costs(
            symbolic.price_plan(traced, result, cluster),
            symbolic.price_plan(doubled, result, cluster),
            batch,
            result.predicted,
        )
        result = dataclasses.replace(result, predicted=dataclasses.replace(result.predicted, symbolic=costs))
    return result


@quiet_gc()
def _trace(model: torch.nn.Module, example_inputs, example_kwargs, precision: MixedPrecision | None = None) -> TracedModel:
    start = time.perf_counter()
    log.info("tracing ...")
    # A deep model's repeated layers are exported once and copied (``trace.repeat``); ``compile``
    # traces the whole model, and its graph-hash check would refuse a plan made on any other graph.
    traced = trace_repeated(model, example_inputs, example_kwargs, precision)
    log.info("traced %d graph nodes in %.2f s", len(traced.gm.graph.nodes), time.perf_counter() - start)
    return traced


def _plan_pipeline(model, mesh, example_inputs, example_kwargs, cluster: ClusterSpec, options: PlanOptions) -> Plan:
    """A pipelined plan: trace one microbatch and run the stage planner."""
    devices = options.devices
    mesh_shape = None
    if isinstance(mesh, str):
        if mesh != "auto" or devices is None:
            raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), or 'auto' with devices=N, got {mesh!r}")
    else:
        mesh_shape = _mesh_shape(mesh)
        if devices is not None and math.prod(mesh_shape) != devices:
            raise MeshError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices, not devices={devices}: pass one of them")
        if options.pipeline.stages != "auto":
            stage_mesh_of(mesh_shape, options.pipeline.stages)
        devices = None
    if options.pipeline.num_microbatches == "auto":
        return _plan_microbatches(model, mesh_shape, devices, example_inputs, example_kwargs, cluster, options)
    inputs, kwargs = first_microbatch(example_inputs, example_kwargs, options.pipeline.microbatches)
    log.info("tracing one microbatch of %d ...", options.pipeline.microbatches)
    return _plan_stages(_trace(model, inputs, kwargs, options.precision), mesh_shape, devices, cluster, options)


def _plan_microbatches(
    model, mesh_shape, devices, example_inputs, example_kwargs, cluster: ClusterSpec, options: PlanOptions
) -> Plan:
    """``num_microbatches="auto"``: the stage planner at each power-of-two microbatch count that
    divides the batch, smallest first (one trace each), until two in a row are no faster than the
    best; the fastest plan, whose ``pipeline.reason`` lists the counts tried."""
    batch = batch_size_of(example_inputs, example_kwargs)
    counts = [2**k for k in range(batch.bit_length()) if batch % 2**k == 0]
    best: Plan | None = None
    tried: list[str] = []
    worse = 0
    for count in counts:
        inputs, kwargs = first_microbatch(example_inputs, example_kwargs, count)
        trial = options.replace(pipeline=dataclasses.replace(options.pipeline, num_microbatches=count))
        try:
            made = _plan_stages(_trace(model, inputs, kwargs, options.precision), mesh_shape, devices, cluster, trial)
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


def _plan_stages(
    traced: TracedModel, mesh_shape: tuple[int, ...] | None, devices: int | None, cluster: ClusterSpec, options: PlanOptions
) -> Plan:
    """The stage planner on a model traced at one microbatch."""
    from autopar.solver.planners.stages import StageSettings, plan_stages  # loads only for pipelines (start-up speed)

    settings = StageSettings(
        num_microbatches=options.pipeline.microbatches,
        num_stages=options.pipeline.stages,
        memory_budget=resolve_budget(options.memory.budget, cluster),
        time_limit_s=options.solve.time_limit_s,
        devices=devices,
        max_axes=min(options.max_axes, 2),
        remat=options.memory.checkpointing is not False,
        solver=options.solve.solver,
        schedules_allowed=options.pipeline.schedules,
    )
    return _with_notes(traced, plan_stages(traced, mesh_shape, cluster, settings, options.precision))


def _with_notes(traced: TracedModel, made: Plan) -> Plan:
    """``made`` carrying what tracing changed about the model's behaviour (``TracedModel.notes``)."""
    return dataclasses.replace(made, notes=tuple(traced.notes), stats=made.stats) if traced.notes else made


def offload_target(offload: str, cluster: ClusterSpec) -> tuple[str | None, str | None]:
    """(target, disk path) of an ``offload`` argument on ``cluster``: "off" gives (None, None)."""
    return MemoryOptions(offload=offload).offload_target(has_host=cluster.host_link is not None)


@quiet_gc()
def plan_traced(
    traced: TracedModel,
    mesh_shape: tuple[int, ...],
    cluster: ClusterSpec,
    options: PlanOptions,
    forced: dict[str, Any] | None = None,
    data_axes: tuple[int, ...] | None = None,
) -> Plan:
    """Plan an already traced model on one mesh (``autopar.plan`` without the tracing).
    ``forced`` pins placeholders' specs and ``data_axes`` the batch-splitting axes (another mode's
    graph of a compiled module: ``runtime.modes``)."""
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
    return _with_notes(traced, with_data_layout(result, traced, options.data, axes=data_axes)), explained


def priced_for(cluster: ClusterSpec, compiler: str | None) -> ClusterSpec:
    """``cluster`` with the executor that runs ``compiler``'s graph (``ClusterSpec.executor``)."""
    return dataclasses.replace(cluster, executor="inductor" if compiler == "inductor" else "eager")


@quiet_gc()
def hand_plan(
    kind: str,
    model: torch.nn.Module,
    mesh: Sequence[int] | int | None = None,
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    cluster: str | ClusterSpec | os.PathLike | None = None,
    memory_budget: float | None = None,
    precision: str | MixedPrecision | None = None,
    parallel: dict[str, Any] | None = None,
    num_microbatches: int | None = None,
    comm: CommOptions | None = None,
    data: DataOptions | None = None,
    offload: str = "off",
    checkpointing: bool | str | None = False,
    prefetch: bool = True,
) -> Plan:
    """The hand plan ``kind`` (``autopar.solver.planners.hand_plans.KINDS``: "ddp", "fsdp", "megatron", ...)
    for ``model`` on ``mesh``, as a Plan priced by autopar's model (``memory_budget``,
    ``precision``, ``offload``, ``checkpointing`` and ``prefetch`` as in ``autopar.plan``).
    ``checkpointing`` is False by default here: a hand plan is the layout as written, so it
    recomputes only what it is told to, such as ``checkpointing="selective"`` (torchtitan's
    op-level policy on every layer) or ``"full"`` (docs/memory.md).

    ``kind="colossal"`` reads Colossal-AI's ``parallel`` dict instead of a layout name, for example
    ``parallel=dict(pipeline=2, tensor=dict(mode="2.5d", depth=1, size=4))``, and builds its mesh,
    stages and 1D / 2D / 2.5D / 3D tensor layout (``autopar.solver.planners.colossal``); ``mesh`` is then
    only the world size (an int or a mesh whose product it is; None: pipeline × tensor size), the
    rest being data parallel. With a pipeline, the example inputs are the global batch, cut into
    ``num_microbatches`` (default: the number of stages).

    ``comm`` (``autopar.CommOptions``) is the parameter schedule it is priced for, as in ``autopar.plan``.

    It can be saved, inspected and compiled like any plan, which gives real baselines. ``data``
    is ``autopar.plan``'s.
    """
    if kind == "colossal":
        memory = MemoryOptions(memory_budget, offload, checkpointing, prefetch)
        return _colossal_plan(
            model, mesh, parallel, example_inputs, example_kwargs, cluster, memory, precision, num_microbatches, comm
        )
    if parallel is not None:
        raise ValueError(f"parallel= is Colossal-AI's config, for hand_plan('colossal', ...), not {kind!r}")
    if mesh is None:
        raise MeshError(f"hand_plan({kind!r}) needs a mesh such as (2, 4)")
    mesh_shape = tuple(int(n) for n in mesh)
    resolve_kind(kind)
    policy = precision_policy(precision)
    traced = trace_repeated(model, example_inputs, example_kwargs, policy)
    cluster_spec = get_cluster(cluster)
    made = solve_hand_plan(
        kind,
        traced,
        mesh_shape,
        cluster_spec,
        PlanOptions.from_keywords(
            memory_budget=memory_budget,
            offload=offload,
            checkpointing=checkpointing,
            prefetch=prefetch,
            precision=policy,
            comm=comm or CommOptions(),
        ),
    )
    return _with_notes(traced, with_data_layout(made, traced, data or DataOptions()))


def _colossal_plan(
    model, mesh, parallel, example_inputs, example_kwargs, cluster, memory: MemoryOptions, precision, num_microbatches, comm
) -> Plan:
    from autopar.solver.planners.colossal import ColossalParallel, solve_colossal  # for Colossal-AI configs only

    if parallel is None:
        raise ValueError(
            "hand_plan('colossal', ...) needs parallel=dict(...), Colossal-AI's parallel config, "
            "such as dict(pipeline=2, tensor=dict(mode='2d', size=4))"
        )
    world = None if mesh is None else math.prod(_mesh_shape(mesh))
    config = ColossalParallel.from_dict(parallel, world)
    pipelined = config.pipeline > 1
    options = PlanOptions.from_keywords(
        memory_budget=memory.budget,
        offload=memory.offload,
        checkpointing=memory.checkpointing,
        prefetch=memory.prefetch,
        precision=precision_policy(precision),
        comm=comm or CommOptions(),
        pipeline=config.pipeline if pipelined else "off",
        num_microbatches=num_microbatches,
    )
    if pipelined:
        example_inputs, example_kwargs = first_microbatch(example_inputs, example_kwargs, options.pipeline.microbatches)
    log.info("%s", config.describe())
    traced = _trace(model, example_inputs, example_kwargs, options.precision)
    return solve_colossal(config, traced, get_cluster(cluster), options)


def compile(
    model: torch.nn.Module,
    mesh: Sequence[int] | int,
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    plan: Plan | str | os.PathLike | None = None,
    cluster: str | ClusterSpec | os.PathLike | None = None,
    memory_budget: float | None = None,
    time_limit_s: float = 60.0,
    init: SeededInit | FromCheckpoint | None = None,
    pipeline: str | int = "off",
    num_microbatches: int | str | None = None,
    pipeline_schedules: str | Sequence[str] = ("1F1B",),
    offload: str = "off",
    checkpointing: bool | str | None = None,
    prefetch: bool = True,
    precision: str | MixedPrecision | None = None,
    comm: CommOptions | None = None,
    compiler: str | None = None,
    data: DataOptions | None = None,
    weights: str = "broadcast",
) -> ParallelModule | PipelineParallelModule:
    """Plan (or take ``plan``) and rewrite ``model`` into this rank's ParallelModule.

    Runs under an initialized ``torch.distributed`` process group whose world size is the mesh
    size; every rank calls it with the same model and example inputs. The planning keywords are
    ``autopar.plan``'s; ``plan`` (a Plan or a plan file) is run instead of solving; ``init``
    makes each rank materialize only its own shards (docs/checkpoints.md); ``weights``
    ("broadcast", DDP's way, or "check") is what happens where ranks hold different weights
    (``runtime.weights``). Each keyword is described in docs/api.md, and the module in
    docs/training.md.
    """
    mesh_shape = _check_call(model, mesh, init, comm, compiler, weights)
    split_batch = cluster is None  # the local default splits the batch at least (solver.planners.split_batch)
    # None: price the machine this runs on (its CUDA device's preset, or "cpu-gloo")
    cluster = priced_for(get_cluster(local_cluster() if cluster is None else cluster), compiler)
    plan = Plan.load(plan) if plan is not None and not isinstance(plan, Plan) else plan
    policy = _precision_of(plan, precision)
    _check_backend_dtypes(model, example_inputs, example_kwargs, policy)
    options = _pipeline_of(
        plan,
        PlanOptions.from_keywords(
            memory_budget=memory_budget,
            time_limit_s=time_limit_s,
            pipeline=pipeline,
            num_microbatches=num_microbatches,
            pipeline_schedules=pipeline_schedules,
            offload=offload,
            checkpointing=checkpointing,
            prefetch=prefetch,
            precision=policy,
            comm=comm or CommOptions(),
            data=_data_of(plan, data),
        ),
    )
    _check_compile_options(options, policy, compiler, offload)
    examples = (example_inputs, example_kwargs)
    if options.pipeline.enabled:
        module = _compile_pipeline(model, examples, plan, mesh_shape, cluster, options, policy, init)
    else:
        # Meta tensors become FakeTensors there; under a precision policy, parameters are traced in
        # param_dtype and cast from their master dtype at use, as when planning.
        with quiet_gc():
            traced = trace(model, example_inputs, example_kwargs, policy)
        chosen = _resolve_plan(plan, traced, mesh_shape, cluster, options, split_batch=split_batch)
        check_rank_agreement(chosen)
        module = _materialize(model, examples, traced, chosen, cluster, options, init, comm, compiler)
    _free_traced(model)
    return module


# The weights' size from which compile collects what tracing left (``_free_traced``).
FREE_AFTER_TRACE_BYTES = 256 * 2**20


def _free_traced(model: torch.nn.Module) -> None:
    """Tracing leaves reference cycles that reach ``model``, which ``quiet_gc`` moved to the oldest
    generation: a caller who drops the model would keep a whole copy of its weights (on a GPU, in
    device memory) until Python's next full pass. One full collection frees them at once; it
    costs 0.1-0.3 s, so it runs where the weights are on an accelerator or large."""
    tensors = [*model.parameters(), *model.buffers()]
    real = [t for t in tensors if t.device.type != "meta"]
    size = sum(t.numel() * t.element_size() for t in real)
    if any(t.device.type != "cpu" for t in real) or size >= FREE_AFTER_TRACE_BYTES:
        gc.collect()


def _check_call(
    model: torch.nn.Module, mesh, init, comm: CommOptions | None, compiler: str | None, weights: str = "broadcast"
) -> tuple[int, ...]:
    """``compile``'s checks before anything is traced: its arguments, the process group, and that
    every rank holds the same model; the mesh shape."""
    check_compiler(compiler)
    if comm is not None and not isinstance(comm, CommOptions):
        raise TypeError(f"comm must be an autopar.CommOptions, got {comm!r}")
    mesh_shape = _check_world(_mesh_shape(mesh))
    _check_init(model, init)
    collectives.register_peer()  # lets a failed collective name a dead rank
    check_same_weights(model, init, weights)  # every rank cuts its shards from its own copy of the model
    return mesh_shape


def _materialize(
    model: torch.nn.Module,
    examples: tuple[tuple[Any, ...], dict[str, Any] | None],
    traced: TracedModel,
    chosen: Plan,
    cluster: ClusterSpec,
    options: PlanOptions,
    init,
    comm: CommOptions | None,
    compiler: str | None,
) -> ParallelModule:
    """This rank's module of ``chosen``: the rewritten graph, its shards (cut, seeded or read from
    a checkpoint), the builder of its other mode, and the compiled graph under ``compiler``."""
    example_inputs, example_kwargs = examples
    mesh_shape = tuple(chosen.mesh_shape)
    _check_precision_runs(options.precision)
    groups, coordinate = mesh_groups(mesh_shape)
    offloader = _offloader(chosen, options.memory.offload, example_inputs, example_kwargs)
    if compiler is not None and offloader is not None:
        raise ValueError(f"the plan offloads, which compiler={compiler!r} does not run yet: compile without compiler=")
    gm, comm = _rewrite(traced, chosen, groups, offloader, comm, compiler)
    local = _initial_shards(model, init, chosen, coordinate, mesh_shape)
    build_mode = _mode_builder(
        _meta_copy(model), examples, chosen, mesh_shape, cluster, options, groups, comm, offloads=offloader is not None
    )
    pm = ParallelModule(
        model,
        traced,
        gm,
        chosen,
        groups,
        coordinate,
        local_shards=local,
        offloader=offloader,
        build_mode=build_mode,
        training=model.training,
    )
    if isinstance(init, FromCheckpoint):
        checkpoint.load(init.path, pm)
    pm._compiled_graph = graph_runner(gm, compiler, comm)
    adopt_signature(pm, model)  # HF Trainer keeps the columns the forward names (runtime.signature)
    return pm


def _check_world(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``mesh_shape``, once an initialized process group of its size is there to run it."""
    if not dist.is_available() or not dist.is_initialized():
        raise MeshError(
            "autopar.compile needs an initialized process group: run under torchrun and call "
            "torch.distributed.init_process_group(backend, timeout=...) first, or use autopar.plan "
            "to plan without one"
        )
    world = dist.get_world_size()
    if math.prod(mesh_shape) != world:
        raise MeshError(
            f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices but the world size is {world}: "
            f"pass a mesh whose sizes multiply to {world}"
        )
    return mesh_shape


def _check_init(model: torch.nn.Module, init: SeededInit | FromCheckpoint | None) -> None:
    """A model on the meta device holds no values: it needs ``init=`` to say where they come from."""
    if init is None and has_meta_tensors(model):
        raise ValueError(
            f"{type(model).__name__} has tensors on the meta device, which hold no values: pass "
            "init=autopar.SeededInit(seed) to initialize each rank's shards with the modules' own "
            "reset_parameters (and SeededInit(seed, fn=...) for a custom init), or "
            "init=autopar.FromCheckpoint(path) to read them from an autopar checkpoint"
        )
    if init is not None and not isinstance(init, (SeededInit, FromCheckpoint)):
        raise TypeError(f"init must be None, autopar.SeededInit(...) or autopar.FromCheckpoint(path), got {init!r}")


def _check_compile_options(options: PlanOptions, policy: MixedPrecision, compiler: str | None, offload: str) -> None:
    """What ``compile`` cannot run yet, refused before any tracing."""
    if options.pipeline.num_microbatches == "auto":
        raise ValueError(
            "num_microbatches='auto' searches microbatch counts offline, one trace each: plan with "
            "autopar.plan(..., num_microbatches='auto') and compile with plan=, or give a number"
        )
    _check_precision_runs(policy)
    if compiler is not None and (options.pipeline.enabled or offload != "off"):
        raise ValueError(
            f"compiler={compiler!r} does not run pipelines or offloading yet (their schedules live in "
            "autograd hooks): compile without compiler=, or without pipeline=/offload="
        )


def _compile_pipeline(
    model,
    examples: tuple[tuple[Any, ...], dict[str, Any] | None],
    plan: Plan | None,
    mesh_shape: tuple[int, ...],
    cluster: ClusterSpec,
    options: PlanOptions,
    policy: MixedPrecision,
    init,
) -> PipelineParallelModule:
    """``compile``'s pipelined branch: trace one microbatch of ``examples`` (inputs, kwargs), plan
    (or take ``plan``), build the stages."""
    inputs, kwargs = first_microbatch(*examples, options.pipeline.microbatches)
    with quiet_gc():
        traced = trace(model, inputs, kwargs, policy)
    chosen = _resolve_plan(plan, traced, mesh_shape, cluster, options)
    check_rank_agreement(chosen)
    pm = compile_pipeline(model, traced, chosen, init)  # init: only this rank's stages' shards
    if isinstance(init, FromCheckpoint):
        checkpoint.load(init.path, pm)
    return pm


def _param_fqns(traced: TracedModel) -> dict[str, str]:
    """Parameter placeholder name -> the parameter's canonical FQN (the first of tied names)."""
    return {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}


def _rewrite(
    traced: TracedModel, chosen: Plan, groups: tuple[str, ...], offloader, comm: CommOptions | None, compiler: str | None
) -> tuple[torch.fx.GraphModule, CommOptions | None]:
    """The rewritten graph of ``traced`` under ``chosen`` (``passes.default_passes``), and the
    communication options it was scheduled with."""
    if offloader is not None:
        # The buckets put reduced gradients into .grad at the end of backward, after the point
        # where the offloader's gradient hooks move offloaded gradients to their store; until
        # the two are joined, a plan that offloads runs one collective per use (correct numbers).
        comm = dataclasses.replace(comm or CommOptions(), enabled=False)
    collectives.remember_groups(groups)  # read while tracing, where no process group is resolved
    passes = default_passes(groups, offloader, _param_fqns(traced), comm, compiler)
    return run_passes(copy.deepcopy(traced.gm), chosen, passes), comm


def _initial_shards(model: torch.nn.Module, init, chosen: Plan, coordinate: tuple[int, ...], mesh_shape: tuple[int, ...]):
    """This rank's shards made by ``init`` (None: the module cuts them from ``model``'s tensors)."""
    if isinstance(init, SeededInit):
        return seeded_shards(model, init, chosen.params, coordinate, mesh_shape)
    if isinstance(init, FromCheckpoint):  # filled by checkpoint.load once the module exists
        return checkpoint_shards(model, init, chosen.params, coordinate, mesh_shape)
    return None


def _data_of(plan: Plan | None, data: DataOptions | None) -> DataOptions:
    """The data options to run: the plan's (which ``data``, where given, must agree with), else ``data``'s."""
    if data is not None and not isinstance(data, DataOptions):
        raise TypeError(f"data must be an autopar.DataOptions, got {data!r}")
    if plan is None:
        return data or DataOptions()
    recorded = DataOptions(plan.data_layout.batch)
    if data is not None and data != recorded:
        raise PlanError(
            f"data=DataOptions(batch={data.batch!r}) contradicts the plan, which was made for batch={recorded.batch!r}: "
            f"drop data= to run the plan as it is, or re-plan with autopar.plan(..., data=DataOptions(batch={data.batch!r}))"
        )
    return recorded


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its parameters and buffers on the meta device, sharing nothing with it and
    copying no values (``deepcopy`` with them pre-made), to trace its other mode later. A
    model that cannot be copied is kept as it is."""
    memo: dict[int, Any] = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in memo:
            continue
        meta = tensor.detach().to("meta")
        memo[id(tensor)] = (
            torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) if isinstance(tensor, torch.nn.Parameter) else meta
        )
    try:
        return copy.deepcopy(model, memo)
    except Exception:  # noqa: BLE001 - any failure to copy: trace the model itself later
        return model


def _mode_builder(
    model: torch.nn.Module,
    examples: tuple[tuple[Any, ...], dict[str, Any] | None],
    chosen: Plan,
    mesh_shape,
    cluster,
    options: PlanOptions,
    groups,
    comm: CommOptions | None,
    offloads: bool,
):
    """The builder of the compiled module's other mode (``runtime.modes``) and of its graphs for
    other input shapes (``runtime.shapes``): trace ``model`` in that mode, plan it with every
    parameter and buffer pinned to ``chosen``'s placements and the batch split on ``chosen``'s
    axes (rank 0 solves, as in ``compile``), and rewrite it."""
    example_inputs, example_kwargs = examples

    def build(training: bool, examples: tuple[tuple[Any, ...], dict[str, Any] | None] | None = None):
        # ``examples``: a call's inputs of other shapes (runtime.shapes), else the example inputs
        inputs, kwargs = examples if examples is not None else (example_inputs, example_kwargs)
        if offloads:
            raise PlanError(
                f"pm.{mode_name(training)}(): this plan offloads, and another mode's graph of an offloading plan "
                f"is not built yet: run the module in the mode it was compiled in ({mode_name(not training)}), or "
                "compile with offload='off'"
            )
        was = model.training
        model.train(training)
        try:
            with quiet_gc():
                traced = trace(model, inputs, kwargs, options.precision)
        finally:
            model.train(was)
        forced = pinned_placements(traced, chosen)
        made = _resolve_plan(None, traced, mesh_shape, cluster, options, forced=forced, data_axes=chosen.data_layout.axes)
        check_rank_agreement(made)
        mode_fqns = _param_fqns(traced)
        gm = run_passes(copy.deepcopy(traced.gm), made, default_passes(groups, None, mode_fqns, comm))
        return traced, gm, made

    return build


def _precision_of(plan: Plan | None, precision: str | MixedPrecision | None) -> MixedPrecision:
    """The policy to run: the plan's (which ``precision``, where given, must agree with), else
    ``precision``'s."""
    if plan is None:
        return precision_policy(precision)
    recorded = plan.precision or precision_policy(None)
    if precision is not None and _dtypes_of(precision_policy(precision)) != _dtypes_of(recorded):
        raise PlanError(
            f"precision={precision_policy(precision).name!r} contradicts the plan, which was made for "
            f"precision={recorded.name!r} ({recorded.to_json()}): drop precision= to run the plan as it "
            "is, or re-plan with the precision you want"
        )
    return recorded


def _dtypes_of(policy: MixedPrecision) -> dict[str, Any]:
    return {key: value for key, value in policy.to_json().items() if key != "name"}


def _check_precision_runs(policy: MixedPrecision) -> None:
    """What the runtime carries out of a precision policy (README, "Mixed precision"): parameters
    stored in ``stored_dtype`` (the master dtype, or ``param_dtype`` without one), cast to
    ``param_dtype`` at use, floating inputs cast to ``param_dtype``, and parameter gradients
    reduced in ``reduce_dtype`` and landing in the stored dtype (``passes.precision``). A policy
    (or plan) that asks for more is refused."""
    if policy.param_dtype is None:
        return
    stored = policy.stored_dtype
    reduce_dtype = policy.reduce_dtype or policy.param_dtype
    if reduce_dtype != stored and not policy.casts:
        raise PlanError(
            f"precision={policy.name!r} reduces gradients in {reduce_dtype} but stores parameters in {stored} "
            f"and keeps no master copy: the runtime reduces in another dtype than the stored one only for "
            f"master weights, so pass master_dtype={reduce_dtype!r} (fp32 masters, as 'bf16-mixed'), or "
            f"reduce_dtype={stored!r}"
        )
    if reduce_dtype != stored and reduce_dtype == "float16":
        raise PlanError(
            f"precision={policy.name!r} reduces gradients in float16 but stores parameters in {stored}: float16 "
            "sums of gradients can overflow or underflow where bfloat16 (float32's exponent range) cannot, and "
            "the runtime does not split the division by the world size around the reduction as FSDP2 does for "
            "float16; pass reduce_dtype='bfloat16' or reduce_dtype='float32'"
        )


def _offloader(chosen: Plan, offload: str, example_inputs, example_kwargs):
    """The store and hooks for a plan that offloads (None for one that does not)."""
    if chosen.memory is None or not (chosen.memory.offload or chosen.memory.offload_activations):
        return None
    path = offload.partition(":")[2] if isinstance(offload, str) and offload.startswith("disk:") else None
    if path is not None:
        path = os.path.join(path, f"rank{dist.get_rank()}")
    leaves = [t for t in torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {})) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    return Offloader(chosen.memory, make_store(chosen.memory.target, path, device))


_REDUCES: dict[tuple[str, torch.dtype], bool] = {}


def _backend_reduces(backend: str, dtype: torch.dtype) -> bool:
    """Whether the default process group's ``backend`` sums ``dtype``, tried once per process
    with a one-element all-reduce (``compile`` runs on every rank, so every rank tries it).
    gloo builds without bfloat16 or float16 reject the dtype before communicating ("Invalid
    scalar type", pytorch/pytorch#111131), alike on every rank; torch 2.13's gloo sums both.
    Only gloo is tried: NCCL sums every floating dtype autopar plans."""
    if backend != "gloo" or dtype in (torch.float32, torch.float64):
        return True
    if (backend, dtype) not in _REDUCES:
        try:
            dist.all_reduce(torch.zeros(1, dtype=dtype))
            _REDUCES[backend, dtype] = True
        except RuntimeError:
            _REDUCES[backend, dtype] = False
    return _REDUCES[backend, dtype]


def _check_backend_dtypes(model: torch.nn.Module, example_inputs, example_kwargs, policy: MixedPrecision) -> None:
    """Refuse floating dtypes the backend cannot sum: those of the model's tensors and inputs,
    and the policy's compute and reduction dtypes (activations and gradients are summed in them)."""
    backend = str(dist.get_backend())
    leaves = torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {}))
    named = [(f"parameter {n}", t.dtype) for n, t in model.named_parameters()]
    named += [(f"buffer {n}", t.dtype) for n, t in model.named_buffers()]
    named += [(f"input {i}", t.dtype) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    named += [
        (f"precision={policy.name!r}'s {field}", to_dtype(getattr(policy, field)))
        for field in ("param_dtype", "reduce_dtype")
        if getattr(policy, field) is not None
    ]
    for name, dtype in named:
        if dtype.is_floating_point and not _backend_reduces(backend, dtype):
            raise ValueError(
                f"{name} is {dtype}, which the {backend} backend cannot reduce in this torch build: use float32 "
                f"(model.float(), precision='32-true') when running on {backend}, a torch whose {backend} sums "
                f"{dtype} (2.13 does), or NCCL on GPUs"
            )


def _pipeline_of(plan: Plan | None, options: PlanOptions) -> PlanOptions:
    """The pipeline options of a given plan, checked against the ones asked for (``options``
    as they are without a plan)."""
    if plan is None:
        return options
    asked = options.pipeline
    given = (plan.pipeline.num_stages, plan.pipeline.num_microbatches) if plan.pipeline is not None else None
    if asked.enabled and (
        given is None
        or (asked.stages != "auto" and given != (asked.stages, asked.microbatches))
        or (asked.stages == "auto" and asked.num_microbatches not in (None, "auto", given[1]))
    ):
        has = f"has {given[0]} stages and {given[1]} microbatches" if given else "does not pipeline"
        raise PlanError(
            f"pipeline={asked.stages!r}, num_microbatches={asked.num_microbatches!r} contradicts the plan, which {has}: "
            "drop pipeline and num_microbatches to run the plan as it is, or re-plan"
        )
    return options.replace(pipeline=PipelineOptions(*given)) if given else options


def _resolve_plan(
    plan: Plan | None,
    traced: TracedModel,
    mesh_shape: tuple[int, ...],
    cluster,
    options: PlanOptions,
    forced: dict[str, Any] | None = None,
    data_axes: tuple[int, ...] | None = None,
    split_batch: bool = False,
) -> Plan:
    if plan is None:
        # Rank 0 solves and broadcasts; the solve is deterministic, but eight identical solves
        # on one host would only compete for its cores. A failure is broadcast too, so that
        # every rank raises it now instead of waiting out the process-group timeout.
        payload: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                if options.pipeline.enabled:  # ``traced`` is one microbatch
                    made = _plan_stages(traced, mesh_shape, None, get_cluster(cluster), options)
                else:
                    made = plan_traced(traced, mesh_shape, get_cluster(cluster), options, forced, data_axes)
                    if split_batch:
                        made = split_batch_at_least(
                            made, traced, lambda pins: plan_traced(traced, mesh_shape, get_cluster(cluster), options, pins)
                        )
                text = made.to_json()
                validate_plan_json(json.loads(text))  # once, here: every rank parses these same bytes
                payload[0] = ("plan", text)
            except Exception as error:
                payload[0] = ("error", error)
        collectives.call_on_world("plan broadcast", dist.broadcast_object_list, payload, src=0)
        kind, value = payload[0]
        if kind == "error":
            if dist.get_rank() == 0:
                raise value
            raise (
                type(value)(f"{value}\n(planned on rank 0)")
                if isinstance(value, AutoparError)
                else RuntimeError(f"planning failed on rank 0: {type(value).__name__}: {value}")
            )
        chosen = Plan.from_json(value, validate=False)  # checked on rank 0 before the broadcast
    else:
        chosen = plan
    check_plan_matches(chosen, traced, mesh_shape)
    if plan is not None:  # the user's plan may be hand-edited: every choice one the solver could make
        check_plan_strategies(chosen, traced)
    return chosen


def check_rank_agreement(chosen: Plan) -> None:
    """Every rank must run the same plan; a mismatch is an error on every rank, not a hang."""
    hashes: list[Any] = [None] * dist.get_world_size()
    collectives.call_on_world("plan hash check", dist.all_gather_object, hashes, chosen.hash)
    if len(set(hashes)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(hashes):
            groups.setdefault(value, []).append(rank)
        detail = "; ".join(f"plan {h} on ranks {r}" for h, r in groups.items())
        raise PlanError(f"ranks hold different plans ({detail}): give every rank the same plan file and model")
