"""Hand-written parallelism plans, built on the same graph and priced by the same cost model.

A hand plan fixes every parameter's placements the way the technique prescribes; the solver then
chooses everything else (activations, where to reshard) at the lowest cost. That is the best
version of each hand plan under autopar's cost model, so ``autopar.plan``'s own result, which
may choose parameter placements too, can only be as fast or faster: a fair reference.

Kinds (the tensor-parallel axis is the innermost mesh axis, which stays inside a node):

- ``ddp``: every parameter replicated; batch sharding is the solver's best choice.
- ``fsdp``: every parameter sharded over all axes along its first evenly divisible dim
  (ZeRO-3; gradients and optimizer state follow the parameters).
- ``megatron``: Megatron tensor parallelism on the innermost axis: column-parallel projections
  (q/k/v, fused qkv, MLP up and gate) split by output features, row-parallel ones (attention
  output, MLP down) by input features, embeddings by vocabulary; replicated on the other axes,
  so on a 2-D mesh this is TP × DP.
- ``tp_fsdp``: torchtitan's layout: Megatron on the innermost axis, FSDP on the others.

Column and row projections are recognised by module name, as Megatron and torchtitan layouts
are written (``COLUMN``, ``ROW``); a model with other names gets fewer tensor-parallel layers.
"""

from __future__ import annotations

import os
import re
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost.cluster import ClusterSpec, get_cluster
from autopar.plan import Plan
from autopar.solver import solve
from autopar.spec import Spec, is_valid
from autopar.trace import TracedModel, trace

KINDS = ("ddp", "fsdp", "megatron", "tp_fsdp")

COLUMN = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|c_attn|query|key|value|qkv|c_fc|fc1|up_proj|gate_proj|w1|w3)\.(weight|bias)$")
ROW = re.compile(r"(^|\.)(c_proj|o_proj|out_proj|down_proj|fc2|w2|dense)\.(weight|bias)$")
EMBEDDING = re.compile(r"(^|\.)(wte|embed_tokens|word_embeddings|lm_head)\.weight$")


def _tensor_parallel(fqn: str, shape: Sequence[int]) -> Shard | Replicate:
    """Megatron's placement of one parameter on the tensor-parallel axis."""
    if COLUMN.search(fqn):
        return Shard(0)
    if ROW.search(fqn):
        return Shard(1) if fqn.endswith(".weight") and len(shape) == 2 else Replicate()
    if EMBEDDING.search(fqn):
        return Shard(0)
    return Replicate()


def _fsdp_dim(shape: Sequence[int], ways: int) -> Shard | Replicate:
    for dim, size in enumerate(shape):
        if size % ways == 0:
            return Shard(dim)
    return Replicate()


def param_specs(kind: str, traced: TracedModel, mesh_shape: tuple[int, ...]) -> dict[str, Spec]:
    """Placeholder name → spec for every parameter under hand plan ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"unknown hand plan {kind!r}; expected one of {', '.join(KINDS)}")
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    num_axes = len(mesh_shape)
    outer = mesh_shape[:-1]
    specs: dict[str, Spec] = {}
    for graph_input in traced.placeholders("param"):
        shape = tuple(placeholders[graph_input.name].meta["val"].shape)
        fqn = traced.ties.get(graph_input.fqn, graph_input.fqn)
        if kind == "ddp":
            spec: tuple = (Replicate(),) * num_axes
        elif kind == "fsdp":
            spec = (_fsdp_dim(shape, _prod(mesh_shape)),) * num_axes
        else:
            tp = _tensor_parallel(fqn, shape)
            if kind == "megatron" or not outer:
                rest: tuple = (Replicate(),) * (num_axes - 1)
            else:
                local = tuple(s // mesh_shape[-1] if isinstance(tp, Shard) and d == tp.dim else s for d, s in enumerate(shape))
                rest = (_fsdp_dim(local, _prod(outer)),) * (num_axes - 1)
            spec = rest + (tp,)
        if not is_valid(shape, spec, mesh_shape):
            spec = (Replicate(),) * num_axes  # this parameter cannot be cut evenly
        specs[graph_input.name] = spec
    return specs


def hand_plan(
    kind: str,
    model: torch.nn.Module,
    mesh: Sequence[int],
    *,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    cluster: str | ClusterSpec | os.PathLike | None = None,
    memory_budget: float | None = None,
) -> Plan:
    """The hand plan ``kind`` for ``model`` on ``mesh``, as a Plan priced by autopar's model.

    It can be saved, inspected and compiled like any plan, which gives real baselines.
    """
    mesh_shape = tuple(int(n) for n in mesh)
    traced = trace(model, example_inputs, example_kwargs)
    return solve(traced, mesh_shape, get_cluster(cluster), memory_budget=memory_budget,
                 forced=param_specs(kind, traced, mesh_shape))


def _prod(sizes: Sequence[int]) -> int:
    out = 1
    for size in sizes:
        out *= size
    return out
