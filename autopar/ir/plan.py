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
import math
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sympy
import torch
from torch.distributed.tensor import Replicate

from autopar.errors import ConfigError, ConfigTypeError, PlanError
from autopar.ir.data import DataLayout
from autopar.ir.memory import MemoryPlan
from autopar.ir.options import DEFAULT_OPTIMIZER, MixedPrecision
from autopar.ir.pipeline import StagePlan
from autopar.ir.prediction import Prediction, SolverStats
from autopar.ir.spec import (
    Spec,
    format_placement,
    format_spec,
    is_sharded,
    is_strided,
    padded_axis,
    parse_spec,
    shard_axes,
    spec_text,
    transition_steps,
)
from autopar.ir.summary import summary_text

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


def _check_spec(spec: Spec, shape: tuple[int, ...], mesh: tuple[int, ...], where: str, param: bool = False) -> None:
    """PlanError naming ``where`` when ``spec`` cannot hold a tensor of ``shape`` on ``mesh`` (a
    ``param`` may be a padded shard, ``spec.padded_axis``)."""
    problem = None
    if param and len(spec) == len(mesh) and padded_axis(shape, spec, mesh) is not None:
        return
    if len(spec) != len(mesh):
        problem = f"are {len(spec)} for a {len(mesh)}-axis mesh {mesh}"
    else:
        for axis, placement in enumerate(spec):
            dim = getattr(placement, "dim", None)
            if is_sharded(placement) and not 0 <= dim < len(shape):
                problem = f"shards dim {dim} of a {len(shape)}-dim tensor of shape {tuple(shape)} (mesh axis {axis})"
            elif mesh[axis] == 1 and not isinstance(placement, Replicate):
                problem = f"puts {format_placement(placement)} on mesh axis {axis}, of size 1, which carries only R"
            elif is_strided(placement) and shape[dim] % (placement.split_factor * mesh[axis]):
                problem = (
                    f"cuts dim {dim} (size {shape[dim]}) into {placement.split_factor} blocks of "
                    f"{mesh[axis]} shards, which do not divide it"
                )
            elif is_sharded(placement) and shape[dim] % math.prod(mesh[a] for a in shard_axes(spec, dim)):
                problem = f"shards dim {dim} (size {shape[dim]}) unevenly over mesh axes {shard_axes(spec, dim)}"
            if problem:
                break
    if problem:
        raise PlanError(
            f"invalid plan: {where} has placements {spec_text(spec)}, which {problem}. The plan was "
            "edited or damaged: re-plan, or fix this placement (docs/plan-format.md)"
        )


