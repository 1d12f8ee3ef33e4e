"""Memory decisions: the part of a plan that checkpoints segments and offloads tensors.

When the best sharding does not fit ``memory_budget``, the memory planner
(``autopar.solver.planners.memory_plan``) adds activation checkpointing and offload, and records each decision
here, with the bytes it saves on the device and the seconds it adds to a step. The checkpoint and
offload passes (``autopar.passes.memory``) and the offload runtime (``autopar.runtime.offload``)
carry them out; they choose nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.errors import PlanError
from autopar.ir.summary import format_bytes

TARGETS = ("cpu", "disk")
# Activation checkpointing policies of a layer (docs/memory.md): "full" recomputes the whole
# layer in backward; "selective" (Megatron's selective recompute) keeps the outputs of matmuls
# and attention and recomputes the cheap ops between them; "selective-op" is torchtitan's
# op-level policy (``ac_mode="selective"``, ``selective_ac_option="op"``): attention and every
# other matmul kept, the rest (every second matmul of the layer among them) recomputed.
CHECKPOINT_POLICIES = ("selective", "full", "selective-op")
# The attention kernels, by schema name, as the traced graph has them
# (``scaled_dot_product_attention``: what the planner prices) and as they reach torch's
# dispatcher at run time (what ``torch.utils.checkpoint``'s selective policy sees). Both selective
# policies keep their outputs.
ATTENTION_KERNELS = frozenset(
    {
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    }
)
# The ops whose outputs a "selective" segment keeps, by schema name: matmuls (traced, ``linear``,
# and at the dispatcher, ``mm``, ``addmm``, ...), attention and the experts op. Everything else
# is recomputed.
SELECTIVE_KEEPS = ATTENTION_KERNELS | frozenset(
    {
        "aten::linear",
        "aten::matmul",
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "aten::einsum",
        "autopar::moe_experts",
    }
)


# "selective-op": torchtitan's save list keeps attention (``ATTENTION_KERNELS``) and its policy
# counts the matmuls: a linear layer's GEMM, which reaches the dispatcher as one ``mm``
# (torchtitan's models have no biases) or ``addmm`` (a linear with a bias, counted the same here
# so that the policy means "every second linear"). torchtitan's list also keeps ``max`` (for
# Float8 scales) and a sequence-parallel ``reduce_scatter``: neither is in a bf16 layer's graph here.
SELECTIVE_OP_MATMULS = frozenset({"aten::mm", "aten::addmm"})


def _schema_name(op) -> str | None:
    schema = getattr(op, "_schema", None)
    return None if schema is None else schema.name


def selective_keeps(op) -> bool:
    """Whether a "selective" checkpoint keeps the output of ``op`` (an ``OpOverload``, or any
    other call target, which it recomputes)."""
    return _schema_name(op) in SELECTIVE_KEEPS


def selective_op_role(op, arg_dims: tuple[int, ...] = ()) -> str | None:
    """What a "selective-op" checkpoint does with ``op`` (an ``OpOverload`` at the dispatcher,
    or a traced node's target with its tensor arguments' ``arg_dims``): "keep" (attention),
    "matmul" (one GEMM its policy counts: kept when odd in the segment's order, recomputed when
    even), or None (recomputed). A traced ``linear`` or ``matmul`` counts where it reaches the
    dispatcher as one ``mm``/``addmm``: a weight (or other right operand) of two dims, an input
    of two or more."""
    name = _schema_name(op)
    if name in ATTENTION_KERNELS:
        return "keep"
    if name in SELECTIVE_OP_MATMULS:
        return "matmul"
    if name in ("aten::linear", "aten::matmul") and len(arg_dims) >= 2 and arg_dims[0] >= 2 and arg_dims[1] == 2:
        return "matmul"
    return None


def selective_op_kept(roles: list[str | None]) -> list[bool]:
    """Which of a segment's ops, in forward order with their ``selective_op_role``, a
    "selective-op" checkpoint keeps: attention, and the 1st, 3rd, 5th ... matmul (torchtitan
    counts ``mm`` calls per checkpointed block and recomputes the even ones)."""
    kept, count = [], 0
    for role in roles:
        count += role == "matmul"
        kept.append(role == "keep" or (role == "matmul" and count % 2 == 1))
    return kept


OFFLOAD_KINDS = ("param", "grad", "optimizer_state")


@dataclass(frozen=True, slots=True)
class CheckpointSegment:
    """Nodes ``first`` .. ``last`` (graph order, both included) whose saved activations leave the
    device between forward and backward: recomputed in backward (``MemoryPlan.checkpoint``), or
    offloaded and read back (``MemoryPlan.offload_activations``)."""

    name: str  # the layer it covers, e.g. "transformer.h.3"
    first: str
    last: str
    saved_bytes: float  # activations no longer kept from forward to backward
    cost_s: float  # checkpoint: the segment's forward compute, run again; offload: the transfers
    # One of CHECKPOINT_POLICIES: what a checkpointed segment recomputes ("full": all of it).
    policy: str = "full"

    def __post_init__(self) -> None:
        if self.policy not in CHECKPOINT_POLICIES:
            raise PlanError(
                f"checkpoint policy must be one of {', '.join(CHECKPOINT_POLICIES)}, got {self.policy!r}: re-plan, or fix the plan file"
            )

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "first": self.first, "last": self.last, "saved_bytes": self.saved_bytes, "cost_s": self.cost_s}
        if self.policy != "full":  # "full" is the default, which plans written before policies have
            out["policy"] = self.policy
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CheckpointSegment:
        return cls(
            str(data["name"]),
            str(data["first"]),
            str(data["last"]),
            float(data["saved_bytes"]),
            float(data["cost_s"]),
            str(data.get("policy", "full")),
        )


@dataclass(frozen=True, slots=True)
class OffloadEntry:
    """Keep one parameter's value, gradient or optimizer state off the device between uses."""

    kind: str  # one of OFFLOAD_KINDS
    fqn: str
    saved_bytes: float
    transfer_bytes: float  # moved each step, both directions together
    cost_s: float  # transfer seconds at the target's bandwidth (before overlap with compute)

    def __post_init__(self) -> None:
        if self.kind not in OFFLOAD_KINDS:
            raise PlanError(
                f"offload kind must be one of {', '.join(OFFLOAD_KINDS)}, got {self.kind!r}: re-plan, or fix the plan file"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "fqn": self.fqn,
            "saved_bytes": self.saved_bytes,
            "transfer_bytes": self.transfer_bytes,
            "cost_s": self.cost_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OffloadEntry:
        return cls(
            str(data["kind"]), str(data["fqn"]), float(data["saved_bytes"]), float(data["transfer_bytes"]), float(data["cost_s"])
        )


@dataclass(frozen=True)
class MemoryPlan:
    """Every checkpoint and offload decision of a plan, and what they add up to."""

    target: str  # where offloaded tensors live: "cpu" (pinned host memory) or "disk"
    prefetch: bool  # fetch each offloaded tensor one use ahead, overlapping compute
    checkpoint: tuple[CheckpointSegment, ...] = ()
    offload: tuple[OffloadEntry, ...] = ()
    # Segments whose saved activations go to the target in forward and come back in backward.
    offload_activations: tuple[CheckpointSegment, ...] = ()
    peak_before_bytes: float = 0.0  # the sharding's own predicted peak
    peak_bytes: float = 0.0  # the predicted peak with these decisions
    added_s: float = 0.0  # recompute plus the transfer time not hidden behind compute

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise PlanError(
                f"offload target must be one of {', '.join(TARGETS)}, got {self.target!r}: re-plan, or fix the plan file"
            )

    def offloaded(self, kind: str) -> list[str]:
        """FQNs whose ``kind`` (param, grad, optimizer_state) is offloaded, in plan order."""
        return [entry.fqn for entry in self.offload if entry.kind == kind]

    @property
    def saved_bytes(self) -> float:
        return self.peak_before_bytes - self.peak_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "prefetch": self.prefetch,
            "checkpoint": [segment.to_json() for segment in self.checkpoint],
            "offload": [entry.to_json() for entry in self.offload],
            "offload_activations": [segment.to_json() for segment in self.offload_activations],
            "peak_before_bytes": self.peak_before_bytes,
            "peak_bytes": self.peak_bytes,
            "added_s": self.added_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MemoryPlan:
        return cls(
            target=str(data["target"]),
            prefetch=bool(data["prefetch"]),
            checkpoint=tuple(CheckpointSegment.from_json(s) for s in data.get("checkpoint", ())),
            offload=tuple(OffloadEntry.from_json(e) for e in data.get("offload", ())),
            offload_activations=tuple(CheckpointSegment.from_json(s) for s in data.get("offload_activations", ())),
            peak_before_bytes=float(data.get("peak_before_bytes", 0.0)),
            peak_bytes=float(data.get("peak_bytes", 0.0)),
            added_s=float(data.get("added_s", 0.0)),
        )

    def summary_lines(self) -> list[str]:
        """What the summary prints: each decision with the bytes it saves and the time it costs."""
        lines = [
            f"memory decisions: peak {format_bytes(self.peak_before_bytes)} -> {format_bytes(self.peak_bytes)}, "
            f"+{self.added_s * 1e3:.2f} ms per step; offload to {self.target}"
            f"{' with prefetch' if self.prefetch else ''}"
        ]
        # Decisions that save nothing at the peak (kept for the runtime) are left out of the summary.
        quiet = 0
        for segment in self.checkpoint:
            if segment.saved_bytes < 1:
                quiet += 1
                continue
            lines.append(
                f"  checkpoint{f' ({segment.policy})' if segment.policy != 'full' else ''} {segment.name} "
                f"({segment.first} .. {segment.last}): "
                f"saves {format_bytes(segment.saved_bytes)}, recompute {segment.cost_s * 1e3:.2f} ms"
            )
        for segment in self.offload_activations:
            if segment.saved_bytes < 1:
                quiet += 1
                continue
            lines.append(
                f"  offload activations of {segment.name} ({segment.first} .. {segment.last}): "
                f"saves {format_bytes(segment.saved_bytes)}, transfers {segment.cost_s * 1e3:.2f} ms"
            )
        for entry in self.offload:
            if entry.saved_bytes < 1:
                quiet += 1
                continue
            lines.append(
                f"  offload {entry.kind} {entry.fqn}: saves {format_bytes(entry.saved_bytes)}, "
                f"moves {format_bytes(entry.transfer_bytes)} in {entry.cost_s * 1e3:.2f} ms"
            )
        if quiet:
            lines.append(f"  ({quiet} more decision{'s' * (quiet != 1)} that save nothing at the peak)")
        return lines


__all__ = [
    "TARGETS",
    "OFFLOAD_KINDS",
    "CHECKPOINT_POLICIES",
    "ATTENTION_KERNELS",
    "SELECTIVE_KEEPS",
    "selective_keeps",
    "SELECTIVE_OP_MATMULS",
    "selective_op_role",
    "selective_op_kept",
    "CheckpointSegment",
    "OffloadEntry",
    "MemoryPlan",
]
