"""The plan: a frozen, versioned record of every sharding decision, saved as JSON.

A plan is keyed by node names of the traced graph plus the graph's structural hash, and by
parameter FQNs. It holds decisions only; the passes carry them out. Nothing is pickled.
See docs/plan-format.md for the format.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch

from autopar.errors import PlanError
from autopar.ir.memory import MemoryPlan
from autopar.ir.options import MixedPrecision
from autopar.ir.pipeline import StagePlan
from autopar.ir.summary import summary_text
from autopar.ir.spec import Spec, format_spec, parse_spec
from autopar.ir.spec import transition_steps

PLAN_VERSION = 1
SCHEMA_PATH = Path(__file__).parent / "plan.schema.json"


@functools.lru_cache(maxsize=1)
def plan_schema() -> dict[str, Any]:
    """The JSON Schema of plan files (``autopar/ir/plan.schema.json``)."""
    return json.loads(SCHEMA_PATH.read_text())


@functools.lru_cache(maxsize=1)
def _validator():
    import jsonschema

    # The same schema with every local $ref replaced by its definition: resolving a $ref per
    # node costs half the time of validating a large plan.
    schema = plan_schema()
    defs = schema["$defs"]

    def inline(value: Any) -> Any:
        if isinstance(value, dict):
            if "$ref" in value:
                return inline(defs[value["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(v) for key, v in value.items() if key != "$defs"}
        if isinstance(value, list):
            return [inline(v) for v in value]
        return value

    return jsonschema.Draft202012Validator(inline(schema))


def validate_plan_json(data: Any) -> None:
    """Raise PlanError naming the first place where ``data`` breaks the plan schema."""
    import jsonschema

    validator = _validator()
    if validator.is_valid(data):
        return
    error = jsonschema.exceptions.best_match(validator.iter_errors(data))
    where = "/".join(str(part) for part in error.absolute_path) or "(top level)"
    raise PlanError(
        f"malformed plan: at {where}, {error.message} (autopar/ir/plan.schema.json); the file is damaged "
        "or was not written by autopar: re-plan (docs/plan-format.md describes the format)"
    )


def evaluate_symbolic(symbolic: dict[str, Any], batch: int) -> dict[str, float]:
    """Substitute ``B = batch`` in the plan's symbolic costs (``predicted["symbolic"]``)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    symbol = sympy.Symbol(symbolic["symbol"], positive=True)
    out = {}
    for key in ("step_time_s", "comm_bytes", "peak_memory_bytes"):
        value = float(sympy.sympify(symbolic[key], locals={symbolic["symbol"]: symbol}).subs(symbol, batch))
        out[key] = value if key == "step_time_s" else float(round(value))
    return out


@dataclass(frozen=True, slots=True)
class NodePlan:
    """The decision for one graph node."""

    op: str
    outs: tuple[Spec, ...]
    ins: tuple[Spec, ...]
    inputs: tuple[tuple[str, int], ...]  # (producer node, output index) per tensor input
    shapes: tuple[tuple[int, ...], ...]  # global output shapes
    kernel: str | None = None
    kernel_axes: tuple[int, ...] = ()
    source: str = "rule"  # rule | dtensor | fallback | placeholder | follow | output
    cost_s: float = 0.0
    whole_grad: tuple[tuple[int, int], ...] = ()  # (input, axis): replicated input, gradient whole

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": self.op,
            "out": [format_spec(s) for s in self.outs],
            "in": [format_spec(s) for s in self.ins],
            "inputs": [[name, index] for name, index in self.inputs],
            "shape": [list(s) for s in self.shapes],
            "source": self.source,
            "cost_s": self.cost_s,
        }
        if self.kernel:
            out["kernel"] = self.kernel
            out["kernel_axes"] = list(self.kernel_axes)
        if self.whole_grad:
            out["whole_grad"] = [list(pair) for pair in self.whole_grad]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "NodePlan":
        return cls(
            op=data["op"],
            outs=tuple(parse_spec(s) for s in data["out"]),
            ins=tuple(parse_spec(s) for s in data["in"]),
            inputs=tuple((name, int(index)) for name, index in data["inputs"]),
            shapes=tuple(tuple(s) for s in data["shape"]),
            kernel=data.get("kernel"),
            kernel_axes=tuple(data.get("kernel_axes", ())),
            source=data.get("source", "rule"),
            cost_s=float(data.get("cost_s", 0.0)),
            whole_grad=tuple((int(i), int(a)) for i, a in data.get("whole_grad", ())),
        )


