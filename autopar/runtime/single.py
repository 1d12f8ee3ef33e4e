"""The single-stage module's assembly: ``compile_single`` makes this rank's ``ParallelModule`` of
a plan, as ``runtime.pipeline.compile_pipeline`` makes a pipelined one. It rewrites the traced
graph (``passes.default_passes``), makes this rank's shards (cut from the model, seeded, or left
for a checkpoint), hands the module the builder of its other mode's graph, and the compiled
graph's runner under ``compiler``."""

from __future__ import annotations

import copy
import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from autopar.cost.cluster import ClusterSpec
from autopar.errors import ConfigError, PlanError
from autopar.ir.gathers import check_kept_layers
from autopar.ir.memory import MemoryPlan
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.ops import collectives
from autopar.passes import default_passes, run_passes
from autopar.runtime import stale_model
from autopar.runtime.agreement import check_rank_agreement, resolve_plan
from autopar.runtime.compile_checks import check_precision_runs
from autopar.runtime.compiled import graph_runner
from autopar.runtime.materialize import FromCheckpoint, SeededInit, checkpoint_shards, seeded_shards
from autopar.runtime.modes import ModeBuilder, ModeKey, describe_mode, in_mode, pinned_placements
from autopar.runtime.module import ParallelModule, mesh_groups
from autopar.runtime.offload import Offloader
from autopar.runtime.signature import adopt_signature
from autopar.runtime.store import make_store
from autopar.solver.planners.quiet_gc import quiet_gc
from autopar.trace import TracedModel, trace

# (example positional inputs, example keyword inputs or None): what the model was traced with
Examples = tuple[tuple[Any, ...], dict[str, Any] | None]


def compile_single(
    model: torch.nn.Module,
    examples: Examples,
    traced: TracedModel,
    plan: Plan,
    cluster: ClusterSpec,
    options: PlanOptions,
    init: SeededInit | FromCheckpoint | None = None,
    compiler: str | None = None,
) -> ParallelModule:
    """This rank's module of ``plan`` (agreed by every rank) for ``traced`` (``model`` traced on
    ``examples``): the rewritten graph, its shards (``init``: None cuts them from ``model``'s
    tensors; under ``FromCheckpoint`` they are empty until ``autopar.checkpoint.load`` fills
    them), the builder of its other mode (planned on ``cluster`` under ``options``), and the
    compiled graph under ``compiler``."""
    mesh_shape = tuple(plan.mesh_shape)
    check_precision_runs(options.precision)
    groups, coordinate = mesh_groups(mesh_shape)
    offloader = _offloader(plan, options.memory.offload, examples)
    if compiler is not None and offloader is not None:
        raise ConfigError(f"the plan offloads, which compiler={compiler!r} does not run yet: compile without compiler=")
    if offloader is not None:
        # The buckets put reduced gradients into .grad at the end of backward, after the point
        # where the offloader's gradient hooks move offloaded gradients to their store; until
        # the two are joined, a plan that offloads runs one collective per use (correct numbers).
        options = options.replace(comm=dataclasses.replace(options.comm, enabled=False))
    collectives.remember_groups(groups)  # read while tracing, where no process group is resolved
    comm = options.comm.with_plan(plan.kept_layers)  # the layers the plan keeps gathered
    check_kept_layers(comm.reshard_after_forward, param_fqns(traced).values())
    passes = default_passes(groups, offloader, param_fqns(traced), comm, compiler)
    gm = run_passes(copy.deepcopy(traced.gm), plan, passes)
    build_mode = mode_builder(_meta_copy(model), examples, plan, cluster, options, groups, offloader)
    pm = ParallelModule(
        model,
        traced,
        gm,
        plan,
        groups,
        coordinate,
        local_shards=_initial_shards(model, init, plan, coordinate),
        offloader=offloader,
        build_mode=build_mode,
        training=model.training,
    )
    pm.run_compiled(graph_runner(gm, compiler, comm))
    adopt_signature(pm, model)  # HF Trainer keeps the columns the forward names (runtime.signature)
    return pm


def param_fqns(traced: TracedModel) -> dict[str, str]:
    """Parameter placeholder name -> the parameter's canonical FQN (the first of tied names)."""
    return {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}


def _initial_shards(model: torch.nn.Module, init, plan: Plan, coordinate: tuple[int, ...]):
    """This rank's shards made by ``init`` (None: the module cuts them from ``model``'s tensors)."""
    mesh_shape = tuple(plan.mesh_shape)
    if isinstance(init, SeededInit):
        return seeded_shards(model, init, plan.params, coordinate, mesh_shape)
    if isinstance(init, FromCheckpoint):  # filled by checkpoint.load once the module exists
        return checkpoint_shards(model, init, plan.params, coordinate, mesh_shape)
    return None


