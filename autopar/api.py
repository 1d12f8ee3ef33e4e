"""The public entry points: ``autopar.plan`` (offline) and ``autopar.compile`` (distributed)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autopar import checkpoint, collectives
from autopar.cost.cluster import ClusterSpec, get_cluster
from autopar.errors import AutoparError, MeshError, PlanError
from autopar.materialize import FromCheckpoint, SeededInit, empty_shards, has_meta_tensors, seeded_shards
from autopar.mesh_search import search_mesh
from autopar.passes import default_passes, run_passes
from autopar.pipeline_split import first_microbatch
from autopar.plan import Plan
from autopar.runtime import ParallelModule, mesh_groups
from autopar.solver import solve
from autopar.trace import TracedModel, trace

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
    num_microbatches: int | None = None,
    offload: str = "off",
    checkpointing: bool | None = None,
    prefetch: bool = True,
) -> Plan:
    """Choose a sharding for every op of ``model`` on ``mesh``. Needs no process group.

    ``memory_budget`` is in bytes per device. ``cluster`` is a preset name ("h100-80g",
    "a100-40g", "v100-16g", "cpu"), a ClusterSpec, or a JSON/TOML file.

    ``mesh="auto"`` with ``devices=N`` plans on every factorization of N into 1..``max_axes``
    axes (``autopar.mesh_search``) from one trace and returns the fastest plan; the table of all
    candidates, with predicted step times and infeasible meshes marked, is in
    ``plan.stats["mesh_search"]``.

    ``symbolic_batch`` also writes the predicted time, bytes and memory as functions of the batch size (dim 0 of
    the example inputs; it costs one more trace, at twice the batch), so that
    ``plan.predict(batch=...)`` answers for other batch sizes without tracing. ``compute``
    ("roofline" or "measured") overrides the cluster's way of pricing ops: "measured" times each
    distinct op and local shape on this machine's device, cached on disk (``autopar.cost.measured``).

    ``solver`` is
    "auto" (LP relaxation first, MILP only if rounding leaves a gap), "highs" or "cbc";
    ``time_limit_s`` bounds the solve (then the best plan found is used, with its gap).

    ``pipeline`` is "off" (the default), a number of stages N (mesh axis 0 is cut into N equal
    rank groups, each running a contiguous range of layers on the stage mesh
    ``(mesh[0] // N, *mesh[1:])``), or "auto" (the stage planner decides whether and where to
    split; with ``mesh="auto"`` and ``devices`` it also picks the stage mesh). The example
    inputs are the global batch; the plan is made for ``num_microbatches`` microbatches (default:
    N, or 1 under "auto") of batch / ``num_microbatches`` each, and its ``pipeline`` holds the
    stages (``autopar.solver.stages`` chooses them; ``autopar.pipeline_runtime`` runs them).

    When no sharding fits ``memory_budget``, ``offload`` and ``checkpointing`` let the planner
    add activation checkpointing and offload by cost (``autopar.memory.planner``), recorded in
    ``plan.memory``. ``offload`` is "off" (the default: sharding only), "cpu" (pinned host
    memory), "disk" or "disk:PATH" (files on local disk; the path is used at compile), or
    "auto" (host memory, or disk where the compute device is the host). ``checkpointing``
    defaults to on when ``offload`` is not "off". ``prefetch`` fetches each offloaded tensor
    one use ahead.
    """
    cluster_spec = get_cluster(cluster)
    if compute is not None:
        cluster_spec = dataclasses.replace(cluster_spec, compute=compute)
    num_stages = pipeline_stages(pipeline, num_microbatches)
    _check_memory_with_pipeline(num_stages, offload, checkpointing)
    if num_stages is not None:
        return _plan_pipeline(model, mesh, devices, example_inputs, example_kwargs, cluster_spec, memory_budget,
                              time_limit_s, solver, num_stages, num_microbatches, max_axes, symbolic_batch)
    if isinstance(mesh, str):
        if mesh != "auto":
            raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), or 'auto', got {mesh!r}")
        if devices is None:
            raise MeshError("mesh='auto' searches the meshes of a number of devices: pass devices=N as well")
        if offload != "off" or checkpointing:
            raise MeshError(f"offload={offload!r}, checkpointing={checkpointing!r} with mesh='auto': the mesh search "
                            "plans sharding only; pass a mesh such as (2, 4) to plan checkpointing and offload")
        traced = trace(model, example_inputs, example_kwargs)
        return search_mesh(traced, devices, cluster_spec, memory_budget, time_limit_s, max_axes=max_axes)
    mesh_shape = _mesh_shape(mesh)
    if devices is not None and math.prod(mesh_shape) != devices:
        raise MeshError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices, not devices={devices}: "
                        "pass one of them, or mesh='auto' to search the meshes of that many devices")
    traced = trace(model, example_inputs, example_kwargs)
    result = plan_traced(traced, mesh_shape, cluster_spec, memory_budget, time_limit_s, solver,
                         offload=offload, checkpointing=checkpointing, prefetch=prefetch)
    if symbolic_batch:
        from autopar.solver import symbolic

        batch = symbolic.batch_size((example_inputs, example_kwargs))
        doubled = trace(model, symbolic.double_batch(example_inputs), symbolic.double_batch(example_kwargs))
        costs = symbolic.symbolic_costs(
            symbolic.price_plan(traced, result, cluster_spec), symbolic.price_plan(doubled, result, cluster_spec), batch
        )
        result = dataclasses.replace(result, predicted={**result.predicted, "symbolic": costs})
    return result


def _plan_pipeline(model, mesh, devices, example_inputs, example_kwargs, cluster_spec, memory_budget,
                   time_limit_s, solver, num_stages, num_microbatches, max_axes, symbolic_batch) -> Plan:
    """``plan(..., pipeline=...)``: trace one microbatch and run the stage planner."""
    from autopar.solver.stages import plan_stages

    num_microbatches = default_microbatches(num_stages, num_microbatches)
    if symbolic_batch:
        raise ValueError("symbolic_batch is not available for pipelined plans yet: pass pipeline='off'")
    mesh_shape = None
    if isinstance(mesh, str):
        if mesh != "auto" or devices is None:
            raise MeshError(f"mesh must be a tuple of positive ints such as (2, 4), or 'auto' with devices=N, got {mesh!r}")
    else:
        mesh_shape = _mesh_shape(mesh)
        if devices is not None and math.prod(mesh_shape) != devices:
            raise MeshError(f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices, not devices={devices}: "
                            "pass one of them")
        devices = None
    inputs, kwargs = first_microbatch(example_inputs, example_kwargs, num_microbatches)
    traced = trace(model, inputs, kwargs)
    return plan_stages(traced, mesh_shape, cluster_spec, num_stages=num_stages, num_microbatches=num_microbatches,
                       memory_budget=memory_budget, time_limit_s=time_limit_s, devices=devices,
                       max_axes=min(max_axes, 2), solver=solver)


def offload_target(offload: str, cluster: ClusterSpec) -> tuple[str | None, str | None]:
    """(target, disk path) of an ``offload`` argument: "off" gives (None, None)."""
    if not isinstance(offload, str):
        raise ValueError(f"offload must be 'auto', 'off', 'cpu' or 'disk:PATH', got {offload!r}")
    if offload == "off":
        return None, None
    if offload == "auto":
        return ("disk" if cluster.host_link is None else "cpu"), None
    if offload == "cpu":
        return "cpu", None
    if offload == "disk" or offload.startswith("disk:"):
        path = offload.partition(":")[2]
        return "disk", path or None
    raise ValueError(f"offload must be 'auto', 'off', 'cpu' or 'disk:PATH', got {offload!r}")


def plan_traced(traced: TracedModel, mesh_shape, cluster: ClusterSpec, memory_budget, time_limit_s,
                solver: str = "auto", *, offload: str = "off", checkpointing: bool | None = None,
                prefetch: bool = True) -> Plan:
    """Plan an already traced model (``autopar.plan`` without the tracing)."""
    if memory_budget is not None and not memory_budget > 0:
        raise ValueError(f"memory_budget is bytes per device and must be positive, got {memory_budget!r}")
    target, _ = offload_target(offload, cluster)
    if checkpointing is None:
        checkpointing = target is not None
    start = time.perf_counter()
    result = solve(traced, mesh_shape, cluster, memory_budget=memory_budget, time_limit_s=time_limit_s, solver=solver,
                   offload=target, checkpointing=checkpointing, prefetch=prefetch)
    log.info("autopar: planned %d nodes on mesh %s in %.2f s", len(result.nodes), mesh_shape, time.perf_counter() - start)
    return result


def _check_memory_with_pipeline(num_stages, offload: str, checkpointing: bool | None) -> None:
    if num_stages is not None and (offload != "off" or checkpointing):
        raise ValueError(
            f"offload={offload!r}, checkpointing={checkpointing!r} with a pipeline: checkpointing and offload "
            "inside pipeline stages are not built yet; pass pipeline='off' to plan them, or offload='off'"
        )


def default_microbatches(num_stages: int | str, num_microbatches: int | None) -> int:
    """``num_microbatches`` as given, or its default: N for N stages, 1 under "auto"."""
    if num_microbatches is not None:
        return num_microbatches
    return 1 if num_stages == "auto" else int(num_stages)


def pipeline_stages(pipeline: str | int | None, num_microbatches: int | None) -> int | str | None:
    """The number of stages asked for, "auto", or None (no pipelining), with the options checked."""
    if pipeline is None or pipeline == "off":
        if num_microbatches is not None:
            raise ValueError(
                f"num_microbatches={num_microbatches!r} cuts the batch for a pipeline, but pipeline is 'off': "
                "pass pipeline=N (N stages along mesh axis 0) or pipeline='auto' as well, or drop num_microbatches"
            )
        return None
    if pipeline != "auto" and (isinstance(pipeline, bool) or not isinstance(pipeline, int) or pipeline < 1):
        raise ValueError(f"pipeline must be 'off', 'auto' or a positive number of stages, got {pipeline!r}")
    if num_microbatches is not None and (
        isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1
    ):
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    return pipeline


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
    num_microbatches: int | None = None,
    offload: str = "off",
    checkpointing: bool | None = None,
    prefetch: bool = True,
) -> ParallelModule:
    """Plan (or take ``plan``) and rewrite ``model`` into a ParallelModule for this rank.

    Runs under an initialized ``torch.distributed`` process group whose world size equals the
    mesh size. Every rank must call it with the same model and example inputs.

    ``init`` says where the shards' values come from: None takes them from ``model``'s own
    tensors (each rank cuts its shards from the whole model); ``autopar.SeededInit(seed, fn)``
    or ``autopar.FromCheckpoint(path)`` make each rank materialize only its own shards, which is
    how a model built on the meta device is compiled (see ``autopar.materialize``).

    ``pipeline=N`` and ``num_microbatches=M`` (or a pipelined ``plan``) compile a pipeline
    (``autopar.pipeline_runtime``): the model must return its loss; calling the module runs the
    whole step's forward and backward over the microbatches and returns the loss on every rank,
    and ``loss.backward()`` then puts the gradients into ``.grad``.

    ``offload``, ``checkpointing`` and ``prefetch`` are ``autopar.plan``'s, for the solve;
    with a given plan, ``offload="disk:PATH"`` only says where its disk offload files go (a
    temporary directory otherwise). Step a module that offloads with ``autopar.optim.AdamW``.
    """
    mesh_shape = _mesh_shape(mesh)
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
    _check_backend_dtypes(model, example_inputs, example_kwargs)
    meta = has_meta_tensors(model)
    if init is None and meta:
        raise ValueError(
            f"{type(model).__name__} has tensors on the meta device, which hold no values: pass "
            "init=autopar.SeededInit(seed) to initialize each rank's shards with the modules' own "
            "reset_parameters (and SeededInit(seed, fn=...) for a custom init), or "
            "init=autopar.FromCheckpoint(path) to read them from an autopar checkpoint"
        )
    if init is not None and not isinstance(init, (SeededInit, FromCheckpoint)):
        raise TypeError(f"init must be None, autopar.SeededInit(...) or autopar.FromCheckpoint(path), got {init!r}")
    collectives.register_peer()  # lets a failed collective name a dead rank
    num_stages = pipeline_stages(pipeline, num_microbatches)
    if plan is not None and not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if plan is not None and (plan.pipeline is not None or num_stages is not None):
        given = (plan.pipeline.num_stages, plan.pipeline.num_microbatches) if plan.pipeline is not None else None
        if num_stages is not None and (
            given is None
            or (num_stages != "auto" and given != (num_stages, default_microbatches(num_stages, num_microbatches)))
            or (num_stages == "auto" and num_microbatches not in (None, given[1]))
        ):
            has = f"has {given[0]} stages and {given[1]} microbatches" if given else "does not pipeline"
            raise PlanError(
                f"pipeline={pipeline!r}, num_microbatches={num_microbatches!r} contradicts the plan, which {has}: "
                "drop pipeline and num_microbatches to run the plan as it is, or re-plan"
            )
        num_stages, num_microbatches = given
    if num_stages is not None:
        _check_memory_with_pipeline(num_stages, offload, checkpointing)
        if init is not None:
            raise ValueError("init= is not supported with pipelining yet: compile the model with its own tensors (init=None)")
        from autopar.pipeline_runtime import compile_pipeline

        from autopar.solver.stages import plan_stages

        num_microbatches = default_microbatches(num_stages, num_microbatches)
        inputs, kwargs = first_microbatch(example_inputs, example_kwargs, num_microbatches)
        traced = trace(model, inputs, kwargs)

        def planner(traced, mesh_shape, cluster, memory_budget, time_limit_s):
            return plan_stages(traced, mesh_shape, cluster, num_stages=num_stages, num_microbatches=num_microbatches,
                               memory_budget=memory_budget, time_limit_s=time_limit_s)

        chosen = _resolve_plan(plan, traced, mesh_shape, cluster, memory_budget, time_limit_s, planner=planner)
        check_rank_agreement(chosen)
        return compile_pipeline(model, traced, chosen)
    traced = trace(model, example_inputs, example_kwargs)  # meta tensors become FakeTensors there
    chosen = _resolve_plan(plan, traced, mesh_shape, cluster, memory_budget, time_limit_s,
                           dict(offload=offload, checkpointing=checkpointing, prefetch=prefetch))
    check_rank_agreement(chosen)
    groups, coordinate = mesh_groups(mesh_shape)
    offloader = _offloader(chosen, offload, example_inputs, example_kwargs)
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    gm = run_passes(copy.deepcopy(traced.gm), chosen, default_passes(groups, offloader, fqns))
    if isinstance(init, SeededInit):
        local = seeded_shards(model, init, chosen.params, coordinate, mesh_shape)
    elif isinstance(init, FromCheckpoint):
        local = empty_shards(model, chosen.params, mesh_shape, init.device)
    else:
        local = None
    pm = ParallelModule(model, traced, gm, chosen, groups, coordinate, local_shards=local, offloader=offloader)
    if isinstance(init, FromCheckpoint):
        checkpoint.load(init.path, pm)
    return pm


def _offloader(chosen: Plan, offload: str, example_inputs, example_kwargs):
    """The store and hooks for a plan that offloads (None for one that does not)."""
    if chosen.memory is None or not (chosen.memory.offload or chosen.memory.offload_activations):
        return None
    from autopar.memory.offload import Offloader
    from autopar.memory.store import make_store

    path = offload.partition(":")[2] if isinstance(offload, str) and offload.startswith("disk:") else None
    if path is not None:
        path = os.path.join(path, f"rank{dist.get_rank()}")
    leaves = [t for t in torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {})) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    return Offloader(chosen.memory, make_store(chosen.memory.target, path, device))


# Dtypes each backend cannot reduce (gloo has no bfloat16 all-reduce).
_UNREDUCIBLE = {"gloo": {torch.bfloat16}}


def _check_backend_dtypes(model: torch.nn.Module, example_inputs, example_kwargs) -> None:
    backend = str(dist.get_backend())
    bad = _UNREDUCIBLE.get(backend, set())
    if not bad:
        return
    leaves = torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {}))
    named = [(f"parameter {n}", t) for n, t in model.named_parameters()]
    named += [(f"buffer {n}", t) for n, t in model.named_buffers()]
    named += [(f"input {i}", t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
    for name, tensor in named:
        if tensor.dtype in bad:
            raise ValueError(
                f"{name} is {tensor.dtype}, which the {backend} backend cannot reduce: use float32 "
                f"(model.float()) when running on {backend}, or NCCL on GPUs for {tensor.dtype}"
            )


def _resolve_plan(plan, traced, mesh_shape, cluster, memory_budget, time_limit_s, memory_args=None,
                  planner=None) -> Plan:
    if plan is None:
        # Rank 0 solves and broadcasts; the solve is deterministic, but eight identical solves
        # on one host would only compete for its cores. A failure is broadcast too, so that
        # every rank raises it now instead of waiting out the process-group timeout.
        payload: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                if planner is not None:
                    made = planner(traced, mesh_shape, get_cluster(cluster), memory_budget, time_limit_s)
                else:
                    made = plan_traced(traced, mesh_shape, get_cluster(cluster), memory_budget, time_limit_s,
                                       **(memory_args or {}))
                payload[0] = ("plan", made.to_json())
            except Exception as error:
                payload[0] = ("error", error)
        collectives.call_on_world("plan broadcast", dist.broadcast_object_list, payload, src=0)
        kind, value = payload[0]
        if kind == "error":
            if dist.get_rank() == 0:
                raise value
            raise type(value)(f"{value}\n(planned on rank 0)") if isinstance(value, AutoparError) else RuntimeError(
                f"planning failed on rank 0: {type(value).__name__}: {value}"
            )
        chosen = Plan.from_json(value)
    elif isinstance(plan, Plan):
        chosen = plan
    else:
        chosen = Plan.load(plan)
    check_plan_matches(chosen, traced, mesh_shape)
    return chosen


def check_plan_matches(chosen: Plan, traced: TracedModel, mesh_shape: tuple[int, ...]) -> None:
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
