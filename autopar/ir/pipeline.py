"""Pipeline stages: the part of a plan that splits the graph into stages run one after another.

A pipelined plan cuts mesh axis 0 into ``len(stages)`` equal groups of ranks. Each stage runs a
contiguous range of the graph's layers on its own group, whose mesh is ``stage_mesh``; the plan's
node and parameter decisions are then the intra-stage decisions, made for ``stage_mesh`` on the
graph traced at the size of one microbatch. The stage planner (``autopar.solver.planners.stages``)
chooses this record; the split pass and the pipeline runtime carry it out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autopar.errors import ConfigError, InternalError, MeshError, ModelError, PlanError

# torch.distributed.pipelining's Schedule1F1B, ScheduleGPipe (one stage per rank),
# ScheduleInterleaved1F1B and ScheduleZBVZeroBubble (``virtual_stages`` model stages per rank).
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "ZBV")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "ZBV")
PLANNED_SCHEDULES = ("1F1B", *MULTI_STAGE_SCHEDULES)  # what the stage planner chooses among (GPipe stands in for 1F1B)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage."""

    index: int
    layers: tuple[int, int]  # [first, last) in the planner's layer clustering
    nodes: tuple[str, ...]  # forward-graph node names this stage runs, in graph order
    ranks: tuple[int, ...]  # global ranks of the stage's group, in stage-mesh order
    time_s: float  # predicted forward + backward time of one microbatch
    memory_bytes: float  # predicted peak, counting the microbatches in flight on this stage

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": list(self.layers),
            "nodes": list(self.nodes),
            "ranks": list(self.ranks),
            "time_s": self.time_s,
            "memory_bytes": self.memory_bytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Stage:
        return cls(
            index=int(data["index"]),
            layers=(int(data["layers"][0]), int(data["layers"][1])),
            nodes=tuple(data["nodes"]),
            ranks=tuple(int(r) for r in data["ranks"]),
            time_s=float(data["time_s"]),
            memory_bytes=float(data["memory_bytes"]),
        )


