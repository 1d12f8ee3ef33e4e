"""Colossal-AI's ``parallel`` config as a hand plan: 1D, 2D, 2.5D and 3D tensor parallelism.

A Colossal-AI config says ``parallel = dict(pipeline=2, tensor=dict(mode="2.5d", depth=1, size=4))``.
``ColossalParallel.from_dict`` reads and checks it, ``mesh_shape`` lays the ranks out as
Colossal-AI's process groups do (pipeline outermost, then data, tensor innermost), and
``colossal_specs`` places every linear, norm and embedding parameter, and the residual stream,
as Colossal-AI's layers (``colossalai/legacy/nn/layer/parallel_{1d,2d,2p5d,3d}``) hold them.
The solver then chooses how each op computes on that layout, at the lowest cost: for a 2D or
2.5D linear that is SUMMA's (the input gathered along the row, the weight along the column).
A fused q | k | v projection is split by head (``S(d)/3``), as Colossal-AI's models order it.

Mesh axes of one stage, by mode (``q`` the side of the grid; a ``data`` axis leads when the
world holds more than ``pipeline × size`` ranks):

=====  =========================  =================================================================
mode   stage mesh                 placements (torch's (out, in) linear weight; activations (b, s, h))
=====  =========================  =================================================================
1d     (size,)                    Megatron: column / row linears (``hand_plans.megatron``)
2d     (q row, q col)             x: b on row, h on col; W: in on row, out on col (Optimus)
2.5d   (depth, q row, q col)      as 2d, x's batch also split over depth, W copied over depth
3d     (q weight, q input, q out) x: b on weight and input, h on out; column linears: W's out on
                                  input, in on out and weight; row linears: the groups swapped
=====  =========================  =================================================================

Where the plan differs from Colossal-AI's (``benchmarks/README.md``, bench_colossal.py, measures
the bytes): its 2D/2.5D layers keep biases and norm weights h/q² per rank and all-gather them at
use; here they are h/q (split on the ``col`` axis, copied on the others). Norms gather the hidden
dim, for autopar has no rule for a norm over a split dim (Colossal-AI's all-reduce their
statistics); in 2D and 2.5D the next linear needs it gathered anyway, so the bytes equal SUMMA's.
Its 3D weights nest the weight-group split inside the output-group split (a strided shard, which
autopar's ``S(d)/k`` cannot combine with another shard of the dim); plain shards nest in mesh
order, so here the weight group's split is the outer one (same sizes, other slices per rank), and with the norms gathered the solver computes 3D linears with the contraction
unsplit rather than with the cube's reduce-scatter.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost.cluster import ClusterSpec
from autopar.errors import ConfigError
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.spec import SS, Spec, format_spec, is_valid, replicate_size_one_axes
from autopar.solver.planners.hand_plans import COLUMN, EMBEDDING, ROW, SEQUENCE_PARALLEL_OPS, megatron_placement
from autopar.solver.planners.sharding import solve
from autopar.trace import TracedModel

MODES = ("1d", "2d", "2.5d", "3d")
# The residual stream's elementwise ops. Norms are left to the solver: autopar has no rule for a
# norm split along the normalized dim (Colossal-AI's all-reduces its statistics), so it gathers
# the hidden dim first, which the next linear needs gathered anyway.
_RESIDUAL_OPS = SEQUENCE_PARALLEL_OPS - {torch.ops.aten.layer_norm.default}
_CASTS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.t.default}


@dataclass(frozen=True, slots=True)
class ColossalParallel:
    """Colossal-AI's ``parallel`` dict, checked: ``pipeline`` stages, the ``tensor`` mode and
    size (``depth`` for 2.5d), and the data-parallel size the world leaves."""

    pipeline: int = 1
    mode: str = "1d"
    size: int = 1
    depth: int = 1
    data: int = 1

    def __post_init__(self) -> None:
        for name in ("pipeline", "size", "depth", "data"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel: {name} must be a positive int, got {value!r}")
        if self.mode not in MODES:
            raise ConfigError(f"parallel: tensor mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode != "2.5d" and self.depth != 1:
            raise ConfigError(f"parallel: depth is for mode '2.5d' only, got depth={self.depth} with mode {self.mode!r}")
        side = self.side
        if self.mode == "2d" and side**2 != self.size:
            raise ConfigError(f"parallel: mode '2d' needs size = q² (a q × q grid), got size={self.size}: use 4, 9, 16, ...")
        if self.mode == "2.5d" and (self.size % self.depth or side**2 * self.depth != self.size):
            raise ConfigError(
                f"parallel: mode '2.5d' needs size = depth · q², got size={self.size}, depth={self.depth}: "
                f"for depth={self.depth} use size {', '.join(str(self.depth * q * q) for q in (2, 3, 4))}"
            )
        if self.mode == "3d" and side**3 != self.size:
            raise ConfigError(f"parallel: mode '3d' needs size = q³ (a q × q × q cube), got size={self.size}: use 8, 27, 64, ...")

    @classmethod
    def from_dict(cls, parallel: Mapping[str, Any], world_size: int | None = None) -> ColossalParallel:
        """Read ``parallel`` as Colossal-AI does: ``pipeline`` an int or ``dict(size=N)``, ``tensor``
        ``dict(mode=..., size=..., depth=...)`` (no ``tensor``: mode "1d", size 1), ``data`` optional.
        ``world_size`` (when given) must be pipeline × tensor size × data."""
        if not isinstance(parallel, Mapping):
            raise ConfigError(
                f"parallel must be a dict such as dict(pipeline=2, tensor=dict(mode='2d', size=4)), got {parallel!r}"
            )
        unknown = set(parallel) - {"pipeline", "tensor", "data"}
        if unknown:
            raise ConfigError(f"parallel: unknown keys {sorted(unknown)}; expected pipeline, tensor and data")
        pipeline = _size_of(parallel.get("pipeline", 1), "pipeline")
        tensor = parallel.get("tensor") or {}
        if not isinstance(tensor, Mapping):
            raise ConfigError(f"parallel: tensor must be a dict such as dict(mode='2d', size=4), got {tensor!r}")
        unknown = set(tensor) - {"mode", "size", "depth"}
        if unknown:
            raise ConfigError(f"parallel: unknown tensor keys {sorted(unknown)}; expected mode, size and depth")
        mode = tensor.get("mode", "1d")
        mode = mode.lower() if isinstance(mode, str) else mode
        size, depth = tensor.get("size", 1), tensor.get("depth", 1)
        data = parallel.get("data")
        data = _size_of(data, "data") if data is not None else None
        if world_size is not None:
            model = pipeline * (size if isinstance(size, int) else 1)
            if isinstance(size, int) and (world_size % model or (data is not None and data * model != world_size)):
                raise ConfigError(
                    f"parallel: the world of {world_size} ranks must be pipeline ({pipeline}) × tensor "
                    f"size ({size}) × data{f' ({data})' if data else ''}: pass a mesh of "
                    f"{model * (data or 1)} ranks, or change the config"
                )
            data = data or world_size // model
        return cls(pipeline=pipeline, mode=mode, size=size, depth=depth, data=data or 1)

    @property
    def side(self) -> int:
        """q: the side of the 2D / 2.5D grid or of the 3D cube (the size for 1d)."""
        per_grid = self.size // self.depth
        root = {"1d": 1, "2d": 2, "2.5d": 2, "3d": 3}[self.mode]
        return round(per_grid ** (1 / root))

    @property
    def world_size(self) -> int:
        return self.pipeline * self.size * self.data

    def tensor_axes(self) -> tuple[tuple[str, int], ...]:
        """(role, size) of the tensor-parallel mesh axes, outermost first."""
        q = self.side
        if self.mode == "1d":
            return (("tp", self.size),)
        if self.mode == "2d":
            return (("row", q), ("col", q))
        if self.mode == "2.5d":
            grid = (("row", q), ("col", q))
            return ((("depth", self.depth),) if self.depth > 1 else ()) + grid
        return (("weight", q), ("input", q), ("output", q))

    def stage_axes(self) -> tuple[tuple[str, int], ...]:
        """(role, size) of every axis of one pipeline stage's mesh."""
        return ((("data", self.data),) if self.data > 1 else ()) + self.tensor_axes()

    def mesh_shape(self) -> tuple[int, ...]:
        """The whole mesh: stages cut axis 0 (``ir.pipeline.stage_mesh_of``) into ``pipeline``
        rank groups, so rank r of stage p is Colossal-AI's global rank p · (world / pipeline) + r."""
        stage = [size for _, size in self.stage_axes()]
        return (self.pipeline * stage[0], *stage[1:])

    def stage_mesh(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.stage_axes())

    def describe(self) -> str:
        depth = f", depth {self.depth}" if self.mode == "2.5d" else ""
        return (
            f"Colossal-AI {self.mode} tensor parallelism (size {self.size}{depth}), pipeline {self.pipeline}, "
            f"data {self.data}: mesh {self.mesh_shape()}, stage axes "
            f"{', '.join(f'{role}={size}' for role, size in self.stage_axes())}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pipeline": self.pipeline,
            "tensor": {"mode": self.mode, "size": self.size, "depth": self.depth},
            "data": self.data,
        }