@dataclass(frozen=True)
class Plan:
    mesh_shape: tuple[int, ...]
    graph_hash: str
    params: dict[str, Spec]  # parameter and buffer FQN → spec
    nodes: dict[str, NodePlan]  # node name → decision, in graph order
    predicted: dict[str, Any]
    solver: dict[str, Any] = field(default_factory=dict)
    cluster: str = ""
    torch_version: str = field(default_factory=lambda: torch.__version__)
    version: int = PLAN_VERSION
    # Representative node → the decision's chosen strategy and runner-ups with their costs
    # (``autopar.solver.pricing.runner_ups``); read by ``autopar explain``.
    decisions: dict[str, Any] = field(default_factory=dict)
    # How to rebuild the model (the CLI's MODEL_SPEC and batch settings), for ``autopar check``.
    model: dict[str, Any] = field(default_factory=dict)
    # Pipeline stages (``autopar.ir.pipeline``); None when the plan does not pipeline. When set,
    # ``params`` and ``nodes`` hold the intra-stage decisions, for ``pipeline.stage_mesh``.
    pipeline: StagePlan | None = None
    # Activation checkpointing and offload (``autopar.ir.memory``); None when sharding alone fits
    # the memory budget (or the planner was not allowed to add them).
    memory: MemoryPlan | None = None
    # Bytes alive per device by kind over forward and backward, sampled (``cost.liveness.Timeline.
    # sampled``), for the HTML report; None in plans made before it was recorded.
    memory_timeline: dict[str, Any] | None = None
    # Placeholder (user input, parameter, buffer) node name -> dtype ("torch.float32"), so that a
    # plan refused for another graph can say whose dtype changed; empty in older plans.
    input_dtypes: dict[str, str] = field(default_factory=dict)
    # The precision policy the plan is priced for and the runtime carries out
    # (``autopar.ir.options.MixedPrecision``); None for plans that predate it, read as "32-true".
    precision: MixedPrecision | None = None
    # Facts about the run that made this plan, such as wall-clock timings and the mesh search
    # table. Not serialized: a plan's JSON must be byte-identical across runs and ranks.
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.mesh_shape or any(int(n) < 1 for n in self.mesh_shape):
            raise PlanError(f"plan mesh shape must be positive integers, got {self.mesh_shape}")
        for fqn, spec in self.params.items():
            if len(spec) != len(self.spec_mesh):
                raise PlanError(f"param {fqn!r} has {len(spec)} placements for a {len(self.spec_mesh)}-axis mesh")

    @property
    def spec_mesh(self) -> tuple[int, ...]:
        """The mesh the node and parameter specs are for: the stage mesh of a pipelined plan."""
        return tuple(self.pipeline.stage_mesh) if self.pipeline is not None else tuple(self.mesh_shape)

    # -- serialization ------------------------------------------------------------------------
    def to_json(self) -> str:
        data = {
            "version": self.version,
            "torch_version": self.torch_version,
            "mesh": {"shape": list(self.mesh_shape)},
            "graph_hash": self.graph_hash,
            "cluster": self.cluster,
            "predicted": self.predicted,
            "solver": self.solver,
            "params": {fqn: format_spec(spec) for fqn, spec in self.params.items()},
            "nodes": {name: node.to_json() for name, node in self.nodes.items()},
        }
        if self.model:
            data["model"] = self.model
        if self.decisions:
            data["decisions"] = self.decisions
        if self.pipeline is not None:
            data["pipeline"] = self.pipeline.to_json()
        if self.memory is not None:
            data["memory"] = self.memory.to_json()
        if self.memory_timeline is not None:
            data["memory_timeline"] = self.memory_timeline
        if self.input_dtypes:
            data["input_dtypes"] = self.input_dtypes
        if self.precision is not None:
            data["precision"] = self.precision.to_json()
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, *, validate: bool = True) -> "Plan":
        """The plan in ``text``, checked against the plan schema unless ``validate=False`` (for
        text already checked: every rank parses the plan rank 0 checked before broadcasting it)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"plan is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"plan format version {version!r}; this autopar reads version {PLAN_VERSION}: re-plan")
        if validate:
            validate_plan_json(data)
        try:
            return cls(
                mesh_shape=tuple(int(n) for n in data["mesh"]["shape"]),
                graph_hash=data["graph_hash"],
                params={fqn: parse_spec(spec) for fqn, spec in data["params"].items()},
                nodes={name: NodePlan.from_json(node) for name, node in data["nodes"].items()},
                predicted=data["predicted"],
                solver=data.get("solver", {}),
                cluster=data.get("cluster", ""),
                torch_version=data.get("torch_version", ""),
                version=version,
                decisions=data.get("decisions", {}),
                model=data.get("model", {}),
                pipeline=StagePlan.from_json(data["pipeline"]) if "pipeline" in data else None,
                memory=MemoryPlan.from_json(data["memory"]) if "memory" in data else None,
                memory_timeline=data.get("memory_timeline"),
                input_dtypes=data.get("input_dtypes", {}),
                precision=MixedPrecision.from_json(data["precision"]) if "precision" in data else None,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"malformed plan: {type(error).__name__}: {error}") from None

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as handle:
            handle.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        try:
            with open(path) as handle:
                return cls.from_json(handle.read())
        except FileNotFoundError:
            raise PlanError(f"plan file {os.fspath(path)!r} does not exist") from None

    def with_model(self, model: dict[str, Any]) -> "Plan":
        """This plan, recording how to rebuild its model (``model`` goes into the JSON)."""
        return dataclasses.replace(self, model=dict(model), stats=self.stats)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]

    # -- reporting ----------------------------------------------------------------------------
    def redistributions(self) -> list[tuple[str, str, Spec, Spec]]:
        """(producer, consumer, src spec, dst spec) for every edge whose spec changes."""
        found = []
        for name, node in self.nodes.items():
            for (producer, index), dst in zip(node.inputs, node.ins):
                src = self.nodes[producer].outs[index]
                if src != dst:
                    found.append((producer, name, src, dst))
        return found

    def collective_counts(self) -> dict[tuple[str, int], int]:
        """How many collectives of each (kind, mesh axis) the forward runs, sorted by key."""
        counts: Counter = Counter()
        for _producer, _consumer, src, dst in self.redistributions():
            for step in transition_steps(src, dst) or ():
                counts[(step.kind, step.axis)] += 1
        return dict(sorted(counts.items()))

    def predict(self, batch: int) -> dict[str, float]:
        """Predicted ``step_time_s``, ``comm_bytes`` and ``peak_memory_bytes`` at another batch
        size, from the plan's symbolic costs (``autopar.plan(..., symbolic_batch=True)``), with
        the same strategies and no tracing."""
        if "symbolic" not in self.predicted:
            raise PlanError(
                "this plan has no symbolic costs: make it with autopar.plan(..., symbolic_batch=True) "
                "to predict other batch sizes"
            )
        return evaluate_symbolic(self.predicted["symbolic"], batch)

    def summary(self, max_rows: int = 60) -> str:
        return summary_text(self, max_rows=max_rows)

    def __repr__(self) -> str:
        return (
            f"Plan(mesh={self.mesh_shape}, nodes={len(self.nodes)}, params={len(self.params)}, "
            f"step_time_s={self.predicted.get('step_time_s', float('nan')):.3g}, hash={self.hash})"
        )
