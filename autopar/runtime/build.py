"""``compile``'s one builder below the API: trace the model, agree on a plan (rank 0 solves it
unless one is given), and assemble this rank's module, pipelined (``pipeline.compile_pipeline``)
or not (``single.compile_single``)."""

from __future__ import annotations

import gc

import torch
from torch.distributed.tensor import DTensor

from autopar.cost.cluster import ClusterSpec
from autopar.cost.optimizer import implementation
from autopar.ir.options import PlanOptions
from autopar.ir.pipeline import first_microbatch
from autopar.ir.plan import Plan
from autopar.runtime import checkpoint, grad_scaling, stage_calls, stale_model
from autopar.runtime.agreement import check_rank_agreement, resolve_plan
from autopar.runtime.compile_checks import check_carried_state, warn_batch_statistics, warn_set_attributes
from autopar.runtime.materialize import FromCheckpoint, SeededInit
from autopar.runtime.module import ParallelModule
from autopar.runtime.optim import own_parameters
from autopar.runtime.optim_guard import hold_to_optimizer
from autopar.runtime.padded import check_padded_plan
from autopar.runtime.pipeline import PipelineParallelModule, compile_pipeline
from autopar.runtime.single import Examples, compile_single
from autopar.solver.planners.quiet_gc import quiet_gc
from autopar.solver.planners.settings import memory_budget
from autopar.trace import trace

# The weights' size from which compile collects what tracing left (``free_traced``).
FREE_AFTER_TRACE_BYTES = 256 * 2**20


@stale_model.quiet()  # the model may be one compiled before, and trained since (runtime.stale_model)
def build_module(
    model: torch.nn.Module,
    examples: Examples,
    plan: Plan | None,
    mesh_shape: tuple[int, ...],
    cluster: ClusterSpec,
    options: PlanOptions,
    init: SeededInit | FromCheckpoint | None = None,
    compiler: str | None = None,
    split_batch: bool = False,
) -> ParallelModule | PipelineParallelModule:
    """This rank's module of ``model`` on ``mesh_shape``: ``plan``, or the plan rank 0 makes on
    ``cluster`` under ``options`` (``split_batch``: at least split the batch,
    ``solver.planners.split_batch``). A pipeline traces one microbatch of ``examples``. Meta tensors
    become FakeTensors; under a precision policy, parameters are traced in param_dtype and cast from
    their master dtype at use, as when planning. ``init`` makes only this rank's shards."""
    pipelined = options.pipeline.enabled
    traced_on = first_microbatch(*examples, options.pipeline.microbatches) if pipelined else examples
    with quiet_gc():
        traced = trace(model, *traced_on, options.precision)
    check_carried_state(traced)
    warn_set_attributes(traced)
    # (``cluster`` is priced for ``compiler``'s executor: under inductor, whose traced gathers are
    # unpadded, the planner offers no padded shard, ``choices.build_choice_graph``)
    chosen = resolve_plan(plan, traced, mesh_shape, cluster, options, split_batch=split_batch)
    warn_batch_statistics(model, chosen)
    check_rank_agreement(chosen)
    check_padded_plan(chosen, traced, options, compiler)
    if pipelined:
        module = compile_pipeline(model, traced, chosen, init)
    else:
        module = compile_single(model, examples, traced, chosen, cluster, options, init, compiler)
    if isinstance(init, FromCheckpoint):  # the shards are empty until the checkpoint fills them
        checkpoint.load(init.path, module)
    budget = memory_budget(options, cluster)
    priced = implementation(cluster, chosen.optimizer)
    hold_to_optimizer(dict(module.named_parameters()), chosen.optimizer, priced, budget, chosen.predicted.peak_memory_bytes)
    own_parameters(module)  # autopar.optim.AdamW(module.parameters()) finds the module
    if pipelined or any(isinstance(p, DTensor) for p in module.parameters()):
        grad_scaling.watch(module)  # each rank holds part of the gradients: GradScaler skips on all or none
    if pipelined:
        stage_calls.watch(module)  # torch's clip over pm.parameters() clips by the whole model's norm; LBFGS refused
    free_traced(model)
    stale_model.watch(model, module)
    return module


def free_traced(model: torch.nn.Module) -> None:
    """Tracing leaves reference cycles that reach ``model``, which ``quiet_gc`` moved to the oldest
    generation: a caller who drops the model would keep a whole copy of its weights (on a GPU, in
    device memory) until Python's next full pass. One full collection frees them at once; it
    costs 0.1-0.3 s, so it runs where the weights are on an accelerator or large."""
    tensors = [*model.parameters(), *model.buffers()]
    real = [t for t in tensors if t.device.type != "meta"]
    size = sum(t.numel() * t.element_size() for t in real)
    if any(t.device.type != "cpu" for t in real) or size >= FREE_AFTER_TRACE_BYTES:
        gc.collect()


__all__ = ["build_module", "free_traced", "FREE_AFTER_TRACE_BYTES"]
