"""Hand-written parallelism plans, built on the same graph and priced by the same cost model.

A hand plan fixes every parameter's placements the way the technique prescribes; the solver then
chooses everything else (activations, where to reshard) at the lowest cost. That is the best
version of each hand plan under autopar's cost model, so ``autopar.plan``'s own result, which
may choose parameter placements too, can only be as fast or faster: a fair reference.

Kinds (the tensor-parallel axis is the innermost mesh axis, which stays inside a node):

- ``ddp``: every parameter replicated; batch sharding is the solver's best choice.
- ``zero1`` / ``zero2``: DDP's layout, with the optimizer state (and for ``zero2`` the
  gradients too) split among the ranks that hold a replica. Communication is priced as DDP's:
  ZeRO-1/2 reduce-scatter the gradients and all-gather the updated parameters, which moves the
  bytes of DDP's all-reduce. To run one, compile the plan (its layout is DDP's) and step with
  ``torch.distributed.optim.ZeroRedundancyOptimizer``, which shards the optimizer state; it does
  not shard gradients, so a ``zero2`` plan runs with ZeRO-1's gradient memory.
- ``fsdp``: every parameter sharded over all axes along its first evenly divisible dim
  (ZeRO-3; gradients and optimizer state follow the parameters).
- ``megatron``: Megatron tensor parallelism on the innermost axis: column-parallel projections
  (q/k/v, fused qkv, MLP up and gate) split by output features, row-parallel ones (attention
  output, MLP down) by input features, embeddings by vocabulary; replicated on the other axes,
  so on a 2-D mesh this is TP × DP (``tp_dp`` names the same plan).
- ``megatron_sp``: Megatron with sequence parallelism: as ``megatron``, and the activations
  outside the attention and MLP blocks (norms, residual adds, dropout) are split along the
  sequence on the tensor-parallel axis (and along the batch on the others), so the TP
  all-reduces become reduce-scatter + all-gather pairs and those activations take 1/TP memory.
- ``tp_fsdp``: torchtitan's layout: Megatron on the innermost axis, FSDP on the others.
- ``ep_fsdp``: expert parallelism on the innermost axis with FSDP on the others, as torchtitan
  and Megatron train mixture-of-experts models: the stacked expert weights (the inputs of each
  ``autopar::moe_experts`` op, ``trace.moe``) are split by expert on the innermost axis and
  FSDP-split along another dim on the outer axes; every other parameter is FSDP-split over all
  axes. The solver then picks how each experts op runs on that layout (normally the all-to-all
  kernel, which needs the experts only as the inner axis splits them).

Column and row projections are recognised by module name, as Megatron and torchtitan layouts
are written (``COLUMN``, ``ROW``); a model with other names gets fewer tensor-parallel layers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost.cluster import ClusterSpec
from autopar.errors import ConfigError
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.spec import Spec, is_valid, is_valid_param, replicate_size_one_axes
from autopar.solver.planners.sharding import solve
from autopar.solver.planners.split_batch import batch_pins
from autopar.solver.problem.choices import padded_param_specs
from autopar.trace import TracedModel
from autopar.trace.moe import EXPERTS_OP

KINDS = ("ddp", "zero1", "zero2", "fsdp", "megatron", "megatron_sp", "tp_fsdp", "ep_fsdp")
# Other names of the same plans.
ALIASES = {"tp_dp": "megatron"}
_ZERO_STAGE = {"zero1": 1, "zero2": 2}
# Elementwise ops of the residual stream that sequence parallelism splits along the sequence.
SEQUENCE_PARALLEL_OPS = {
    torch.ops.aten.add.Tensor,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.pow.Tensor_Scalar,
    torch.ops.aten.rsqrt.default,
    torch.ops.aten.layer_norm.default,
    torch.ops.aten.dropout.default,
    torch.ops.aten.to.dtype,
    torch.ops.aten._to_copy.default,
}

COLUMN = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|c_attn|query|key|value|qkv|c_fc|fc1|up_proj|gate_proj|w1|w3)\.(weight|bias)$")
ROW = re.compile(r"(^|\.)(c_proj|o_proj|out_proj|down_proj|fc2|w2|dense)\.(weight|bias)$")
EMBEDDING = re.compile(r"(^|\.)(wte|embed_tokens|word_embeddings|lm_head)\.weight$")


def megatron_placement(fqn: str, shape: Sequence[int]) -> Shard | Replicate:
    """Megatron's placement of one parameter on the tensor-parallel axis."""
    if COLUMN.search(fqn):
        return Shard(0)
    if ROW.search(fqn):
        return Shard(1) if fqn.endswith(".weight") and len(shape) == 2 else Replicate()
    if EMBEDDING.search(fqn):
        return Shard(0)
    return Replicate()