def _offloader(plan: Plan, offload: str, examples: Examples) -> Offloader | None:
    """The store and hooks for a plan that offloads (None for one that does not)."""
    if plan.memory is None or not (plan.memory.offload or plan.memory.offload_activations):
        return None
    path = offload.partition(":")[2] if isinstance(offload, str) and offload.startswith("disk:") else None
    if path is not None:
        path = os.path.join(path, f"rank{dist.get_rank()}")
    example_inputs, example_kwargs = examples
    leaves = [t for t in torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {})) if isinstance(t, torch.Tensor)]
    device = leaves[0].device if leaves else torch.device("cpu")
    return Offloader(plan.memory, make_store(plan.memory.target, path, device))


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


def _offload_refusal(mode: ModeKey) -> PlanError:
    """A plan that offloads trains in the mode it was compiled in alone (its memory decisions are
    that graph's): a call that trains in another mode is refused with the fix."""
    return PlanError(
        f"a call in {describe_mode(mode)} mode: this plan offloads, and an offloading plan trains in the mode it "
        "was compiled in alone (an eval mode runs at any shape): run the module in that mode (pm.train(), and "
        "every module's mode as it was), or compile with offload='off'"
    )


def mode_builder(
    model: torch.nn.Module,
    examples: Examples,
    chosen: Plan,
    cluster: ClusterSpec,
    options: PlanOptions,
    groups: tuple[str, ...],
    offloader: Offloader | None = None,
) -> ModeBuilder:
    """The builder of the compiled module's other mode (``runtime.modes``) and of its graphs for
    other input shapes (``runtime.shapes``): trace ``model`` in that mode, plan it with every
    parameter and buffer pinned to ``chosen``'s placements and the batch split on ``chosen``'s
    axes (rank 0 solves, as in ``compile``), and rewrite it. Where ``chosen`` offloads, an eval
    mode's graph (at any shape) fetches the offloaded parameters from ``offloader``'s store as
    the trained graph does, and checkpoints nothing (an eval forward saves nothing under
    ``no_grad``); a training graph at shapes no larger than the example's (a collator that pads
    to each batch's longest row) takes the trained graph's memory decisions whole; other
    training graphs are refused (``_offload_refusal``)."""
    mesh_shape = tuple(chosen.mesh_shape)
    plan_options = options if offloader is None else _resident(options)

    def build(mode: ModeKey, shaped: Examples | None = None):
        # ``shaped``: a call's inputs of other shapes (runtime.shapes), else the example inputs
        inputs, kwargs = shaped if shaped is not None else examples
        trains = mode.training or bool(mode.odd)
        # (a call of other shapes got here within the example's: ``shapes.check_within``)
        if offloader is not None and (mode.unfrozen or (trains and shaped is None)):
            raise _offload_refusal(mode)
        with in_mode(model, mode), quiet_gc(), stale_model.quiet():
            traced = trace(model, inputs, kwargs, options.precision)
        forced = pinned_placements(traced, chosen)
        made = resolve_plan(None, traced, mesh_shape, cluster, plan_options, forced=forced, data_axes=chosen.data_layout.axes)
        if offloader is not None:
            made = dataclasses.replace(made, memory=_memory_of(chosen.memory, trains))
        check_rank_agreement(made)
        comm = options.comm.with_plan(made.kept_layers)
        previous = dict(offloader.previous) if offloader is not None else None
        try:
            gm = run_passes(copy.deepcopy(traced.gm), made, default_passes(groups, offloader, param_fqns(traced), comm))
        except PlanError as error:  # the trained graph's segments are not in this one's
            raise PlanError(
                f"a call in {describe_mode(mode)} mode with inputs of other shapes than the example's: this plan "
                "offloads, and this shape's graph differs from the compiled one where its memory decisions apply "
                f"({error}). Pad every training batch to the example's shapes, or compile with offload='off'"
            ) from error
        finally:
            if offloader is not None:  # the trained graph's fetch order, which its backward prefetches by
                offloader.previous = previous
        return traced, gm, made

    return build


def _memory_of(trained: MemoryPlan, trains: bool) -> MemoryPlan:
    """An offloading module's memory decisions for another graph of it: a training graph (at no
    larger shapes) keeps the trained graph's, checkpoint segments included, which are smaller
    there; an eval graph only fetches the offloaded parameters and checkpoints nothing."""
    if trains:
        return trained
    fetched = tuple(entry for entry in trained.offload if entry.kind == "param")
    return MemoryPlan(trained.target, trained.prefetch, offload=fetched)


def _resident(options: PlanOptions) -> PlanOptions:
    """``options`` for an offloading module's eval graph: planned without a budget, offload or
    checkpointing (its placements are pinned; its offloaded parameters are fetched as trained)."""
    memory = dataclasses.replace(options.memory, budget=float("inf"), offload="off", checkpointing=False)
    return options.replace(memory=memory)


__all__ = ["compile_single", "mode_builder", "param_fqns"]