def _size_of(value: Any, name: str) -> int:
    if isinstance(value, Mapping):
        value = value.get("size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"parallel: {name} must be a positive int (or dict(size=N)), got {value!r}")
    return value


def colossal_specs(config: ColossalParallel, traced: TracedModel) -> dict[str, Spec]:
    """Node name → spec on the stage mesh, for every parameter and residual-stream activation."""
    roles = [role for role, _ in config.stage_axes()]
    mesh = config.stage_mesh()
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    fqn_of = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.placeholders("param")}
    by_fqn: dict[str, tuple] = {}  # canonical FQN → per-role placements (tied parameters share one)
    for node in traced.gm.graph.nodes:
        for name, placement in _param_placements(config, node, fqn_of):
            by_fqn.setdefault(fqn_of[name], placement)
    specs: dict[str, Spec] = {}
    for name, fqn in fqn_of.items():
        per_role = by_fqn.get(fqn, {})
        spec = replicate_size_one_axes(tuple(per_role.get(role, Replicate()) for role in roles), mesh)
        shape = tuple(placeholders[name].meta["val"].shape)
        if not is_valid(shape, spec, mesh):
            raise ConfigError(
                f"{config.mode} tensor parallelism cannot split {fqn} of shape {shape} as "
                f"{format_spec(spec)} on the stage mesh {mesh} ({', '.join(roles)}): its dims must "
                f"divide by the grid (Colossal-AI's layers need the same); change tensor size or the model"
            )
        specs[name] = spec
    specs.update(_residual_specs(config, traced, roles, mesh, fqn_of))
    return specs


