"""Planning options as values. ``autopar.plan``, ``autopar.compile`` and the CLI build one
``PlanOptions`` from their keywords or flags, and the planner reads that one object, so an option
is checked once, in ``__post_init__``, with the same message on every path.

    PlanOptions(memory=MemoryOptions(budget=40e9, offload="auto"),
                pipeline=PipelineOptions(stages=4, num_microbatches=8))
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.utils._pytree as pytree

from autopar.errors import ConfigError, ConfigTypeError, MeshError
from autopar.ir.data import DataOptions
from autopar.ir.memory import CHECKPOINT_POLICIES
from autopar.ir.units import parse_budget

# The string choices of the options, as types (each equals the tuple its checker reads, which
# tests/ir/test_options.py holds them to).
SolverName = Literal["auto", "highs", "cbc"]  # solver.search.backends.SOLVERS
ComputeMode = Literal["roofline", "measured"]  # cost.cluster.COMPUTE_MODES
OffloadTarget = Literal["off", "auto", "cpu", "disk"]  # or "disk:PATH"
CheckpointPolicy = Literal["selective", "full", "selective-op"]  # ir.memory.CHECKPOINT_POLICIES
PipelineStages = Literal["off", "auto"]  # or a number of stages
ScheduleName = Literal["1F1B", "Interleaved1F1B", "ZBV"]  # ir.pipeline.PLANNED_SCHEDULES
PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true"]  # PRECISIONS
# The optimizer a plan is priced for (``PlanOptions.optimizer``): a kind, and after a colon the
# implementation it runs ("adamw:fused"); without one, torch's default for the devices.
OPTIMIZER_KINDS = ("adamw", "adam", "adamw-amsgrad", "adam-amsgrad", "sgd", "sgd-momentum")  # cost.memory.OPTIMIZER_STATES
OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")  # cost.optimizer
DEFAULT_OPTIMIZER = "adamw"


def parse_optimizer(optimizer: str) -> tuple[str, str | None]:
    """(kind, implementation or None) of an optimizer as ``PlanOptions.optimizer`` names it."""
    kind, colon, implementation = optimizer.partition(":") if isinstance(optimizer, str) else ("", "", "")
    if kind not in OPTIMIZER_KINDS or (colon and implementation not in OPTIMIZER_IMPLEMENTATIONS):
        raise ConfigError(
            f"unknown optimizer {optimizer!r}: expected one of {', '.join(sorted(OPTIMIZER_KINDS))}, the kind the "
            f"training loop steps with, and after a colon how it runs ({', '.join(OPTIMIZER_IMPLEMENTATIONS)}), "
            "for example 'adamw:fused' for torch.optim.AdamW(..., fused=True); without one, torch's default "
            "for the devices (foreach on CUDA, the for-loop on CPU)"
        )
    return kind, implementation or None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SolveOptions:
    """How the sharding ILP is solved: ``solver`` is "auto" (LP relaxation first, MILP only if
    rounding leaves a gap), "highs" or "cbc"; ``time_limit_s`` bounds each solve (then the best
    plan found is used, and its gap is reported).

    ``budget_gap``: where a memory budget binds, "auto" keeps the fast search's plan (Lagrangian
    rounding, ``solver.search.budget``) when its step is within this fraction of the LP bound;
    further, the MILP runs as a second opinion for 30% of the time planning took so far, tracing
    included (at least 2 s). 0 runs
    it always (slower, and what it finds in its time depends on the machine); 1 never (fastest,
    and the same plan on every machine). A sharding that could beat the best plan so far by no
    more than this fraction is not tried with checkpointing and offload (0: every one is; 1: none
    beyond the first)."""

    time_limit_s: float = 60.0
    solver: SolverName = "auto"
    budget_gap: float = 0.05

    def __post_init__(self) -> None:
        if isinstance(self.time_limit_s, bool) or not isinstance(self.time_limit_s, (int, float)) or not self.time_limit_s > 0:
            raise ConfigError(f"time_limit_s must be a positive number of seconds (such as 60), got {self.time_limit_s!r}")
        gap = self.budget_gap
        if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not 0 <= gap <= 1:
            raise ConfigError(f"budget_gap must be a fraction from 0 to 1 (such as 0.05), got {gap!r}")


@dataclass(frozen=True, slots=True)
class CommOptions:
    """How the runtime schedules parameter communication (``passes.schedule``, ``ops.buckets``).

    Gradient reductions go in buckets of at most ``bucket_cap_bytes`` (DDP's 25 MiB), the first
    of at most ``first_bucket_cap_bytes`` (DDP's 1 MiB, so that communication starts early in
    backward; None: the same cap); sharded parameters are all-gathered up to
    ``prefetch_bytes`` ahead of their use in forward (the next gather group always). Sharded
    parameters of one layer (FQN up to its first numeric index, as FSDP2's
    ``fully_shard(block)`` groups them), consecutive in forward order, are all-gathered together
    in ONE collective of a flat buffer, in groups of at most ``gather_group_bytes`` of whole
    parameters (0: one all-gather per parameter). ``enabled=False`` runs one synchronous
    collective per use, as the graph's collectives say (for comparison).

    ``reshard_after_forward`` is FSDP2's: True frees each group's gathered parameters once
    forward is done with them and all-gathers them again in backward (the group backward needs
    next is gathered ahead: prefetch), which keeps one or two groups whole at a time instead of
    every gathered parameter from forward until its backward, for one more all-gather per
    group per step; False keeps them (no backward all-gather). None is FSDP2's ``fully_shard``
    default: every layer's group is resharded, the root's parameters (embeddings, final norm,
    head: the FQNs with no layer index) are kept, as backward needs them first (``ir.gathers``).
    A tuple of layer names ("model.layers.31"; "" for the root) keeps those layers and reshards
    the rest, as ``fully_shard(block, reshard_after_forward=False)`` on those blocks does.
    "auto", the default, is the planner's choice: the root kept, and the last layers too, as
    many as make the step faster within the memory budget. A plan records the layers it is
    priced for (``Plan.kept_layers``: chosen, or as given here), and ``compile`` under "auto"
    runs what the plan says (a plan that records none runs FSDP2's default)."""

    bucket_cap_bytes: int = 25 * 2**20
    first_bucket_cap_bytes: int | None = 2**20
    prefetch_bytes: int = 4 * 2**20
    gather_group_bytes: int = 64 * 2**20
    enabled: bool = True
    reshard_after_forward: bool | None | str | tuple[str, ...] = "auto"

    def __post_init__(self) -> None:
        for name in ("bucket_cap_bytes", "first_bucket_cap_bytes", "prefetch_bytes", "gather_group_bytes"):
            value = getattr(self, name)
            if value is None and name == "first_bucket_cap_bytes":
                continue
            zero_ok = name in ("prefetch_bytes", "gather_group_bytes")
            if not _is_int(value) or value < (0 if zero_ok else 1):
                least = "0" if zero_ok else "1"
                raise ConfigError(f"CommOptions.{name} is a number of bytes of at least {least}, got {value!r}")
        value = self.reshard_after_forward
        if isinstance(value, list):  # a plan's JSON, a config file
            object.__setattr__(self, "reshard_after_forward", value := tuple(value))
        layers = isinstance(value, tuple) and all(isinstance(layer, str) for layer in value)
        if not (value is None or value == "auto" or isinstance(value, bool) or layers):
            raise ConfigError(
                "CommOptions.reshard_after_forward is True (free gathered parameters after forward, gather them "
                "again in backward), False (keep them until backward), None (FSDP2's default: True for each "
                'layer, False for the root\'s parameters), a tuple of the layers to keep ("model.layers.31"; '
                f'"" for the root) or "auto" (the planner\'s choice, the default), got {value!r}'
            )

    def with_plan(self, kept_layers: tuple[str, ...] | None) -> CommOptions:
        """These options as ``compile`` runs a plan that keeps ``kept_layers`` gathered
        (``Plan.kept_layers``): under "auto" the plan's choice (None: FSDP2's default); any
        other value is the caller's and stands."""
        if self.reshard_after_forward != "auto":
            return self
        return dataclasses.replace(self, reshard_after_forward=kept_layers)


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    """What the plan may do to fit ``budget`` bytes per device. None (the default) is the
    cluster's device memory less its reserve (``cost.cluster.ClusterSpec.default_memory_budget``);
    ``float("inf")`` plans without a budget.

    ``offload`` is "off" (sharding only), "cpu" (pinned host memory), "disk" or "disk:PATH", or
    "auto" (host memory, or disk where the compute device is the host). ``checkpointing`` None
    (the default) allows activation checkpointing where the budget binds (it moves no data off
    the device); False forbids it; a policy name (``ir.memory.CHECKPOINT_POLICIES``: "selective",
    matmul and attention outputs kept; "selective-op", torchtitan's op-level policy, every
    second matmul recomputed too; or "full", whole layers) checkpoints every layer with it.
    ``prefetch`` fetches each offloaded tensor one use ahead."""

    budget: float | None = None
    offload: OffloadTarget | str = "off"
    checkpointing: bool | CheckpointPolicy | None = None
    prefetch: bool = True

    def __post_init__(self) -> None:
        if not (self.checkpointing is None or isinstance(self.checkpointing, bool) or self.checkpointing in CHECKPOINT_POLICIES):
            raise ConfigError(
                "checkpointing must be None (where the budget binds), True, False, or a policy for every layer: "
                f"{' or '.join(repr(p) for p in CHECKPOINT_POLICIES)}; got {self.checkpointing!r}"
            )
        object.__setattr__(self, "budget", parse_budget(self.budget))
        if self.budget is not None and (
            isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not self.budget > 0
        ):
            raise ConfigError(f"memory_budget is bytes per device and must be positive, got {self.budget!r}")
        self.offload_target(has_host=True)  # checks the spelling

    def offload_target(self, has_host: bool) -> tuple[str | None, str | None]:
        """(target, disk path) of ``offload``: "off" gives (None, None). ``has_host`` says whether
        the cluster's device has a host memory apart from it (else "auto" means disk)."""
        offload = self.offload
        if not isinstance(offload, str):
            raise ConfigError(f"offload must be 'auto', 'off', 'cpu' or 'disk:PATH', got {offload!r}")
        if offload == "off":
            return None, None
        if offload == "auto":
            return ("cpu" if has_host else "disk"), None
        if offload == "cpu":
            return "cpu", None
        if offload == "disk" or offload.startswith("disk:"):
            return "disk", offload.partition(":")[2] or None
        raise ConfigError(f"offload must be 'auto', 'off', 'cpu' or 'disk:PATH', got {offload!r}")

    @property
    def decides_memory(self) -> bool:
        """Whether checkpointing or offload was asked for explicitly (the mesh search and the
        stage planner refuse them; by default they plan sharding alone)."""
        return self.offload != "off" or bool(self.checkpointing)


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    """``stages`` is "off", a number of stages N (mesh axis 0 is cut into N equal rank groups) or
    "auto" (the stage planner decides). The plan is made for ``num_microbatches`` microbatches
    (default: N, or 1 under "auto"). ``schedules`` are the schedules the stage planner may choose
    among: "1F1B" (GPipe where there are fewer microbatches than stages), "Interleaved1F1B", "ZBV",
    or "auto" for all three."""

    stages: int | PipelineStages = "off"
    num_microbatches: int | Literal["auto"] | None = None
    schedules: tuple[ScheduleName, ...] | Literal["auto"] = ("1F1B",)

    def __post_init__(self) -> None:
        from autopar.ir.pipeline import PLANNED_SCHEDULES  # ir.pipeline imports torch (start-up speed)

        schedules = (
            PLANNED_SCHEDULES
            if self.schedules == "auto"
            else ((self.schedules,) if isinstance(self.schedules, str) else tuple(self.schedules))
        )
        if not schedules or set(schedules) - set(PLANNED_SCHEDULES):
            raise ConfigError(f"pipeline_schedules must be 'auto' or some of {PLANNED_SCHEDULES}, got {self.schedules!r}")
        object.__setattr__(self, "schedules", schedules)
        if self.stages is None:
            object.__setattr__(self, "stages", "off")
        if self.stages == "off":
            if self.num_microbatches is not None:
                raise ConfigError(
                    f"num_microbatches={self.num_microbatches!r} cuts the batch for a pipeline, but pipeline is "
                    "'off': pass pipeline=N (N stages along mesh axis 0) or pipeline='auto' as well, or drop "
                    "num_microbatches"
                )
            return
        if self.stages != "auto" and (not _is_int(self.stages) or self.stages < 1):
            raise ConfigError(f"pipeline must be 'off', 'auto' or a positive number of stages, got {self.stages!r}")
        if self.num_microbatches not in (None, "auto") and (not _is_int(self.num_microbatches) or self.num_microbatches < 1):
            raise ConfigError(f"num_microbatches must be a positive int or 'auto', got {self.num_microbatches!r}")

    @property
    def enabled(self) -> bool:
        return self.stages != "off"

    @property
    def microbatches(self) -> int:
        """``num_microbatches`` as given, or its default: N for N stages, 1 under "auto"."""
        if self.num_microbatches == "auto":
            raise ConfigError(
                "num_microbatches='auto' has no single count: the planner tries several (autopar.plan only); pass a "
                "number of microbatches, or compile with the plan that autopar.plan(num_microbatches='auto') made"
            )
        if self.num_microbatches is not None:
            return self.num_microbatches
        return 1 if self.stages == "auto" else int(self.stages)


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """Everything ``autopar.plan`` takes besides the model, its inputs, the mesh and the cluster.

    ``devices`` and ``max_axes`` serve ``mesh="auto"`` (the mesh search). ``symbolic_batch`` also
    prices the plan as functions of the batch size (``plan.predict``). ``compute`` ("roofline" or
    "measured") overrides the cluster's way of pricing ops (the cluster checks it). ``precision``
    is a ``MixedPrecision`` or the name of one ("32-true", the default, "bf16-mixed", "bf16-true").
    ``comm`` is the communication schedule ``compile`` runs, which the plan is priced for (how
    sharded parameters are gathered and freed decides their memory). ``data`` says how the
    compiled module takes its batches (``autopar.ir.data.DataOptions``). ``optimizer`` is the one
    the training loop steps with, which the plan prices (its state, what it holds while it steps,
    its time): "adamw" (the default: torch's AdamW as it runs by default on the devices),
    "adamw:fused", "adamw:foreach", "adamw:for-loop", "adam", "adamw-amsgrad" (``amsgrad=True``, a
    third moment), "adam-amsgrad", "sgd", "sgd-momentum" (``parse_optimizer``)."""

    solve: SolveOptions = field(default_factory=SolveOptions)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    devices: int | None = None
    max_axes: int = 3
    symbolic_batch: bool = False
    compute: ComputeMode | None = None
    precision: MixedPrecision | PrecisionName | None = None
    comm: CommOptions = field(default_factory=CommOptions)
    data: DataOptions = field(default_factory=DataOptions)
    optimizer: str = DEFAULT_OPTIMIZER

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", precision_policy(self.precision))
        parse_optimizer(self.optimizer)
        if not isinstance(self.comm, CommOptions):
            raise ConfigTypeError(f"comm must be an autopar.CommOptions, got {self.comm!r}")
        if not isinstance(self.data, DataOptions):
            raise ConfigTypeError(f"data must be an autopar.DataOptions, got {self.data!r}")
        if self.pipeline.enabled and self.data.per_rank:
            raise ConfigError(
                "batch='per_rank' with a pipeline: the pipeline runtime takes the whole batch on every "
                "rank and cuts it into microbatches; pass batch='whole' (the default), or pipeline='off'"
            )
        if self.pipeline.enabled and self.memory.offload != "off":
            raise ConfigError(
                f"offload={self.memory.offload!r} with a pipeline: offload inside pipeline stages is not built yet "
                "(activation checkpointing is: the stage planner recomputes a stage's layers where its budget "
                "binds); pass offload='off', or pipeline='off' to plan offload"
            )
        if self.pipeline.enabled and isinstance(self.memory.checkpointing, str):
            raise ConfigError(
                f"checkpointing={self.memory.checkpointing!r} with a pipeline: the stage planner recomputes whole "
                "layers where a stage's budget binds and plans no checkpoint policy yet; pass checkpointing=None "
                "(or False), or pipeline='off' to checkpoint every layer with a policy"
            )
        if self.pipeline.enabled and self.symbolic_batch:
            raise ConfigError("symbolic_batch is not available for pipelined plans yet: pass pipeline='off'")

    @classmethod
    def from_keywords(
        cls,
        *,
        memory_budget: float | None = None,
        time_limit_s: float = 60.0,
        solver: SolverName = "auto",
        pipeline: int | PipelineStages = "off",
        num_microbatches: int | Literal["auto"] | None = None,
        offload: OffloadTarget | str = "off",
        checkpointing: bool | CheckpointPolicy | None = None,
        prefetch: bool = True,
        pipeline_schedules: tuple[ScheduleName, ...] | Literal["auto"] = ("1F1B",),
        **rest: Any,
    ) -> PlanOptions:
        """The options of ``autopar.plan``'s keywords (the flat spelling of this value); ``comm``
        and ``data`` None are their defaults."""
        rest = {name: value for name, value in rest.items() if not (name in ("comm", "data") and value is None)}
        return cls(
            solve=SolveOptions(time_limit_s, solver),
            memory=MemoryOptions(memory_budget, offload, checkpointing, prefetch),
            pipeline=PipelineOptions(pipeline, num_microbatches, pipeline_schedules),
            **rest,
        )

    @classmethod
    def of(cls, options: PlanOptions | None, keywords: dict[str, Any], defaults: dict[str, Any]) -> PlanOptions:
        """The one value of a facade's ``options`` and its keywords, the shortcut: the keywords'
        (``from_keywords``) without ``options``, else ``options``, which each keyword given (one
        that differs from its default in ``defaults``) must agree with."""
        built = cls.from_keywords(**keywords)
        if options is None:
            return built
        if not isinstance(options, PlanOptions):
            raise ConfigTypeError(f"options must be an autopar.PlanOptions, got {options!r}")
        for name, value in keywords.items():
            if _same(value, defaults[name]):
                continue
            path = KEYWORD_FIELDS[name]
            asked, held = _field(built, path), _field(options, path)
            if asked != held:
                raise ConfigError(
                    f"{name}={value!r} disagrees with options.{path}={held!r}: pass each option once, as a "
                    f"keyword or in options= (drop {name}=, or set it in options)"
                )
        return options

    def replace(self, **changes: Any) -> PlanOptions:
        return dataclasses.replace(self, **changes)


# Each keyword of ``autopar.plan``, ``compile`` and ``hand_plan`` -> the field of PlanOptions it sets.
KEYWORD_FIELDS = {
    "memory_budget": "memory.budget",
    "offload": "memory.offload",
    "checkpointing": "memory.checkpointing",
    "prefetch": "memory.prefetch",
    "time_limit_s": "solve.time_limit_s",
    "solver": "solve.solver",
    "pipeline": "pipeline.stages",
    "num_microbatches": "pipeline.num_microbatches",
    "pipeline_schedules": "pipeline.schedules",
    "devices": "devices",
    "max_axes": "max_axes",
    "symbolic_batch": "symbolic_batch",
    "compute": "compute",
    "precision": "precision",
    "comm": "comm",
    "data": "data",
    "optimizer": "optimizer",
}


def _field(options: PlanOptions, path: str) -> Any:
    value: Any = options
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _same(value: Any, default: Any) -> bool:
    """Whether a keyword holds its default (then it was not given)."""
    try:
        return value is default or bool(value == default)
    except Exception:  # noqa: BLE001 - a value that does not compare (a tensor) was given
        return False


# -- precision ---------------------------------------------------------------------------------
# The precision policy: which dtype each class of tensor takes in training, in the spirit of
# FSDP2's ``MixedPrecisionPolicy`` and Lightning's precision strings.
#
# ==============  ==================================  ==========================================
# field           tensors                             ``"bf16-mixed"``
# ==============  ==================================  ==========================================
# param_dtype     parameters as ops read them, and    bfloat16 (the model is traced with bf16
#                 so the activations                  weights; each parameter is cast at its use)
# master_dtype    stored (sharded) parameters and     float32
#                 their gradients
# reduce_dtype    gradient reductions across ranks    float32
# optimizer_dtype optimizer state (the stored dtype:    float32
#                 torch's optimizers keep their
#                 state in the parameter's dtype)
# ==============  ==================================  ==========================================
#
# None in ``param_dtype`` or ``master_dtype`` means the model's own dtype, so "32-true" (the
# default) changes nothing: an fp32 model trains in fp32 and a bf16 one in bf16, as before the
# policy existed. ``reduce_dtype`` None is the gradient's own dtype. ``optimizer_dtype`` is
# the stored dtype, always: a policy may name it or leave it None (filled in), and naming another
# is refused, since no optimizer that steps the parameters would keep it. dtypes are stored by name
# ("float32"), so that the policy is a plain JSON value of the plan.

_DTYPES = ("float32", "float64", "bfloat16", "float16")


def dtype_name(value: str | torch.dtype | None) -> str | None:
    """ "float32" for torch.float32 or "float32"; None stays None."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    if name not in _DTYPES:
        raise ConfigError(f"precision dtypes are {', '.join(_DTYPES)} (or torch dtypes), got {value!r}")
    return name


def to_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a name (None stays None)."""
    return None if name is None else getattr(torch, name)


@dataclass(frozen=True, slots=True)
class MixedPrecision:
    """A precision policy (module docstring). Pass torch dtypes or their names."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    master_dtype: str | None = None
    optimizer_dtype: str | None = None
    name: str = "custom"

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype", "master_dtype", "optimizer_dtype"):
            object.__setattr__(self, field_name, dtype_name(getattr(self, field_name)))
        if self.master_dtype is not None and self.param_dtype is None:
            raise ConfigError(
                f"master_dtype={self.master_dtype!r} needs a param_dtype: the master weights are what "
                "parameters are cast from at their use"
            )
        if self.optimizer_dtype is not None and self.optimizer_dtype != self.stored_dtype:
            stored = self.stored_dtype or "the model's own dtype"
            raise ConfigError(
                f"optimizer_dtype={self.optimizer_dtype!r}, but this policy stores parameters in {stored}, and "
                "the optimizer's state takes the dtype of what it steps (torch's AdamW and autopar.optim.AdamW "
                f"alike): for {self.optimizer_dtype} state, store the weights in it "
                f"(master_dtype={self.optimizer_dtype!r} beside param_dtype), or leave optimizer_dtype None"
            )
        object.__setattr__(self, "optimizer_dtype", self.stored_dtype)  # one spelling of one policy

    @property
    def casts(self) -> bool:
        """Parameters are stored in ``master_dtype`` and cast to ``param_dtype`` at their use."""
        return self.param_dtype is not None and self.master_dtype not in (None, self.param_dtype)

    @property
    def stored_dtype(self) -> str | None:
        """The dtype parameters are stored, stepped and their gradients reduced in: the master
        weights' where the policy casts, else ``param_dtype`` (None: the model's own)."""
        return self.master_dtype if self.casts else self.param_dtype

    def cast_inputs(self, tree: Any) -> Any:
        """``tree`` with its floating tensors cast to ``param_dtype`` (FSDP2's
        ``cast_forward_inputs``); unchanged where the policy keeps the model's dtypes."""
        if self.param_dtype is None:
            return tree
        dtype = to_dtype(self.param_dtype)
        return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "param_dtype": self.param_dtype,
            "reduce_dtype": self.reduce_dtype,
            "master_dtype": self.master_dtype,
            "optimizer_dtype": self.optimizer_dtype,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MixedPrecision:
        # Plans written before 2026-11-29 recorded "float32" whatever the parameters were stored in;
        # their state took the stored dtype then too, which is what the policy says now.
        return cls(**{**data, "optimizer_dtype": None})


PRECISIONS: dict[str, MixedPrecision] = {
    "32-true": MixedPrecision(name="32-true"),
    "bf16-mixed": MixedPrecision("bfloat16", "float32", "float32", "float32", name="bf16-mixed"),
    "bf16-true": MixedPrecision("bfloat16", "bfloat16", "bfloat16", "bfloat16", name="bf16-true"),
}
DEFAULT_PRECISION = "32-true"


def precision_policy(value: str | MixedPrecision | None) -> MixedPrecision:
    """The policy of a precision string ("32-true", "bf16-mixed", "bf16-true") or value."""
    if value is None:
        return PRECISIONS[DEFAULT_PRECISION]
    if isinstance(value, MixedPrecision):
        return value
    if isinstance(value, str) and value in PRECISIONS:
        return PRECISIONS[value]
    raise ConfigError(
        f"precision must be one of {', '.join(repr(p) for p in PRECISIONS)} or an autopar.MixedPrecision, got {value!r}"
    )


def check_mesh_devices(mesh_shape: tuple[int, ...], devices: int | None) -> None:
    """``devices``, where given beside a mesh, must be the mesh's size."""
    if devices is not None and math.prod(mesh_shape) != devices:
        raise MeshError(
            f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices, not devices={devices}: "
            "pass one of them, or mesh='auto' to search the meshes of that many devices"
        )


__all__ = [
    "SolverName",
    "ComputeMode",
    "OffloadTarget",
    "CheckpointPolicy",
    "PipelineStages",
    "ScheduleName",
    "PrecisionName",
    "OPTIMIZER_KINDS",
    "OPTIMIZER_IMPLEMENTATIONS",
    "DEFAULT_OPTIMIZER",
    "parse_optimizer",
    "KEYWORD_FIELDS",
    "CommOptions",
    "MemoryOptions",
    "PipelineOptions",
    "PlanOptions",
    "SolveOptions",
    "MixedPrecision",
    "PRECISIONS",
    "DEFAULT_PRECISION",
    "precision_policy",
    "to_dtype",
    "check_mesh_devices",
]
