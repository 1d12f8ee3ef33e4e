"""What ``compile`` runs of a plan that holds padded parameter shards, and what it refuses first.

A padded shard (``ir.spec.padded_axis``: FSDP2's ``Shard(0)`` on a mesh axis that does not
divide dim 0) moves only through the scheduled FSDP gather and its reduce-scatter
(``ops.buckets``), which pad each rank's piece to ``ceil(n / k)`` rows. Everything else that
would move one (a plain collective, the compiled mode's traced gathers, a pipeline stage, the
offload store) would see pieces of different sizes, so ``compile`` refuses such a plan before it
builds anything, naming the fix.
"""

from __future__ import annotations

import torch

from autopar.errors import PlanError
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.spec import padded_axis
from autopar.trace import TracedModel


def padded_params(plan: Plan, traced: TracedModel) -> list[str]:
    """The FQNs of the parameters ``plan`` holds as padded shards, in graph order."""
    return [fqn for fqn, _, _ in padded_placeholders(plan, traced).values()]


def padded_placeholders(plan: Plan, traced: TracedModel) -> dict[str, tuple[str, int, int]]:
    """The parameters ``plan`` holds as padded shards, by placeholder name, in graph order: each
    one's FQN, padded mesh axis and rows (dim 0)."""
    shapes = {
        node.name: tuple(node.meta["val"].shape)
        for node in traced.gm.graph.nodes
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor)  # not a traced scalar
    }
    found = {}
    for graph_input in traced.placeholders("param"):
        spec, shape = plan.params.get(graph_input.fqn), shapes.get(graph_input.name)
        axis = None if spec is None or shape is None else padded_axis(shape, spec, plan.mesh_shape)
        if axis is not None:
            found[graph_input.name] = (graph_input.fqn, axis, shape[0])
    return found


def check_padded_plan(plan: Plan, traced: TracedModel, options: PlanOptions, compiler: str | None) -> None:
    """PlanError where ``plan`` holds padded shards that this compile could not move."""
    padded = padded_params(plan, traced)
    if not padded:
        return
    offloaded = set(plan.memory.offloaded("param")) if plan.memory is not None else set()
    reasons = [
        (plan.pipeline is not None, "a pipeline stage does not gather padded shards yet"),
        (compiler is not None, f"compiler={compiler!r} traces its gathers unpadded: compile without compiler="),
        (
            not options.comm.enabled,
            "the communication schedule is off (CommOptions(enabled=False)), and only its FSDP gather pads the pieces",
        ),
        (bool(offloaded & set(padded)), "the plan offloads one, and the offload store keeps equal pieces only"),
    ]
    for refused, why in reasons:
        if refused:
            names = ", ".join(padded[:4]) + (f" and {len(padded) - 4} more" if len(padded) > 4 else "")
            raise PlanError(
                f"the plan holds {names} as padded shards (Shard(0) on a mesh axis that does not divide dim 0, "
                f"FSDP2's uneven layout), but {why}. Compile it otherwise, or plan on a mesh whose sizes divide "
                "the parameters' dims"
            )