def _param_placements(config: ColossalParallel, node: torch.fx.Node, fqn_of: dict[str, str]):
    """(placeholder, {role: placement}) for the parameters ``node`` uses, as Colossal-AI's layer places them."""
    if node.op != "call_function":
        return
    if node.target == torch.ops.aten.linear.default:
        weight, bias = _param(node.args[1], fqn_of), _param(node.args[2] if len(node.args) > 2 else None, fqn_of)
        if weight is not None:
            yield weight, _linear_weight(config, fqn_of[weight], node)
        if bias is not None:
            yield bias, _linear_bias(config, fqn_of[bias], node)
    elif node.target in (torch.ops.aten.layer_norm.default, torch.ops.aten.rms_norm.default):
        for arg in node.args[2:4]:
            name = _param(arg, fqn_of)
            if name is not None:
                yield name, _hidden_vector(config)
    elif node.target == torch.ops.aten.embedding.default:
        name = _param(node.args[0], fqn_of)
        if name is not None:
            hidden = _hidden_vector(config)
            if config.mode == "1d":  # Megatron's: word embeddings split by vocabulary, others whole
                yield name, {"tp": megatron_placement(fqn_of[name], tuple(node.args[0].meta["val"].shape))}
            else:  # Embedding2D / 2p5D / 3D: split along the embedding, as the residual stream is
                yield name, {role: Shard(1) for role in hidden}