def placeholder_names(fqn: str) -> tuple[str, str]:
    """The names torch.export gives the placeholder of parameter ``fqn`` and of buffer ``fqn``
    ("p_" / "b_" and the path with its dots as underscores), which plans are keyed by: the one
    place that spells the convention."""
    flat = fqn.replace(".", "_")
    return "p_" + flat, "b_" + flat


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def evaluate_symbolic(symbolic: Mapping[str, Any], batch: int) -> dict[str, float]:
    """Substitute ``B = batch`` in the plan's symbolic costs (``predicted.symbolic``)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ConfigError(f"batch must be a positive integer (the batch size to predict for), got {batch!r}")
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
    def from_json(cls, data: dict[str, Any]) -> NodePlan:
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
    predicted: Prediction
    solver: SolverStats = field(default_factory=SolverStats)
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
    # How the compiled module takes its data (``autopar.ir.data``): the batch mode and the mesh
    # axes that split the batch; None in plans that predate it (read as whole batches).
    data: DataLayout | None = None
    # What tracing or planning changed about the model's behaviour, in words (a cache dropped).
    notes: tuple[str, ...] = ()
    # The optimizer the step is priced for (``PlanOptions.optimizer``), which the runtime holds a
    # torch optimizer over the module's parameters to (``runtime.optim_guard``).
    optimizer: str = DEFAULT_OPTIMIZER
    # The layers ("model.layers.31"; "" for the root) whose gathered parameters stay from forward
    # to backward, as the planner chose under ``CommOptions(reshard_after_forward="auto")`` or as
    # the planning call's own value says (every other FSDP layer is resharded after forward); what
    # ``compile`` runs under "auto". None: FSDP2's default, the root's alone.
    kept_layers: tuple[str, ...] | None = None
    # Facts about the run that made this plan, such as wall-clock timings and the mesh search
    # table. Not serialized: a plan's JSON must be byte-identical across runs and ranks.
    stats: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.predicted, Prediction) or not isinstance(self.solver, SolverStats):
            raise ConfigTypeError(
                f"Plan takes predicted=Prediction(...) and solver=SolverStats(...) "
                f"(autopar.ir.prediction), got {type(self.predicted).__name__} and "
                f"{type(self.solver).__name__}: Prediction.from_json(d) reads a dict"
            )
        if not self.mesh_shape or any(int(n) < 1 for n in self.mesh_shape):
            raise PlanError(f"plan mesh shape must be positive integers, got {self.mesh_shape}")
        for fqn, spec in self.params.items():
            if len(spec) != len(self.spec_mesh):
                raise PlanError(f"param {fqn!r} has {len(spec)} placements for a {len(self.spec_mesh)}-axis mesh")

    def placeholder(self, fqn: str) -> NodePlan | None:
        """The decision of parameter or buffer ``fqn``'s placeholder, or None where the plan has
        none (``placeholder_names``)."""
        return next((self.nodes[name] for name in placeholder_names(fqn) if name in self.nodes), None)

    @property
    def declares_optimizer(self) -> bool:
        """Whether the plan is priced for an optimizer the loop declared (``optimizer``), not
        torch's default AdamW for the devices."""
        return self.optimizer != DEFAULT_OPTIMIZER

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
            "predicted": self.predicted.to_json(),
            "solver": self.solver.to_json(),
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
        if self.data is not None:
            data["data"] = self.data.to_json()
        if self.notes:
            data["notes"] = list(self.notes)
        if self.declares_optimizer:
            data["optimizer"] = self.optimizer
        if self.kept_layers is not None:
            data["kept_layers"] = list(self.kept_layers)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, *, validate: bool = True, source: str = "plan") -> Plan:
        """The plan in ``text``, checked against the plan schema and every placement against its
        tensor and the mesh (``check_placements``) unless ``validate=False`` (for text already
        checked: every rank parses the plan rank 0 checked before broadcasting it). ``source``
        names the text in errors (``Plan.load`` passes the file's path)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(
                f"{source} is not valid JSON ({error}): the file is truncated or damaged, or is not a "
                "plan; re-plan (autopar plan ... --out FILE)"
            ) from None
        if not isinstance(data, dict):
            raise PlanError("plan JSON must be an object")
        version = data.get("version")
        if version != PLAN_VERSION:
            raise PlanError(f"plan format version {version!r}; this autopar reads version {PLAN_VERSION}: re-plan")
        if validate:
            validate_plan_json(data)
        try:
            plan = cls(
                mesh_shape=tuple(int(n) for n in data["mesh"]["shape"]),
                graph_hash=data["graph_hash"],
                params={fqn: parse_spec(spec) for fqn, spec in data["params"].items()},
                nodes={name: NodePlan.from_json(node) for name, node in data["nodes"].items()},
                predicted=Prediction.from_json(data["predicted"]),
                solver=SolverStats.from_json(data.get("solver", {})),
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
                data=DataLayout.from_json(data["data"], tuple(data["mesh"]["shape"])) if "data" in data else None,
                notes=tuple(data.get("notes", ())),
                optimizer=data.get("optimizer", DEFAULT_OPTIMIZER),
                kept_layers=tuple(data["kept_layers"]) if "kept_layers" in data else None,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PlanError(f"malformed plan: {type(error).__name__}: {error}") from None
        if validate:
            plan.check_placements()
        return plan

    def check_placements(self) -> None:
        """Raise PlanError naming the first node or parameter whose placement cannot hold its
        tensor on the plan's mesh: a placement per mesh axis, sharded dims that exist, strided
        blocks and shards that divide the dim, and only R on an axis of size 1 (``spec.is_valid``)."""
        mesh = self.spec_mesh
        for name, node in self.nodes.items():
            where = f"node {name!r} ({node.op})"
            param = node.op == "param" or self._casts_param(node)  # may hold a padded shard
            for index, (spec, shape) in enumerate(zip(node.outs, node.shapes)):
                _check_spec(spec, shape, mesh, f"{where}, output {index}", param)
            for index, ((producer, out_index), spec) in enumerate(zip(node.inputs, node.ins)):
                shapes = self.nodes[producer].shapes if producer in self.nodes else ()
                if out_index < len(shapes):
                    _check_spec(spec, shapes[out_index], mesh, f"{where}, input {index} (from {producer!r})", param)
        for fqn, spec in self.params.items():
            node = self.placeholder(fqn)
            if node is not None and node.shapes:
                _check_spec(spec, node.shapes[0], mesh, f"parameter {fqn!r}", node.op == "param")

    def _casts_param(self, node: NodePlan) -> bool:
        """Whether ``node`` casts a parameter (``_to_copy`` of one): a precision policy's cast of a
        padded shard takes and gives the padded piece (``solver.problem.padded_casts``)."""
        producer = self.nodes.get(node.inputs[0][0]) if len(node.inputs) == 1 else None
        return node.op == "aten._to_copy.default" and producer is not None and producer.op == "param"

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as handle:
            handle.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Plan:
        """The plan in the file ``path``, checked as ``from_json`` checks it; errors name the file."""
        name = repr(os.fspath(path))
        try:
            with open(path, "rb") as handle:
                raw = handle.read()
        except FileNotFoundError:
            raise PlanError(f"plan file {name} does not exist") from None
        except IsADirectoryError:
            raise PlanError(f"plan file {name} is a directory: pass a plan JSON file") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PlanError(
                f"plan file {name} is not text (byte {error.start} is not UTF-8): it is not a plan JSON "
                "file; pass the file that autopar.plan or `autopar plan --out` wrote"
            ) from None
        try:
            return cls.from_json(text, source=f"plan file {name}")
        except PlanError as error:
            message = str(error)
            raise PlanError(message if name in message else f"plan file {name}: {message}") from None

    def with_model(self, model: dict[str, Any]) -> Plan:
        """This plan, recording how to rebuild its model (``model`` goes into the JSON)."""
        return dataclasses.replace(self, model=dict(model), stats=self.stats)

    @property
    def data_layout(self) -> DataLayout:
        """The plan's data layout; a plan that predates it takes whole batches, split on no axis known."""
        return self.data if self.data is not None else DataLayout("whole", (), tuple(self.mesh_shape))

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
        if self.predicted.symbolic is None:
            raise PlanError(
                "this plan has no symbolic costs: make it with autopar.plan(..., symbolic_batch=True) "
                "to predict other batch sizes"
            )
        return evaluate_symbolic(self.predicted.symbolic, batch)

    def summary(self, max_rows: int = 60) -> str:
        return summary_text(self, max_rows=max_rows)

    def __repr__(self) -> str:
        return (
            f"Plan(mesh={self.mesh_shape}, nodes={len(self.nodes)}, params={len(self.params)}, "
            f"step_time_s={_or_nan(self.predicted.step_time_s):.3g}, hash={self.hash})"
        )