def _fsdp_dim(shape: Sequence[int], ways: int, padded: bool = False) -> Shard | Replicate:
    """The first dim that ``ways`` divides; else, with ``padded`` (``padded_param_specs``), dim 0
    as FSDP2 shards it on any world size (a padded shard), else none."""
    for dim, size in enumerate(shape):
        if size % ways == 0:
            return Shard(dim)
    return Shard(0) if padded and shape else Replicate()


def resolve_kind(kind: str) -> str:
    kind = ALIASES.get(kind, kind)
    if kind not in KINDS:
        names = ", ".join(KINDS + tuple(ALIASES))
        raise ConfigError(f"unknown hand plan {kind!r}; expected one of {names}")
    return kind


def param_specs(kind: str, traced: TracedModel, mesh_shape: tuple[int, ...]) -> dict[str, Spec]:
    """Placeholder name → spec for every parameter under hand plan ``kind``."""
    kind = resolve_kind(kind)
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    num_axes = len(mesh_shape)
    outer = mesh_shape[:-1]
    specs: dict[str, Spec] = {}
    experts = _expert_weights(traced)
    padded = padded_param_specs(mesh_shape)
    for graph_input in traced.placeholders("param"):
        shape = tuple(placeholders[graph_input.name].meta["val"].shape)
        fqn = traced.ties.get(graph_input.fqn, graph_input.fqn)
        if kind in ("ddp", "zero1", "zero2"):
            spec: tuple = (Replicate(),) * num_axes
        elif kind == "ep_fsdp":
            if graph_input.name in experts:
                # FSDP on the outer axes along a dim after the expert dim, which the inner axis splits.
                fsdp = _fsdp_dim(shape[1:], _prod(outer)) if outer else Replicate()
                fsdp = Shard(fsdp.dim + 1) if isinstance(fsdp, Shard) else fsdp
                spec = (fsdp,) * (num_axes - 1) + (Shard(0),)
            else:
                spec = (_fsdp_dim(shape, _prod(mesh_shape)),) * num_axes
        elif kind == "fsdp":
            spec = (_fsdp_dim(shape, _prod(mesh_shape), padded),) * num_axes
        else:
            tp = megatron_placement(fqn, shape)
            if kind in ("megatron", "megatron_sp") or not outer:
                rest: tuple = (Replicate(),) * (num_axes - 1)
            else:
                local = tuple(s // mesh_shape[-1] if isinstance(tp, Shard) and d == tp.dim else s for d, s in enumerate(shape))
                # FSDP2's padded dim 0 where no dim of the TP piece divides: on one data-parallel
                # axis, beside TP's cut of another dim (a second cut of dim 0 would nest the pad)
                padded_here = padded and tp != Shard(0) and sum(size > 1 for size in outer) == 1
                rest = (_fsdp_dim(local, _prod(outer), padded_here),) * (num_axes - 1)
            spec = rest + (tp,)
        # On a mesh axis of size 1 (a pipeline stage's mesh, a (1, 4) mesh) every spec is R.
        spec = replicate_size_one_axes(spec, mesh_shape)
        if not (is_valid_param if padded else is_valid)(shape, spec, mesh_shape):
            spec = (Replicate(),) * num_axes  # this parameter cannot be cut evenly
        specs[graph_input.name] = spec
    return specs


def _expert_weights(traced: TracedModel) -> set[str]:
    """Placeholders of the stacked expert weights: the ``gate_up`` and ``down`` inputs of every
    ``autopar::moe_experts`` op."""
    found = set()
    for node in traced.gm.graph.nodes:
        if node.target is EXPERTS_OP:
            for arg in node.args[3:5]:
                if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
                    found.add(arg.name)
    return found


def sequence_parallel_specs(traced: TracedModel, mesh_shape: tuple[int, ...]) -> dict[str, Spec]:
    """Node name → spec for the residual-stream activations under sequence parallelism:
    elementwise and norm ops whose output is (batch, sequence, hidden), with hidden the width
    of the token embedding, split along the batch on the outer axes and the sequence on the
    tensor-parallel axis."""
    embeddings = [n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.embedding.default]
    if not embeddings:
        return {}
    hidden = embeddings[0].meta["val"].shape[-1]
    spec = replicate_size_one_axes((Shard(0),) * (len(mesh_shape) - 1) + (Shard(1),), mesh_shape)
    forced = {}
    for node in traced.gm.graph.nodes:
        val = node.meta.get("val")
        if node.op != "call_function" or node.target not in SEQUENCE_PARALLEL_OPS:
            continue
        if isinstance(val, torch.Tensor) and val.dim() == 3 and val.shape[-1] == hidden and val.is_floating_point():
            if is_valid(tuple(val.shape), spec, mesh_shape):
                forced[node.name] = spec
    return forced


def hybrid_specs(traced: TracedModel, mesh_shape: tuple[int, ...]) -> dict[str, Spec]:
    """Hybrid sharding, FSDP2's ``fully_shard`` on a (replicate, shard) mesh: every parameter
    sharded on the innermost axis along its first dim that axis divides, replicated on the
    others, and every op output that carries the batch split on every axis (``batch_pins``: all
    ranks are data parallel). The runtime gathers each parameter once, reduce-scatters its
    gradient on the inner axis and all-reduces the shard on the others (``passes.schedule``).
    Not a kind of ``KINDS`` yet: the cost model prices those reductions per use, whole, so a plan
    of it would be predicted slower than it runs (docs/cost-model.md)."""
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    specs: dict[str, Spec] = {}
    for graph_input in traced.placeholders("param"):
        shape = tuple(placeholders[graph_input.name].meta["val"].shape)
        spec = (Replicate(),) * (len(mesh_shape) - 1) + (_fsdp_dim(shape, mesh_shape[-1]),)
        spec = replicate_size_one_axes(spec, mesh_shape)
        specs[graph_input.name] = spec if is_valid(shape, spec, mesh_shape) else (Replicate(),) * len(mesh_shape)
    specs.update(batch_pins(traced, mesh_shape))
    return specs


def hand_specs(kind: str, traced: TracedModel, mesh_shape: tuple[int, ...]) -> dict[str, Spec]:
    """Every spec that hand plan ``kind`` fixes: parameters, and activations for ``megatron_sp``."""
    specs = param_specs(kind, traced, mesh_shape)
    if resolve_kind(kind) == "megatron_sp":
        specs.update(sequence_parallel_specs(traced, mesh_shape))
    return specs


def zero_stage(kind: str) -> int:
    """The ZeRO stage whose parameter-state memory hand plan ``kind`` has (0 for none)."""
    return _ZERO_STAGE.get(resolve_kind(kind), 0)


def solve_hand_plan(
    kind: str, traced: TracedModel, mesh_shape: tuple[int, ...], cluster: ClusterSpec, options: PlanOptions | None = None
) -> Plan:
    """``hand_plan`` on an already traced model, under ``options`` as ``solve`` reads them
    (``options.precision``: the policy it was traced under)."""
    return solve(traced, mesh_shape, cluster, options, forced=hand_specs(kind, traced, mesh_shape), zero_stage=zero_stage(kind))


def _prod(sizes: Sequence[int]) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out