def _param(arg: Any, fqn_of: dict[str, str]) -> str | None:
    """The parameter placeholder behind ``arg``, through dtype casts and transposes."""
    while isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target in _CASTS:
        arg = arg.args[0]
    if isinstance(arg, torch.fx.Node) and arg.name in fqn_of:
        return arg.name
    return None


def _is_row(fqn: str, node: torch.fx.Node) -> bool:
    """A row linear (attention output, MLP down: reads the inner activations), by Megatron's
    names; a linear of another name is a column one when it reads the model width."""
    if ROW.search(fqn):
        return True
    if COLUMN.search(fqn) or EMBEDDING.search(fqn):
        return False
    weight = node.args[1].meta["val"]
    return weight.shape[0] > weight.shape[1]  # wider in than out: a down projection


def _linear_weight(config: ColossalParallel, fqn: str, node: torch.fx.Node) -> dict[str, Any]:
    """Placements of a torch (out, in) linear weight by axis role."""
    if config.mode == "1d":
        return {"tp": megatron_placement(fqn, tuple(node.args[1].meta["val"].shape))}
    out = _out_split(node, 0)
    if config.mode in ("2d", "2.5d"):  # Linear2D / Linear2p5D: in over the row index, out over the col index
        return {"row": Shard(1), "col": out}
    # Linear3D: in over the output and weight groups, out over the input group; the next linear
    # swaps the input and output groups (Colossal-AI's swap_in_out_group).
    inner, outer = ("output", "input") if _is_row(fqn, node) else ("input", "output")
    return {inner: out, outer: Shard(1), "weight": Shard(1)}


def _out_split(node: torch.fx.Node, dim: int):
    """How a linear's output features (``dim`` of the weight, bias or output) are split: evenly,
    or, for a fused projection the model splits into n blocks (q | k | v), into each rank's chunk
    of every block (``S(d)/n``), as Colossal-AI's models order a fused weight by head."""
    blocks = _split_blocks(node)
    return SS(dim, blocks) if blocks else Shard(dim)


def _linear_bias(config: ColossalParallel, fqn: str, node: torch.fx.Node) -> dict[str, Any]:
    if config.mode == "1d":
        return {"tp": megatron_placement(fqn, (node.args[1].meta["val"].shape[0],))}
    if config.mode in ("2d", "2.5d"):
        return {"col": _out_split(node, 0)}
    return {("output" if _is_row(fqn, node) else "input"): _out_split(node, 0)}


def _hidden_vector(config: ColossalParallel) -> dict[str, Any]:
    """A vector of the model width (norm weights): split where the residual stream's hidden dim is."""
    return {"1d": {}, "2d": {"col": Shard(0)}, "2.5d": {"col": Shard(0)}, "3d": {"output": Shard(0)}}[config.mode]


