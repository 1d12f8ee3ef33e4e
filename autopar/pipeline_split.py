"""A simple stage splitter for ``pipeline=N``: cut the planned microbatch graph into N stages.

``split_stages(traced, plan, num_stages, num_microbatches, mesh_shape)`` takes the graph traced
at one microbatch and its intra-stage plan (made for the stage mesh, ``plan.mesh_shape``), and
returns the ``StagePlan``. It is one function so that the stage planner
(``autopar.solver.stages``, an Alpa-style DP that also chooses the number of stages and the
intra-stage plans) can replace it.

The forward nodes are grouped into *units*: the layers of the model's longest ``ModuleList``
(the repeated layers the solver ties, ``solver.choices._layer_key``), with the nodes before the
first layer joined to it and those after the last layer joined to the last one. A model without
such a list has one unit per node. Cuts fall only between units, and only where every value
crossing the cut is one tensor. Among the cuts, the chosen ones minimize the slowest stage's
predicted time (the nodes' ``cost_s``, forward + backward); among those within
``_BALANCE_TOLERANCE`` of that optimum, the ones that send the fewest bytes between stages.

Predictions are estimates from the plan's own costs: a stage's time is the ``cost_s`` of its
nodes plus its share (by compute) of the plan's resharding time, plus (given the cluster) the
point-to-point time of its activations sent on and its input's gradient sent back; its memory is its parameters'
state (parameter, gradient, AdamW moments) plus its activations times the microbatches it holds
at once (``num_microbatches`` under GPipe; ``min(num_microbatches, num_stages - index)`` under
1F1B). The step is ``sum(t) + (m - 1) * max(t)``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.fx

from autopar.cost.cluster import ClusterSpec
from autopar.cost.memory import local_bytes, param_state_bytes
from autopar.pipeline import Stage, StagePlan, bubble_fraction
from autopar.plan import Plan
from autopar.solver.choices import _layer_key
from autopar.trace import TracedModel, requires_grad

# Cut sets whose slowest stage is within this fraction of the best balance count as balanced;
# among them the splitter takes the one sending the fewest bytes between stages.
_BALANCE_TOLERANCE = 0.01


def stage_mesh_of(mesh_shape: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """The mesh of one stage: mesh axis 0 cut into ``num_stages`` equal rank groups."""
    check_num_stages(mesh_shape, num_stages)
    return (mesh_shape[0] // num_stages, *mesh_shape[1:])


def check_num_stages(mesh_shape: Sequence[int], num_stages: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline must be 'off', 'auto' or a positive number of stages, got {num_stages!r}")
    if mesh_shape[0] % num_stages:
        devices = math.prod(mesh_shape)
        example = f" (such as {(num_stages, devices // num_stages)})" if devices % num_stages == 0 else ""
        raise ValueError(
            f"pipeline={num_stages} cuts mesh axis 0 into {num_stages} equal groups of ranks, but mesh "
            f"{tuple(mesh_shape)} has {mesh_shape[0]} ranks on axis 0: use a number of stages that divides "
            f"{mesh_shape[0]}, or a mesh whose first axis is a multiple of {num_stages}{example}"
        )


def stage_ranks(mesh_shape: Sequence[int], num_stages: int) -> list[tuple[int, ...]]:
    """Global ranks of each stage, in stage-mesh (row-major) order."""
    grid = torch.arange(math.prod(mesh_shape)).reshape(num_stages, -1)
    return [tuple(int(r) for r in row) for row in grid]


def schedule_for(num_stages: int, num_microbatches: int) -> str:
    """1F1B holds fewer microbatches in flight, but needs at least as many microbatches as stages."""
    return "1F1B" if num_microbatches >= num_stages else "GPipe"


def split_stages(
    traced: TracedModel,
    plan: Plan,
    num_stages: int,
    num_microbatches: int,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec | None = None,
) -> StagePlan:
    """Cut the forward graph of ``traced`` (one microbatch) into ``num_stages`` contiguous stages.

    ``plan`` is the intra-stage plan, made for the stage mesh; ``mesh_shape`` is the whole mesh.
    With ``cluster``, each stage's time includes sending its activations on and its input's
    gradient back over the link of mesh axis 0. See the module docstring for the rest.
    """
    stage_mesh = stage_mesh_of(tuple(mesh_shape), num_stages)
    if tuple(plan.spec_mesh) != stage_mesh:
        raise ValueError(f"the intra-stage plan is for mesh {tuple(plan.spec_mesh)}, not the stage mesh {stage_mesh}")
    nodes = [n for n in traced.gm.graph.nodes if n.op not in ("placeholder", "output")]
    units, unit_names = _units(nodes, traced)
    num_units = max(units) + 1 if units else 0
    if num_stages > num_units:
        what = f"{num_units} layers ({unit_names})" if unit_names else f"{num_units} operators"
        raise ValueError(
            f"pipeline={num_stages} needs at least {num_stages} layers to put on separate stages, but this "
            f"model has {what}: use at most pipeline={num_units}, or a deeper model"
        )
    position = {node.name: index for index, node in enumerate(nodes)}
    cut_bytes = _cut_bytes(nodes, position, plan, stage_mesh)
    # Unit u starts at node index starts[u]; a cut before unit u is possible if its crossing
    # values are all single tensors.
    starts = [index for index in range(len(nodes)) if index == 0 or units[index] != units[index - 1]]
    unit_cost = [0.0] * num_units
    for index, node in enumerate(nodes):
        unit_cost[units[index]] += plan.nodes[node.name].cost_s if node.name in plan.nodes else 0.0
    allowed = [u == 0 or cut_bytes[starts[u]] is not None for u in range(num_units)]
    bounds = _choose_cuts(unit_cost, [cut_bytes[s] or 0.0 for s in starts], allowed, num_stages)
    if bounds is None:
        raise ValueError(
            f"pipeline={num_stages}: no {num_stages - 1} cuts between layers pass only single tensors from "
            "one stage to the next (a cut must not split a tuple-valued op from its getitems): use fewer stages"
        )

    compute = sum(unit_cost) or 1.0
    reshard_s = float(plan.predicted.get("reshard_s", 0.0))
    schedule = schedule_for(num_stages, num_microbatches)
    ranks = stage_ranks(mesh_shape, num_stages)
    stage_of_node = {}
    stages_units = list(zip(bounds[:-1], bounds[1:]))
    for stage, (first, last) in enumerate(stages_units):
        for index in range(starts[first], starts[last] if last < num_units else len(nodes)):
            stage_of_node[nodes[index].name] = stage
    param_bytes = _param_bytes_by_stage(traced, plan, stage_of_node, stage_mesh, num_stages)
    activation_bytes = [0.0] * num_stages
    for node in nodes:
        decision = plan.nodes.get(node.name)
        val = node.meta.get("val")
        if decision is None or not requires_grad(node) or not isinstance(val, torch.Tensor) or not decision.outs:
            continue
        activation_bytes[stage_of_node[node.name]] += local_bytes(decision.shapes[0], val.dtype, decision.outs[0], stage_mesh)
    link = cluster.axis_link(tuple(mesh_shape), 0) if cluster is not None else None
    stages = []
    for stage, (first, last) in enumerate(stages_units):
        cost = sum(unit_cost[first:last])
        p2p_s = 0.0
        if link is not None:
            for cut in (first, last):  # the gradient of the input goes back, the output goes on
                if 0 < cut < num_units:
                    p2p_s += link.latency_s + (cut_bytes[starts[cut]] or 0.0) / link.bandwidth_bytes_per_s
        in_flight = num_microbatches if schedule == "GPipe" else min(num_microbatches, num_stages - stage)
        stages.append(Stage(
            index=stage,
            layers=(first, last),
            nodes=tuple(n.name for n in nodes if stage_of_node[n.name] == stage),
            ranks=ranks[stage],
            time_s=cost + reshard_s * cost / compute + p2p_s,
            memory_bytes=float(param_bytes[stage] + in_flight * activation_bytes[stage]),
        ))
    times = [s.time_s for s in stages]
    return StagePlan(
        num_microbatches=num_microbatches,
        schedule=schedule,
        stage_mesh=stage_mesh,
        stages=tuple(stages),
        step_time_s=sum(times) + (num_microbatches - 1) * max(times),
        bubble_fraction=bubble_fraction(times, num_microbatches),
    )


def _units(nodes: list[torch.fx.Node], traced: TracedModel) -> tuple[list[int], str]:
    """Unit index of every forward node, and the name of the layer list ('' if none)."""
    keys = [_layer_key(node, None) for node in nodes]
    sizes: dict[str, set[int]] = {}
    for key in keys:
        if key is not None:
            sizes.setdefault(key[0], set()).add(key[1])
    if not sizes:
        return list(range(len(nodes))), ""
    prefix = max(sizes, key=lambda p: (len(sizes[p]), -min(i for i, k in enumerate(keys) if k and k[0] == p)))
    order = {layer: u for u, layer in enumerate(sorted(sizes[prefix]))}
    units, current = [], 0
    for key in keys:
        if key is not None and key[0] == prefix:
            current = max(current, order[key[1]])  # a stray node of an earlier layer stays in order
        units.append(current)
    dense = {unit: index for index, unit in enumerate(dict.fromkeys(units))}  # no empty units
    return [dense[u] for u in units], f"ModuleList {prefix}"


def _cut_bytes(nodes, position, plan: Plan, stage_mesh) -> list[float | None]:
    """Bytes sent across a cut just before each node index (None where a non-tensor would cross)."""
    end = len(nodes)
    size_at = [0.0] * (end + 2)  # difference arrays over cut positions
    opaque_at = [0] * (end + 2)
    for index, node in enumerate(nodes):
        if not node.users:
            continue
        last = max(position.get(user.name, end) for user in node.users)
        val = node.meta.get("val")
        decision = plan.nodes.get(node.name)
        if isinstance(val, torch.Tensor) and decision is not None and decision.outs:
            size = float(local_bytes(decision.shapes[0], val.dtype, decision.outs[0], stage_mesh))
            size_at[index + 1] += size
            size_at[last + 1] -= size
        else:
            opaque_at[index + 1] += 1
            opaque_at[last + 1] -= 1
    out: list[float | None] = []
    total, opaque = 0.0, 0
    for cut in range(end):
        total += size_at[cut]
        opaque += opaque_at[cut]
        out.append(None if opaque else total)
    return out


def _choose_cuts(cost: list[float], cut_bytes: list[float], allowed: list[bool], num_stages: int) -> list[int] | None:
    """Unit boundaries [0, b1, ..., num_units] of the most balanced cut set, fewest bytes among near-ties."""
    num_units = len(cost)
    prefix = [0.0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    inf = float("inf")

    def best_max() -> float:
        # worst[k][j]: smallest slowest-stage time putting units [0, j) on k stages.
        worst = [[inf] * (num_units + 1) for _ in range(num_stages + 1)]
        worst[0][0] = 0.0
        for k in range(1, num_stages + 1):
            for j in range(1, num_units + 1):
                if j < num_units and not allowed[j]:
                    continue
                for i in range(k - 1, j):
                    if worst[k - 1][i] < inf and (i == 0 or allowed[i]):
                        worst[k][j] = min(worst[k][j], max(worst[k - 1][i], prefix[j] - prefix[i]))
        return worst[num_stages][num_units]

    target = best_max()
    if target == inf:
        return None
    limit = target * (1 + _BALANCE_TOLERANCE) + 1e-15
    # fewest[k][j]: fewest bytes cut putting units [0, j) on k stages, no stage above the limit.
    fewest = [[inf] * (num_units + 1) for _ in range(num_stages + 1)]
    back = [[-1] * (num_units + 1) for _ in range(num_stages + 1)]
    fewest[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(1, num_units + 1):
            if j < num_units and not allowed[j]:
                continue
            for i in range(k - 1, j):
                if fewest[k - 1][i] == inf or (i and not allowed[i]) or prefix[j] - prefix[i] > limit:
                    continue
                total = fewest[k - 1][i] + (cut_bytes[i] if i else 0.0)
                if total < fewest[k][j]:
                    fewest[k][j], back[k][j] = total, i
    if fewest[num_stages][num_units] == inf:
        return None
    bounds, j = [num_units], num_units
    for k in range(num_stages, 0, -1):
        j = back[k][j]
        bounds.append(j)
    return bounds[::-1]


def _param_bytes_by_stage(traced: TracedModel, plan: Plan, stage_of_node, stage_mesh, num_stages) -> list[float]:
    """Parameter + gradient + AdamW state each stage holds (a tensor used by two stages counts on both)."""
    out = [0.0] * num_stages
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    for graph_input in traced.placeholders("param"):
        node = placeholders[graph_input.name]
        val = node.meta.get("val")
        spec = plan.params.get(graph_input.fqn)
        if not isinstance(val, torch.Tensor) or spec is None:
            continue
        if graph_input.fqn != traced.ties.get(graph_input.fqn, graph_input.fqn):
            continue  # the tied copy's state is counted under its first name
        stages = {stage_of_node[u.name] for u in node.users if u.name in stage_of_node} or {0}
        for stage in stages:
            out[stage] += param_state_bytes(tuple(val.shape), val.dtype, spec, stage_mesh)
    return out


def stage_of_nodes(stage_plan: StagePlan, gm: torch.fx.GraphModule) -> dict[str, int]:
    """Stage of every non-placeholder node of ``gm``: the plan's stage for the traced nodes, and
    for nodes a pass inserted (collectives), the stage of the node that consumes them."""
    planned = stage_plan.stage_of()
    stage: dict[str, int] = {}
    for node in reversed(list(gm.graph.nodes)):
        if node.op in ("placeholder", "output"):
            continue
        if node.name in planned:
            stage[node.name] = planned[node.name]
            continue
        users = [stage[u.name] for u in node.users if u.name in stage]
        if any(u.op == "output" for u in node.users):
            users.append(stage_plan.num_stages - 1)
        if not users:
            raise ValueError(f"node {node.format_node()} is in no pipeline stage and has no consumer in one")
        stage[node.name] = min(users)
    return stage


def batch_size_of(example_inputs, example_kwargs) -> int:
    """Dim 0 shared by every tensor input: the batch that pipelining cuts into microbatches."""
    leaves = torch.utils._pytree.tree_leaves((example_inputs, example_kwargs or {}))
    sizes = {tuple(t.shape)[0] if t.dim() else None for t in leaves if isinstance(t, torch.Tensor)}
    if not sizes:
        raise ValueError("pipelining cuts the example inputs' dim 0 into microbatches, but no input is a tensor")
    if len(sizes) > 1 or None in sizes:
        raise ValueError(
            f"pipelining cuts every tensor input on dim 0 into microbatches, but the inputs' dim 0 sizes are "
            f"{sorted(sizes, key=str)}: give every tensor input the batch as its dim 0"
        )
    return sizes.pop()


def check_num_microbatches(num_microbatches, batch: int) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
    if batch % num_microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
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
