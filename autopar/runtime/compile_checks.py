"""``compile``'s checks: of its arguments before anything is traced, of the process group it
runs on (its world size, and the floating dtypes its backend sums), and of what the runtime
carries out (a precision policy, compiler= with pipelines or offload), and of the traced model
(state its forward carries from one call to the next)."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from autopar.errors import ConfigError, ConfigTypeError, MeshError, ModelError, PlanError
from autopar.ir.options import MixedPrecision, PlanOptions, to_dtype
from autopar.ir.plan import Plan
from autopar.ops import collectives
from autopar.runtime.compiled import check_compiler
from autopar.runtime.materialize import FromCheckpoint, SeededInit, has_meta_tensors
from autopar.runtime.weights import check_same_weights
from autopar.trace import TracedModel

log = logging.getLogger("autopar")


def check_call(
    model: torch.nn.Module, mesh_shape: tuple[int, ...], init, compiler: str | None, weights: str = "broadcast"
) -> tuple[int, ...]:
    """``compile``'s checks before anything is traced: its arguments, the process group, and that
    every rank holds the same model; the mesh shape."""
    check_compiler(compiler)
    check_world(mesh_shape)
    check_init(model, init)
    collectives.register_peer()  # lets a failed collective name a dead rank
    check_same_weights(model, init, weights)  # every rank cuts its shards from its own copy of the model
    return mesh_shape


def check_world(mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
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


def check_init(model: torch.nn.Module, init: SeededInit | FromCheckpoint | None) -> None:
    """A model on the meta device holds no values: it needs ``init=`` to say where they come from."""
    if init is None and has_meta_tensors(model):
        raise ModelError(
            f"{type(model).__name__} has tensors on the meta device, which hold no values: pass "
            "init=autopar.SeededInit(seed) to initialize each rank's shards with the modules' own "
            "reset_parameters (and SeededInit(seed, fn=...) for a custom init), or "
            "init=autopar.FromCheckpoint(path) to read them from an autopar checkpoint"
        )
    if init is not None and not isinstance(init, (SeededInit, FromCheckpoint)):
        raise ConfigTypeError(f"init must be None, autopar.SeededInit(...) or autopar.FromCheckpoint(path), got {init!r}")


def check_compile_options(options: PlanOptions, compiler: str | None) -> None:
    """What ``compile`` cannot run yet, refused before any tracing."""
    if options.pipeline.num_microbatches == "auto":
        raise ConfigError(
            "num_microbatches='auto' searches microbatch counts offline, one trace each: plan with "
            "autopar.plan(..., num_microbatches='auto') and compile with plan=, or give a number"
        )
    if options.symbolic_batch:
        raise ConfigError(
            "symbolic_batch prices an offline plan for other batch sizes, which compile does not run: "
            "plan with autopar.plan(..., symbolic_batch=True), and compile without it"
        )
    check_precision_runs(options.precision)
    if compiler is not None and (options.pipeline.enabled or options.memory.offload != "off"):
        raise ConfigError(
            f"compiler={compiler!r} does not run pipelines or offloading yet (their schedules live in "
            "autograd hooks): compile without compiler=, or without pipeline=/offload="
        )


def check_precision_runs(policy: MixedPrecision) -> None:
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


def check_backend_dtypes(model: torch.nn.Module, example_inputs, example_kwargs, policy: MixedPrecision) -> None:
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
            raise ConfigError(
                f"{name} is {dtype}, which the {backend} backend cannot reduce in this torch build: use float32 "
                f"(model.float(), precision='32-true') when running on {backend}, a torch whose {backend} sums "
                f"{dtype} (2.13 does), or NCCL on GPUs"
            )


def warn_set_attributes(traced: TracedModel) -> None:
    """Say that the plain attributes forward sets (``self.last_attention = ...``) stay as they were:
    a compiled call runs the graph, not the model's Python code."""
    if traced.sets:
        names = [f"{fqn}.{name}" if fqn else name for fqn, name in traced.sets]
        log.warning(
            "autopar: the model's forward sets %s%s, which a call of the compiled module does not: pm.module keeps "
            "the values they had at compile. Return such values from forward instead",
            ", ".join(repr(n) for n in names[:3]),
            f" and {len(names) - 3} more" if len(names) > 3 else "",
        )


def warn_batch_statistics(model: torch.nn.Module, plan: Plan) -> None:
    """Say that batch norm takes the whole batch's statistics where each rank passes its own rows
    (``batch="per_rank"``): eager's on the whole batch and SyncBatchNorm's, not DDP's per-rank
    ones, which a DDP script with plain BatchNorm had (0.1 apart after three steps of a small CNN)."""
    if not plan.data_layout.per_rank or plan.data_layout.size == 1:
        return
    names = [
        name or "the model"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, torch.nn.SyncBatchNorm)
    ]
    if names:
        log.warning(
            "autopar: batch norm %s%s normalizes over the whole batch, all %d data-parallel ranks' rows (eager's on "
            "that batch, and SyncBatchNorm's), not over each rank's rows as under DDP: results equal eager's, not "
            "DDP's (nn.SyncBatchNorm.convert_sync_batchnorm(model) before compile says so and silences this)",
            ", ".join(repr(n) for n in names[:3]),
            f" and {len(names) - 3} more" if len(names) > 3 else "",
            plan.data_layout.size,
        )


def check_carried_state(traced: TracedModel) -> None:
    """ModelError where the model's forward reads a plain attribute and then sets it (a counter, a
    cached length: state each call leaves to the next, ``TracedModel.carried``). The graph holds
    the value it read at the trace and never sets it, so every call would compute as the first,
    where eager's calls see it change: without a word."""
    if not traced.carried:
        return
    names = [f"{fqn}.{name}" if fqn else name for fqn, name in traced.carried]
    first = traced.carried[0][1]
    raise ModelError(
        f"the model's forward reads and then sets {', '.join(repr(n) for n in names[:3])}"
        f"{f' and {len(names) - 3} more' if len(names) > 3 else ''}: state one call leaves to the next, which the "
        "compiled graph holds at its value when traced and never sets, so every call would compute as the first "
        "did, where eager's calls see it change. Keep it in a buffer updated in place (self.register_buffer("
        f"'{first}', torch.zeros((), dtype=torch.long)) in __init__, self.{first}.add_(1) in forward; a branch on "
        "it needs torch.where), which the graph reads and writes at every call, or update it outside forward"
    )


__all__ = [
    "check_call",
    "check_world",
    "check_init",
    "check_compile_options",
    "check_precision_runs",
    "check_backend_dtypes",
    "check_carried_state",
    "warn_set_attributes",
]