@dataclass(frozen=True)
class StagePlan:
    """The stages of a pipelined plan and their predicted step (see the module docstring)."""

    num_microbatches: int
    schedule: str  # one of SCHEDULES
    stage_mesh: tuple[int, ...]  # the mesh every stage's intra-stage plan is made for
    stages: tuple[Stage, ...]  # the model stages, in model order (virtual_stages per rank group)
    step_time_s: float  # the schedule's step (``solver.pricing.schedules``), gradient sync included once
    bubble_fraction: float  # share of the step the devices of a stage sit idle, on average
    virtual_stages: int = 1  # model stages per rank group: 1, or more under MULTI_STAGE_SCHEDULES
    reason: str = ""  # why the planner chose this schedule, microbatches and stage count
    # The parameters a stage gathers are gathered once a step and held whole through every
    # microbatch, their gradients summed whole and reduce-scattered once (torchtitan's FSDP under
    # a pipeline); False: gathered, and reduced, in each microbatch (``passes.held``).
    hold_gathered: bool = False

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise PlanError(f"pipeline schedule must be one of {SCHEDULES}, got {self.schedule!r}: re-plan, or fix the plan file")
        if self.num_microbatches < 1:
            raise PlanError(f"num_microbatches must be at least 1, got {self.num_microbatches}: re-plan, or fix the plan file")
        if self.virtual_stages < 1 or len(self.stages) % self.virtual_stages:
            raise PlanError(
                f"{len(self.stages)} stages cannot be {self.virtual_stages} virtual stages per rank group: re-plan, or fix the plan file"
            )
        if self.hold_gathered and self.schedule == "ZBV":
            raise PlanError(
                "hold_gathered=True under schedule 'ZBV', whose weight-gradient passes need the gathers in the "
                "microbatches' graphs: re-plan, or fix the plan file (hold_gathered false, or another schedule)"
            )
        if (self.virtual_stages > 1) != (self.schedule in MULTI_STAGE_SCHEDULES):
            raise PlanError(
                f"schedule {self.schedule!r} with virtual_stages={self.virtual_stages}: "
                f"{MULTI_STAGE_SCHEDULES} run several stages per rank group, the others one: re-plan, or fix the plan file"
            )

    @property
    def num_stages(self) -> int:
        """Rank groups (mesh axis 0 is cut into this many)."""
        return len(self.stages) // self.virtual_stages

    @property
    def num_model_stages(self) -> int:
        """Stages the model is cut into: ``num_stages * virtual_stages``."""
        return len(self.stages)

    def stage_of(self) -> dict[str, int]:
        """Node name → stage index."""
        return {name: stage.index for stage in self.stages for name in stage.nodes}

    def to_json(self) -> dict[str, Any]:
        return {
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "stage_mesh": list(self.stage_mesh),
            "step_time_s": self.step_time_s,
            "bubble_fraction": self.bubble_fraction,
            "stages": [stage.to_json() for stage in self.stages],
            "virtual_stages": self.virtual_stages,
            "reason": self.reason,
            **({"hold_gathered": True} if self.hold_gathered else {}),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StagePlan:
        return cls(
            num_microbatches=int(data["num_microbatches"]),
            schedule=data["schedule"],
            stage_mesh=tuple(int(n) for n in data["stage_mesh"]),
            stages=tuple(Stage.from_json(s) for s in data["stages"]),
            step_time_s=float(data["step_time_s"]),
            bubble_fraction=float(data["bubble_fraction"]),
            virtual_stages=int(data.get("virtual_stages", 1)),
            reason=str(data.get("reason", "")),
            hold_gathered=bool(data.get("hold_gathered", False)),
        )


def bubble_fraction(stage_times_s: list[float], num_microbatches: int) -> float:
    """Idle share of a GPipe/1F1B step: 1 - (m * sum t) / (S * (sum t + (m - 1) * max t))."""
    total = sum(stage_times_s)
    if not stage_times_s or total <= 0:
        return 0.0
    step = total + (num_microbatches - 1) * max(stage_times_s)
    return 1.0 - num_microbatches * total / (len(stage_times_s) * step)


# Stage meshes, stage ranks and microbatches: what the planner, the split pass and the runtime share.
def stage_mesh_of(mesh_shape: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """The mesh of one stage: mesh axis 0 cut into ``num_stages`` equal rank groups."""
    check_num_stages(mesh_shape[0], num_stages)
    return (mesh_shape[0] // num_stages, *mesh_shape[1:])


def check_num_stages(axis0: int, num_stages: int, where: str | None = None) -> None:
    """Pipeline stages cut ``axis0`` ranks (mesh axis 0, or ``where`` says what) into equal groups:
    a ValueError (MeshError) naming the cause and the fix otherwise."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"pipeline must be 'off', 'auto' or a positive number of stages, got {num_stages!r}")
    if axis0 % num_stages:
        divisors = [s for s in range(1, axis0 + 1) if axis0 % s == 0]
        raise MeshError(
            f"pipeline={num_stages} stages must divide {where or f'mesh axis 0 ({axis0})'} into equal "
            f"rank groups: use one of {divisors}, or a mesh whose axis 0 divides by {num_stages}"
        )


def stage_ranks(mesh_shape: Sequence[int], num_stages: int) -> list[tuple[int, ...]]:
    """Global ranks of each stage, in stage-mesh (row-major) order."""
    grid = torch.arange(math.prod(mesh_shape)).reshape(num_stages, -1)
    return [tuple(int(r) for r in row) for row in grid]


def group_of(schedule: str, num_groups: int, stage: int) -> int:
    """The rank group that runs model stage ``stage`` under ``schedule``, as torch's schedules
    place them: ZBV in a V (stages g and 2S − 1 − g on group g), the others round robin."""
    if schedule == "ZBV":
        return stage if stage < num_groups else 2 * num_groups - 1 - stage
    return stage % num_groups


def schedule_for(num_stages: int, num_microbatches: int) -> str:
    """1F1B holds fewer microbatches in flight, but needs at least as many microbatches as stages."""
    return "1F1B" if num_microbatches >= num_stages else "GPipe"


def stage_of_nodes(stage_plan: StagePlan, gm: torch.fx.GraphModule) -> dict[str, int]:
    """Stage of every non-placeholder node of ``gm``: the plan's stage for the traced nodes, and
    for nodes a pass inserted (collectives), the stage of the node that consumes them."""
    planned = stage_plan.stage_of()
    stage: dict[str, int] = {}
    # A segment outlined into a submodule (a checkpointed layer) runs in the stage of the nodes it
    # holds, and so do the getitems that take its outputs apart.
    for node in gm.graph.nodes:
        body = getattr(gm.get_submodule(node.target), "body", None) if node.op == "call_module" else None
        inside = {planned[n.name] for n in body.graph.nodes if n.name in planned} if body is not None else set()
        if len(inside) > 1:
            raise InternalError(
                f"{node.format_node()} outlines nodes of pipeline stages {sorted(inside)}: a segment must lie in one stage"
            )
        if inside:
            stage[node.name] = inside.pop()
            for user in node.users:
                stage[user.name] = stage[node.name]
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "output") or node.name in stage:
            continue
        if node.name in planned:
            stage[node.name] = planned[node.name]
            continue
        users = [stage[u.name] for u in node.users if u.name in stage]
        if any(u.op == "output" for u in node.users):
            users.append(stage_plan.num_model_stages - 1)
        if not users:
            raise InternalError(f"node {node.format_node()} is in no pipeline stage and has no consumer in one")
        stage[node.name] = min(users)
    return stage


def batch_size_of(example_inputs, example_kwargs) -> int:
    """Dim 0 shared by every tensor input: the batch that pipelining cuts into microbatches."""
    leaves = torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {}))
    sizes = {tuple(t.shape)[0] if t.dim() else None for t in leaves if isinstance(t, torch.Tensor)}
    if not sizes:
        raise ModelError(
            "pipelining cuts the example inputs' dim 0 into microbatches, but no input is a tensor: pass the batch "
            "as tensor inputs (dim 0 the batch), or compile without a pipeline"
        )
    if len(sizes) > 1 or None in sizes:
        raise ModelError(
            f"pipelining cuts every tensor input on dim 0 into microbatches, but the inputs' dim 0 sizes are "
            f"{sorted(sizes, key=str)}: give every tensor input the batch as its dim 0"
        )
    return sizes.pop()


def check_num_microbatches(num_microbatches, batch: int) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ConfigError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    if batch % num_microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ConfigError(
            f"num_microbatches={num_microbatches} does not divide the batch of {batch} (dim 0 of the example "
            f"inputs) into equal microbatches: use one of {divisors}, or a batch that divides by {num_microbatches}"
        )


def first_microbatch(example_inputs, example_kwargs, num_microbatches: int):
    """The example inputs cut to one microbatch (the first 1/m of dim 0 of every tensor)."""
    batch = batch_size_of(example_inputs, example_kwargs)
    check_num_microbatches(num_microbatches, batch)
    size = batch // num_microbatches

    def cut(value):
        return value[:size].clone() if isinstance(value, torch.Tensor) else value

    return torch.utils._pytree.tree_map(cut, tuple(example_inputs)), torch.utils._pytree.tree_map(cut, example_kwargs)
