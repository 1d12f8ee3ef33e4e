"""The plan's data layout: which mesh axes split the batch, and, for per-rank data, the batched
inputs' and outputs' placements (``autopar.ir.data``).

The solve plans every user input whole (``R`` on every axis) and lets its consumers cut it. The
batch-splitting axes are read from that solution: the axes on which a consumer of a batched
input takes it ``Shard(0)``. Under ``batch="per_rank"`` each batched input's placeholder then
holds ``Shard(0)`` on those axes, which is what each rank passes; a consumer that takes it
otherwise gets the collectives of ``spec.transition_steps`` from ``passes.insert_collectives``, as
any other edge does, so the numbers stay those of the whole batch. The batched outputs leave the
same way: the output node takes each ``Shard(0)`` on those axes, so a rank gets its own rows of
it, as DDP's model gives them (``batched_outputs``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.errors import PlanError
from autopar.ir.data import DataLayout, DataOptions
from autopar.ir.plan import Plan
from autopar.ir.spec import is_valid
from autopar.trace import TracedModel


def batched_inputs(traced: TracedModel) -> dict[str, tuple[int, ...]]:
    """User inputs whose dim 0 is the batch: the tensors (of one dim or more) whose dim 0 has
    the size of the first such input's, as a data loader's batch has. Name → global shape."""
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    shapes = {}
    for graph_input in traced.placeholders("user"):
        val = placeholders[graph_input.name].meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 1:
            shapes[graph_input.name] = tuple(val.shape)
    if not shapes:
        return {}
    batch = next(iter(shapes.values()))[0]
    return {name: shape for name, shape in shapes.items() if shape[0] == batch}


def batch_reached(traced: TracedModel, inputs: dict[str, tuple[int, ...]]) -> set[str]:
    """The names of the batched ``inputs`` and of every op computed from one of them."""
    reached = set(inputs)
    for node in traced.gm.graph.nodes:
        if node.op == "call_function" and any(arg.name in reached for arg in node.all_input_nodes):
            reached.add(node.name)
    return reached


def batched_outputs(traced: TracedModel, inputs: dict[str, tuple[int, ...]]) -> set[str]:
    """The graph's outputs whose dim 0 is the batch: tensors computed from a batched input (or
    one passed through) whose dim 0 has the batch's size, as a model's logits, hidden states and
    per-row losses have. A loss reduced over the batch, or a tensor flattened across it
    (``view(-1, vocab)``), is not one: it leaves whole."""
    if not inputs:
        return set()
    batch = next(iter(inputs.values()))[0]
    reached = batch_reached(traced, inputs)
    output = next(node for node in traced.gm.graph.nodes if node.op == "output")
    found = set()
    for node in output.all_input_nodes:
        val = node.meta.get("val")
        if node.name in reached and isinstance(val, torch.Tensor) and val.dim() and val.shape[0] == batch:
            found.add(node.name)
    return found


def data_parallel_axes(plan: Plan, inputs: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The mesh axes on which some consumer of a batched input takes it ``Shard(0)``, or the
    output node a batched output (the solve offers that under ``batch="per_rank"``:
    ``choices.Offers``; an input that arrives split where its consumer takes it whole is gathered,
    as a token batch is, smaller than the logits it saves gathering), in mesh order; only those on
    which every batched input can be split evenly."""
    axes: set[int] = set()
    for node in plan.nodes.values():
        for (producer, _), spec in zip(node.inputs, node.ins):
            if producer in inputs or node.source == "output":
                axes.update(axis for axis, placement in enumerate(spec) if placement == Shard(0))
    mesh = tuple(plan.mesh_shape)
    chosen: list[int] = []
    for axis in sorted(axes):
        trial = chosen + [axis]
        if all(is_valid(shape, _spec(trial, len(mesh)), mesh) for shape in inputs.values()):
            chosen = trial
    return tuple(chosen)


def _spec(axes, num_axes: int) -> tuple:
    return tuple(Shard(0) if axis in axes else Replicate() for axis in range(num_axes))


def with_data_layout(plan: Plan, traced: TracedModel, options: DataOptions, axes: tuple[int, ...] | None = None) -> Plan:
    """``plan`` recording its data layout under ``options``; under ``batch="per_rank"``, with
    each batched input's placeholder split along dim 0 on the data-parallel axes (``axes``
    where given: another mode's graph of a module whose ranks already load their rows)."""
    if plan.pipeline is not None:
        if options.per_rank:
            raise PlanError(
                "batch='per_rank' with a pipeline: the pipeline runtime takes the whole batch on every "
                "rank and cuts it into microbatches; pass batch='whole' (the default), or pipeline='off'"
            )
        return plan
    inputs = batched_inputs(traced)
    if axes is None:
        axes = data_parallel_axes(plan, inputs)
    layout = DataLayout(options.batch, axes, tuple(plan.mesh_shape), tuple(inputs))
    nodes = plan.nodes
    spec = _spec(axes, len(plan.mesh_shape))
    if options.per_rank and axes:
        nodes = {name: dataclasses.replace(node, outs=(spec,)) if name in inputs else node for name, node in nodes.items()}
    batched = batched_outputs(traced, inputs) if options.per_rank else set()
    return dataclasses.replace(plan, nodes=_outputs_leave(nodes, batched, spec), data=layout, stats=plan.stats)


def _outputs_leave(nodes: dict, batched: set[str], spec) -> dict:
    """``nodes`` with the output node taking each batched output split as the inputs arrive
    (``spec``: each rank gets its own rows back) and every other output whole, whatever the solve
    chose (it may offer a split output on other axes: ``choices.Offers``)."""
    for name, node in nodes.items():
        if node.source == "output":
            whole = _spec((), len(spec))
            ins = tuple(spec if producer in batched else whole for producer, _ in node.inputs)
            return {**nodes, name: dataclasses.replace(node, ins=ins)}
    return nodes
