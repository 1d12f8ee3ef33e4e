"""The public entry points: ``autopar.plan`` (offline), ``autopar.compile`` (distributed) and
``autopar.hand_plan``. Each checks its arguments, makes one ``PlanOptions`` of its keywords (or
takes ``options=`` whole), and calls down: the planning dispatch in ``solver.planners.dispatch``,
the module's assembly in ``runtime.build``."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from autopar.cost.cluster import ClusterSpec, get_cluster, local_cluster
from autopar.errors import ConfigError, ConfigTypeError, MeshError
from autopar.ir.data import DataOptions
from autopar.ir.given_plan import options_for_plan
from autopar.ir.options import (
    CheckpointPolicy,
    CommOptions,
    ComputeMode,
    MixedPrecision,
    OffloadTarget,
    PipelineStages,
    PlanOptions,
    PrecisionName,
    ScheduleName,
    SolverName,
    check_mesh_devices,
    precision_policy,
)
from autopar.ir.plan import Plan
from autopar.runtime.agreement import check_rank_agreement
from autopar.runtime.build import build_module
from autopar.runtime.compile_checks import check_backend_dtypes, check_call, check_compile_options
from autopar.runtime.compiled import check_compiler
from autopar.runtime.materialize import FromCheckpoint, SeededInit
from autopar.runtime.module import ParallelModule
from autopar.runtime.pipeline import PipelineParallelModule
from autopar.solver.planners.dispatch import parse_mesh, plan_colossal, plan_hand, plan_model
from autopar.solver.planners.quiet_gc import quiet_gc
from autopar.solver.planners.traced import offload_target, plan_traced, plan_traced_unexplained, priced_for

# What this module held before the planning dispatch moved to solver/planners/ and the module's
# assembly to runtime/, importable from here as before.
__all__ = [
    "plan",
    "compile",
    "hand_plan",
    "plan_model",
    "plan_traced",
    "plan_traced_unexplained",
    "quiet_gc",
    "priced_for",
    "offload_target",
    "check_rank_agreement",
]

# ``options=`` beside keywords: the keyword shortcut and the one value (``PlanOptions.of``).
Options = PlanOptions | None
Cluster = str | ClusterSpec | os.PathLike | None
Precision = PrecisionName | MixedPrecision | None


def plan(
    model: torch.nn.Module,
    mesh: Sequence[int] | int | Literal["auto"] = "auto",
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    cluster: Cluster = None,
    memory_budget: float | str | None = None,
    time_limit_s: float = 60.0,
    devices: int | None = None,
    max_axes: int = 3,
    symbolic_batch: bool = False,
    compute: ComputeMode | None = None,
    solver: SolverName = "auto",
    pipeline: PipelineStages | int = "off",
    num_microbatches: int | Literal["auto"] | None = None,
    pipeline_schedules: ScheduleName | Sequence[ScheduleName] | Literal["auto"] = ("1F1B",),
    offload: OffloadTarget | str = "off",
    checkpointing: bool | CheckpointPolicy | None = None,
    prefetch: bool = True,
    precision: Precision = None,
    comm: CommOptions | None = None,
    compiler: Literal["inductor"] | None = None,
    data: DataOptions | None = None,
    optimizer: str = "adamw",
    options: Options = None,
) -> Plan:
    """Choose a sharding for every op of ``model`` on ``mesh`` (a tuple of axis sizes, or "auto"
    with ``devices=N``) and return the ``Plan``. Needs no process group and no devices.

    Each keyword is one option, described in docs/api.md: ``cluster`` and ``memory_budget``
    (docs/memory.md), the solver's ``time_limit_s`` and ``solver``, the mesh search's ``devices``
    and ``max_axes``, ``symbolic_batch`` and ``compute`` (docs/cost-model.md), ``pipeline``,
    ``num_microbatches`` and ``pipeline_schedules`` (docs/pipelines.md), ``offload``,
    ``checkpointing`` and ``prefetch`` (docs/memory.md), ``precision`` (docs/precision.md), and
    ``comm``, ``compiler`` and ``data``, which ``compile`` runs under (docs/training.md), and
    ``optimizer``, the one the training loop steps with ("adamw:fused"; docs/api.md).
    ``options`` (an ``autopar.PlanOptions``) holds all but ``cluster`` and ``compiler`` in one
    value; a keyword given beside it must agree with it.
    """
    check_compiler(compiler)
    keywords = dict(memory_budget=memory_budget, time_limit_s=time_limit_s, solver=solver, pipeline=pipeline)
    keywords.update(num_microbatches=num_microbatches, offload=offload, checkpointing=checkpointing, prefetch=prefetch)
    keywords.update(pipeline_schedules=pipeline_schedules, devices=devices, max_axes=max_axes, symbolic_batch=symbolic_batch)
    keywords.update(compute=compute, precision=precision, comm=comm, data=data, optimizer=optimizer)
    merged = _merged(plan, options, keywords)
    spec = priced_for(get_cluster(cluster), compiler) if compiler else get_cluster(cluster)
    return plan_model(model, mesh, example_inputs, example_kwargs, spec, merged)


def hand_plan(
    kind: str,
    model: torch.nn.Module,
    mesh: Sequence[int] | int | None = None,
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    cluster: Cluster = None,
    memory_budget: float | str | None = None,
    precision: Precision = None,
    parallel: dict[str, Any] | None = None,
    num_microbatches: int | None = None,
    comm: CommOptions | None = None,
    data: DataOptions | None = None,
    offload: OffloadTarget | str = "off",
    checkpointing: bool | CheckpointPolicy | None = False,
    prefetch: bool = True,
    optimizer: str = "adamw",
    options: Options = None,
) -> Plan:
    """The hand plan ``kind`` (``autopar.solver.planners.hand_plans.KINDS``: "ddp", "fsdp", "megatron", ...)
    for ``model`` on ``mesh``, as a Plan priced by autopar's model (``memory_budget``,
    ``precision``, ``offload``, ``checkpointing`` and ``prefetch`` as in ``autopar.plan``).
    ``checkpointing`` is False by default here: a hand plan is the layout as written, so it
    recomputes only what it is told to, such as ``checkpointing="selective-op"`` (torchtitan's
    op-level policy on every layer), ``"selective"`` or ``"full"`` (docs/memory.md).

    ``kind="colossal"`` reads Colossal-AI's ``parallel`` dict instead of a layout name, for example
    ``parallel=dict(pipeline=2, tensor=dict(mode="2.5d", depth=1, size=4))``, and builds its mesh,
    stages and 1D / 2D / 2.5D / 3D tensor layout (``autopar.solver.planners.colossal``); ``mesh`` is then
    only the world size (an int or a mesh whose product it is; None: pipeline × tensor size), the
    rest being data parallel. With a pipeline, the example inputs are the global batch, cut into
    ``num_microbatches`` (default: the number of stages).

    ``comm`` (``autopar.CommOptions``) is the parameter schedule it is priced for, and
    ``optimizer`` the optimizer, as in ``autopar.plan``.

    It can be saved, inspected and compiled like any plan, which gives real baselines. ``data``
    is ``autopar.plan``'s, and ``options`` as well.
    """
    keywords = dict(memory_budget=memory_budget, offload=offload, checkpointing=checkpointing, prefetch=prefetch)
    keywords.update(precision=precision, comm=comm, data=data, optimizer=optimizer)
    merged = _merged(hand_plan, options, keywords)
    examples = (example_inputs, example_kwargs)
    if kind == "colossal":
        if parallel is None:
            raise ConfigError(
                "hand_plan('colossal', ...) needs parallel=dict(...), Colossal-AI's parallel config, "
                "such as dict(pipeline=2, tensor=dict(mode='2d', size=4))"
            )
        return plan_colossal(model, mesh, parallel, examples, get_cluster(cluster), merged, num_microbatches)
    if parallel is not None:
        raise ConfigError(f"parallel= is Colossal-AI's config, for hand_plan('colossal', ...), not {kind!r}")
    if mesh is None:
        raise MeshError(f"hand_plan({kind!r}) needs a mesh such as (2, 4)")
    return plan_hand(kind, model, tuple(int(n) for n in mesh), examples, get_cluster(cluster), merged)


def compile(
    model: torch.nn.Module,
    mesh: Sequence[int] | int,
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    plan: Plan | str | os.PathLike | None = None,
    cluster: Cluster = None,
    memory_budget: float | str | None = None,
    time_limit_s: float = 60.0,
    init: SeededInit | FromCheckpoint | None = None,
    pipeline: PipelineStages | int = "off",
    num_microbatches: int | None = None,
    pipeline_schedules: ScheduleName | Sequence[ScheduleName] | Literal["auto"] = ("1F1B",),
    offload: OffloadTarget | str = "off",
    checkpointing: bool | CheckpointPolicy | None = None,
    prefetch: bool = True,
    precision: Precision = None,
    comm: CommOptions | None = None,
    compiler: Literal["inductor"] | None = None,
    data: DataOptions | None = None,
    weights: Literal["broadcast", "check"] = "broadcast",
    optimizer: str = "adamw",
    options: Options = None,
) -> ParallelModule | PipelineParallelModule:
    """Plan (or take ``plan``) and rewrite ``model`` into this rank's ParallelModule.

    Runs under an initialized ``torch.distributed`` process group whose world size is the mesh
    size; every rank calls it with the same model and example inputs. The planning keywords are
    ``autopar.plan``'s, and so is ``options``; ``plan`` (a Plan or a plan file) is run instead of
    solving; ``init`` makes each rank materialize only its own shards (docs/checkpoints.md);
    ``weights`` ("broadcast", DDP's way, or "check") is what happens where ranks hold different
    weights (``runtime.weights``). Each keyword is described in docs/api.md, and the module in
    docs/training.md.
    """
    if comm is not None and not isinstance(comm, CommOptions):
        raise ConfigTypeError(f"comm must be an autopar.CommOptions, got {comm!r}")
    mesh_shape = check_call(model, parse_mesh(mesh), init, compiler, weights)
    split_batch = cluster is None  # the local default splits the batch at least (solver.planners.split_batch)
    # None: price the machine this runs on (its CUDA device's preset, or "cpu-gloo")
    cluster = priced_for(get_cluster(local_cluster() if cluster is None else cluster), compiler)
    plan = Plan.load(plan) if plan is not None and not isinstance(plan, Plan) else plan
    keywords = dict(memory_budget=memory_budget, time_limit_s=time_limit_s, pipeline=pipeline)
    keywords.update(num_microbatches=num_microbatches, pipeline_schedules=pipeline_schedules, offload=offload)
    keywords.update(checkpointing=checkpointing, prefetch=prefetch, precision=precision, comm=comm, data=data)
    keywords.update(optimizer=optimizer)
    asked = _merged(compile, options, keywords)
    # Beside a plan, a precision or data layout is asked for where given, or where options= holds one of its own.
    precision_asked = precision is not None or asked.precision != precision_policy(None)
    run = options_for_plan(plan, asked, precision_asked, data is not None or asked.data != DataOptions())
    check_mesh_devices(mesh_shape, run.devices)  # options= may hold devices
    check_backend_dtypes(model, example_inputs, example_kwargs, run.precision)
    check_compile_options(run, compiler)
    return build_module(model, (example_inputs, example_kwargs), plan, mesh_shape, cluster, run, init, compiler, split_batch)


def _merged(facade: Callable[..., Any], options: Options, keywords: dict[str, Any]) -> PlanOptions:
    """One ``PlanOptions`` of ``facade``'s keywords and its ``options=`` (``PlanOptions.of``)."""
    defaults = {name: p.default for name, p in inspect.signature(facade).parameters.items() if name in keywords}
    return PlanOptions.of(options, keywords, defaults)