def _residual_specs(
    config: ColossalParallel, traced: TracedModel, roles: list[str], mesh: tuple[int, ...], fqn_of: dict[str, str]
) -> dict[str, Spec]:
    """The residual stream (norms, residual adds, dropout: (batch, seq, hidden) outputs of the
    elementwise ops sequence parallelism splits) as Colossal-AI's layers hold it between layers:
    the batch split on the data, depth, row (2d/2.5d) or weight and input (3d) axes, the hidden
    dim on col (2d/2.5d) or output (3d). 1d leaves it to the solver (Megatron's is replicated)."""
    if config.mode == "1d":
        return {}
    hidden = _model_width(traced)
    if hidden is None:
        return {}
    batch_roles = {"data", "depth", "row", "weight", "input"}
    hidden_role = "col" if config.mode != "3d" else "output"
    spec = tuple(Shard(0) if role in batch_roles else Shard(2) if role == hidden_role else Replicate() for role in roles)
    spec = replicate_size_one_axes(spec, mesh)
    forced = {}
    inner = tuple(
        Shard(0) if role in ("weight", "output") else Shard(2) if role == "input" else p for role, p in zip(roles, spec)
    )  # 3d: a column linear's output, input and output swapped
    for node in traced.gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function":
            continue
        if node.target == torch.ops.aten.linear.default:
            # Every Linear2D / 2p5D / 3D returns its output split as the layer holds it.
            weight = _param(node.args[1], fqn_of)
            fqn = fqn_of[weight] if weight is not None else ""
            want = inner if config.mode == "3d" and not _is_row(fqn, node) else spec
            last = val.dim() - 1
            want = tuple(_out_split(node, last) if p == Shard(2) else p for p in want)
            out = replicate_size_one_axes(want, mesh)
            if is_valid(tuple(val.shape), out, mesh):
                forced[node.name] = out
            continue
        if node.target not in _RESIDUAL_OPS:
            continue
        if isinstance(val, torch.Tensor) and val.dim() == 3 and val.shape[-1] == hidden and val.is_floating_point():
            if not is_valid(tuple(val.shape), spec, mesh):
                raise ConfigError(
                    f"{config.mode} tensor parallelism splits the activations {tuple(val.shape)} of "
                    f"{node.format_node()} as {format_spec(spec)} on the stage mesh {mesh} ({', '.join(roles)}): "
                    f"the batch (per microbatch) must divide by {_batch_ways(spec, mesh)} and the width by the "
                    f"grid side; use a larger batch"
                )
            forced[node.name] = spec
    return forced


def _split_blocks(node: torch.fx.Node) -> int:
    """How many blocks the model splits a linear's output into (3 for a fused q | k | v), or 0."""
    for user in node.users:
        if user.target == torch.ops.aten.split.Tensor and isinstance(user.args[1], int):
            return node.meta["val"].shape[-1] // user.args[1]
        if user.target == torch.ops.aten.split_with_sizes.default and len(set(user.args[1])) == 1:
            return len(user.args[1])
        if user.target == torch.ops.aten.chunk.default:
            return int(user.args[1])
    return 0


def _batch_ways(spec: Spec, mesh: tuple[int, ...]) -> int:
    return math.prod(size for p, size in zip(spec, mesh) if p == Shard(0))


def _model_width(traced: TracedModel) -> int | None:
    """The hidden width: the normalized size of the first layer norm, else the token embedding's."""
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.layer_norm.default, torch.ops.aten.rms_norm.default):
            return int(node.args[1][-1])
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.embedding.default:
            return int(node.meta["val"].shape[-1])
    return None


def solve_colossal(
    config: ColossalParallel, traced: TracedModel, cluster: ClusterSpec, options: PlanOptions | None = None
) -> Plan:
    """The Colossal-AI plan of ``config`` for ``traced``: on its mesh, or with ``config.pipeline``
    stages (``traced`` then at one microbatch of ``options.pipeline.microbatches``, the stage
    planner choosing where to cut), every stage with the layout of the module docstring.
    ``options`` as ``solve`` reads them (the stage planner as ``StageSettings.of`` translates them)."""
    options = options if options is not None else PlanOptions()
    forced = colossal_specs(config, traced)
    if config.pipeline == 1:
        plan = solve(traced, config.mesh_shape(), cluster, options, forced=forced)
    else:
        from autopar.solver.planners.stages import StageSettings, plan_stages  # loads only for pipelines (start-up speed)

        settings = StageSettings.of(options, cluster, num_stages=config.pipeline, forced=forced)
        plan = plan_stages(traced, config.mesh_shape(), cluster, settings, options.precision)
    return dataclasses.replace(plan, stats={**plan.stats, "hand_plan": "colossal", "colossal": config.to_json()})


__all__ = ["ColossalParallel", "MODES", "colossal_specs", "solve_colossal"]
