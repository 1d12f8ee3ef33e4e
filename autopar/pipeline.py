"""Pipeline stages: the part of a plan that splits the graph into stages run one after another.

A pipelined plan cuts mesh axis 0 into ``len(stages)`` equal groups of ranks. Each stage runs a
contiguous range of the graph's layers on its own group, whose mesh is ``stage_mesh``; the plan's
node and parameter decisions are then the intra-stage decisions, made for ``stage_mesh`` on the
graph traced at the size of one microbatch. The stage planner (``autopar.solver.stages``)
chooses this record; the split pass and the pipeline runtime carry it out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEDULES = ("1F1B", "GPipe")


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
    def from_json(cls, data: dict[str, Any]) -> "Stage":
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
    stages: tuple[Stage, ...]
    step_time_s: float  # 1F1B / GPipe: sum of stage times + (m - 1) * the slowest (+ gradient sync, once)
    bubble_fraction: float  # share of the step the devices of a stage sit idle, on average

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {self.num_microbatches}")

    @property
    def num_stages(self) -> int:
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
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "StagePlan":
        return cls(
            num_microbatches=int(data["num_microbatches"]),
            schedule=data["schedule"],
            stage_mesh=tuple(int(n) for n in data["stage_mesh"]),
            stages=tuple(Stage.from_json(s) for s in data["stages"]),
            step_time_s=float(data["step_time_s"]),
            bubble_fraction=float(data["bubble_fraction"]),
        )


def bubble_fraction(stage_times_s: list[float], num_microbatches: int) -> float:
    """Idle share of a GPipe/1F1B step: 1 - (m * sum t) / (S * (sum t + (m - 1) * max t))."""
    total = sum(stage_times_s)
    if not stage_times_s or total <= 0:
        return 0.0
    step = total + (num_microbatches - 1) * max(stage_times_s)
    return 1.0 - num_microbatches * total / (len(stage_times_s) * step)
