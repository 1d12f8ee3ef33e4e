"""Symbolic costs: a plan's predicted time and memory as functions of the batch size.

``price_plan(traced, plan, cluster)`` prices the plan's own choices (no solve) on a traced graph
of the same structure, such as the same model traced at another batch size: the roofline terms
of every op, its gradient all-reduces, every resharding, and the liveness curve of memory. At
the plan's batch it reproduces ``plan.predicted`` exactly.

``symbolic_costs`` prices the plan at its batch ``b`` and at ``2b`` and, since with the sequence
length fixed every FLOP count, byte count and tensor size of a training step is linear in the
batch (each sharded batch dim divides evenly), writes each quantity in the batch symbol ``B``
(sympy):

* every op's time: ``max(flops_s(B), bytes_s(B)) · factor``, with ``flops_s`` and ``bytes_s``
  each linear; where one line dominates for every ``B >= 1`` the ``Max`` is dropped;
* resharding and gradient all-reduces: ``(k-1)·α`` terms (constant) plus bytes/β (linear);
* peak memory: ``Max`` over the timeline's times of linear functions, kept to the upper
  envelope over ``B >= 1``;
* the optimizer step (``cost.optimizer``): the parameters', a constant.

``Plan.predict(batch=...)`` substitutes ``B``. It assumes the same strategies stay valid at the
new batch (a batch dim sharded ``k`` ways needs a batch divisible by ``k``).
"""

from __future__ import annotations

import operator
from typing import Any

import sympy
import torch
import torch.fx

from autopar.cost import comm, compute, liveness, memory
from autopar.cost import optimizer as step_cost
from autopar.cost.cluster import ClusterSpec
from autopar.errors import ModelError, PlanError
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan
from autopar.ir.prediction import Prediction
from autopar.rules import op_info
from autopar.rules.registry import Strategy, tensor_input_nodes, tensor_meta
from autopar.solver.problem.gathered import PREFIX, GatherRow, gathered_intervals, reads_whole, single_gather
from autopar.solver.problem.op_prices import grad_sync_axes, grad_sync_cost, kernel_collectives
from autopar.trace import TracedModel, requires_grad
from autopar.trace.moe import EXPERTS_OP

BATCH = sympy.Symbol("B", positive=True)


def _outs(node: torch.fx.Node) -> list[tuple[tuple[int, ...], torch.dtype]]:
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else [val]
    return [meta for meta in (tensor_meta(v) for v in values) if meta is not None]


def price_plan(traced: TracedModel, plan: Plan, cluster: ClusterSpec) -> dict[str, Any]:
    """Price ``plan``'s choices on ``traced``: ``roofline`` [(flops_s, bytes_s, factor)] per op,
    ``comm`` [(seconds, bytes)] per gradient all-reduce and resharding, ``memory_curve``."""
    mesh = tuple(plan.mesh_shape)
    kinds = {i.name: i.kind for i in traced.inputs}
    grads = {node.name: requires_grad(node) for node in traced.gm.graph.nodes}
    roofline, comms, out_bytes, live = [], [], {}, []
    for node in traced.gm.graph.nodes:
        decided = plan.nodes.get(node.name)
        if decided is None:
            raise PlanError(
                f"node {node.name} is not in the plan: the model traced to another graph; predict only changes the batch size: re-plan for this model"
            )
        if node.op == "placeholder":
            kind = kinds[node.name]
            outs = _outs(node)
            out_bytes[node.name] = float(memory.local_bytes(*outs[0], decided.outs[0], mesh)) if outs else 0.0
            live.append(liveness.LiveNode(node.name, kind, (), None, grads[node.name], (), outs[0][1].itemsize if outs else 4))
            continue
        if node.op == "output":
            inputs = tuple(producer for producer, _ in decided.inputs)
            out_bytes[node.name] = 0.0
            live.append(liveness.LiveNode(node.name, "output", inputs))
            continue
        inputs = tuple(producer for producer, _ in decided.inputs)
        outs = _outs(node)
        out_bytes[node.name] = float(
            sum(memory.local_bytes(shape, dtype, spec, mesh) for (shape, dtype), spec in zip(outs, decided.outs))
        )
        is_alias = node.target is operator.getitem or compute.is_view(node.target)
        internal = memory.internal_saved_factor(node.target, op_info(node).kw) if node.target is EXPERTS_OP else 0.0
        live.append(
            liveness.LiveNode(
                node.name,
                "alias" if is_alias else "op",
                inputs,
                node.target,
                grads[node.name],
                tuple(grads[p] for p in inputs),
                outs[0][1].itemsize if outs else 4,
                internal,
            )
        )
        for (producer, index), dst in zip(decided.inputs, decided.ins):
            src = plan.nodes[producer].outs[index]
            if src != dst:
                shape, dtype = _outs(traced.node(producer))[index]
                cost = comm.transition_cost(src, dst, shape, dtype, mesh, cluster, grads[producer])
                comms.append((cost.forward_s + cost.backward_s, cost.bytes_sent))
        if node.target is operator.getitem:
            continue
        info = op_info(node)
        strategy = Strategy(decided.ins, decided.outs, decided.kernel, decided.kernel_axes, decided.source, decided.whole_grad)
        roofline.append(compute.roofline_terms(info, strategy, mesh, cluster, grads[node.name]))
        input_nodes = tensor_input_nodes(node)
        for position, arg in enumerate(info.inputs):
            if not grads[input_nodes[position].name]:
                continue
            is_param = kinds.get(input_nodes[position].name) == "param"
            for axis in grad_sync_axes(strategy, position):
                cost = grad_sync_cost(arg, strategy.ins[position], axis, is_param, mesh, cluster)
                comms.append((cost.backward_s, cost.bytes_sent))
        steps = kernel_collectives(info, strategy, mesh, grads[node.name])
        if steps:
            seconds, per_axis = comm.collectives_cost(steps, mesh, cluster)
            comms.append((seconds, sum(per_axis.values())))
    ties = _ties(traced)
    optimizer = plan.optimizer  # the one its step is priced for
    timeline = liveness.build_timeline(live, optimizer, ties, step_temporary=step_cost.step_temporary(cluster, optimizer))
    gathered, sizes = _gathered(traced, plan, kinds, grads, ties, live, cluster.gloo)
    out_bytes.update(sizes)
    curve = liveness.Timeline(timeline.names, timeline.intervals + tuple(gathered)).curve(out_bytes.__getitem__)
    stepped = step_cost.stepped_tensors(timeline.intervals, out_bytes.__getitem__)
    optimizer_s = step_cost.plan_step_s(stepped, cluster, mesh, step_cost.holds_dtensors(plan.params.values()), optimizer)
    return {"roofline": roofline, "comm": comms, "memory_curve": curve, "optimizer_s": optimizer_s}


def _gathered(
    traced: TracedModel, plan: Plan, kinds, grads, ties, live, exchange: bool
) -> tuple[list[liveness.Interval], dict[str, float]]:
    """The intervals and sizes of the parameters the runtime gathers under ``plan``, as
    ``solver.problem.gathered.gathered_parameters`` prices them in the choice graph, the layers the
    plan keeps gathered kept."""
    mesh = tuple(plan.mesh_shape)
    if all(size == 1 for size in mesh):
        return [], {}
    nodes = list(traced.gm.graph.nodes)
    index = {node.name: i for i, node in enumerate(nodes)}
    leader = {member: group[0] for group in ties for member in group}
    fqns = {i.name: traced.ties.get(i.fqn, i.fqn) for i in traced.inputs if i.kind == "param"}
    uses: dict[str, list[tuple[int, int]]] = {}
    first: dict[str, tuple[str, int, Any]] = {}
    for node in nodes:
        if node.op == "placeholder" or not reads_whole(node.target if node.op == "call_function" else None):
            continue
        decided = plan.nodes[node.name]
        for in_index, ((producer, out_index), dst) in enumerate(zip(decided.inputs, decided.ins)):
            source = traced.node(producer)
            param = producer if kinds.get(producer) == "param" else None
            if (
                param is None
                and source.op == "call_function"
                and source.target is torch.ops.aten._to_copy.default
                and isinstance(source.args[0], torch.fx.Node)
                and kinds.get(source.args[0].name) == "param"
            ):
                param = source.args[0].name  # a precision policy's cast of the parameter
            if param is None or not grads[producer]:
                continue
            param = leader.get(param, param)
            uses.setdefault(param, []).append((index[node.name], in_index))
            first.setdefault(param, (producer, out_index, dst))
    rows, sizes = [], {}
    for param, (producer, out_index, dst) in first.items():
        shape, dtype = _outs(traced.node(producer))[out_index]
        src = plan.nodes[producer].outs[out_index]
        sizes[PREFIX + param] = float(memory.local_bytes(shape, dtype, dst, mesh)) if single_gather(src, dst) else 0.0
        rows.append(GatherRow(param, fqns.get(param, param), tuple(uses[param]), shape, dtype, _outs(traced.node(param))[0][1]))
    # resharded after forward as the plan runs them (``Plan.kept_layers``; None: FSDP2's default)
    schedule = CommOptions(reshard_after_forward=plan.kept_layers)
    return gathered_intervals(rows, live, schedule, exchange=exchange), sizes


def _ties(traced: TracedModel) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for graph_input in traced.placeholders("param"):
        groups.setdefault(traced.ties.get(graph_input.fqn, graph_input.fqn), []).append(graph_input.name)
    return [names for names in groups.values() if len(names) > 1]


def _backward_s(roofline) -> float:
    """Backward compute of the ops (``op_prices.price_strategies``' ``backward_s``)."""
    return sum(max(f, b) * (factor - 1) for f, b, factor in roofline)


def _overlapped_gathers(schedule, priced_b: dict[str, Any], priced_2b: dict[str, Any], batch: int) -> sympy.Expr:
    """``ParamSchedule.overlap_delta_s`` in ``B``: the gathers are constants, forward compute is
    the plan's ``forward_s`` moved by its roofline's slope (``comm.exposed_gathers_s``)."""
    slope, _ = _line(_forward_s(priced_b["roofline"]), _forward_s(priced_2b["roofline"]), batch)
    forward = sympy.Float(float(schedule["forward_s"]), 17) + sympy.Float(slope, 17) * (BATCH - batch)
    first = sympy.Float(float(schedule["first_gather_s"]), 17)
    exposed = first + sympy.Max(0, sympy.Float(float(schedule["gathered_s"]), 17) - first - forward)
    priced = float(schedule["gather_s"]) + float(schedule["regather_s"]) - float(schedule.get("copy_s", 0.0))
    return exposed - sympy.Float(priced, 17)


def _forward_s(roofline) -> float:
    """Forward compute of the ops."""
    return sum(max(f, b) for f, b, _ in roofline)


def totals(priced: dict[str, Any]) -> dict[str, float]:
    """step_time_s, comm_bytes and peak_memory_bytes of a ``price_plan`` result."""
    compute_s = sum(max(f, b) * factor for f, b, factor in priced["roofline"])
    return {
        "step_time_s": compute_s + sum(seconds for seconds, _ in priced["comm"]) + priced["optimizer_s"],
        "comm_bytes": sum(sent for _, sent in priced["comm"]),
        "peak_memory_bytes": max(priced["memory_curve"], default=0.0),
    }


def _line(at_b: float, at_2b: float, batch: int) -> tuple[float, float]:
    """(slope, intercept) of the line through (b, at_b) and (2b, at_2b)."""
    slope = (at_2b - at_b) / batch
    return slope, at_b - slope * batch


def _expr(slope: float, intercept: float) -> sympy.Expr:
    return sympy.Float(slope, 17) * BATCH + sympy.Float(intercept, 17)


def _upper_envelope(lines: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lines that are the maximum somewhere on B >= 1 (tested at B = 1 and at each crossing
    point beyond it, and as B grows without bound)."""
    unique = sorted(set(lines))
    keep = set()
    probes = {1.0, 1e12}
    for i, (s1, c1) in enumerate(unique):
        for s2, c2 in unique[i + 1 :]:
            if s1 != s2:
                cross = (c2 - c1) / (s1 - s2)
                if cross > 1:
                    probes.update({cross, cross * (1 + 1e-9)})
    for probe in probes:
        keep.add(max(unique, key=lambda line: (line[0] * probe + line[1], line[0])))
    return sorted(keep)


def symbolic_costs(
    priced_b: dict[str, Any], priced_2b: dict[str, Any], batch: int, predicted: Prediction | None = None
) -> dict[str, str]:
    """The plan's time, bytes sent and peak memory as sympy expressions in ``B`` (as strings).

    ``predicted`` (the plan's) carries how the runtime schedules parameter gradients
    (``grad_sync_s``, ``grad_schedule``): one bucketed reduction per parameter in place of the
    per-use prices, of which backward compute hides all but
    ``Max(last bucket, sync - backward(B))`` (``comm.exposed_grad_sync_s``). Parameter shapes do
    not change with the batch, so the reductions are constants; backward compute is linear."""
    time_terms = []
    lines: dict[tuple, int] = {}
    for (f1, m1, factor), (f2, m2, _) in zip(priced_b["roofline"], priced_2b["roofline"]):
        flops_line, bytes_line = _line(f1, f2, batch), _line(m1, m2, batch)
        key = (flops_line, bytes_line, factor)
        lines[key] = lines.get(key, 0) + 1
    linear_slope = linear_const = 0.0
    for (flops_line, bytes_line, factor), count in lines.items():
        dominant = _upper_envelope([flops_line, bytes_line])
        if len(dominant) == 1:
            linear_slope += count * factor * dominant[0][0]
            linear_const += count * factor * dominant[0][1]
        else:
            time_terms.append(count * factor * sympy.Max(_expr(*flops_line), _expr(*bytes_line)))
    comm_s = _line(sum(s for s, _ in priced_b["comm"]), sum(s for s, _ in priced_2b["comm"]), batch)
    comm_bytes = _line(sum(b for _, b in priced_b["comm"]), sum(b for _, b in priced_2b["comm"]), batch)
    step = _expr(linear_slope + comm_s[0], linear_const + comm_s[1]) + sympy.Add(*time_terms)
    schedule = predicted.grad_schedule if predicted is not None else None
    if schedule is not None:
        sync_s, last_s = float(predicted.grad_sync_s), float(schedule["last_bucket_s"])
        backward = _expr(*_line(_backward_s(priced_b["roofline"]), _backward_s(priced_2b["roofline"]), batch))
        streamed = sympy.Float(sync_s, 17)  # what the communication stream runs in backward
        if "regathered_s" in schedule:
            streamed = streamed + sympy.Float(float(schedule["regathered_s"]), 17)
        exposed = sympy.Max(sympy.Float(min(last_s, sync_s), 17), streamed - backward, 0)
        step = step + sympy.Float(float(schedule["delta_s"]) - sync_s, 17) + exposed
        if "gathered_s" in schedule:  # FSDP's gathers overlap compute (``comm_schedule.ParamSchedule``)
            step = step + _overlapped_gathers(schedule, priced_b, priced_2b, batch)
        comm_bytes = (comm_bytes[0], comm_bytes[1] + float(schedule["delta_bytes"]))
    if priced_b["optimizer_s"]:  # the parameters' step, whatever the batch: a constant
        step = step + sympy.Float(priced_b["optimizer_s"], 17)
    memory_lines = [_line(a, b, batch) for a, b in zip(priced_b["memory_curve"], priced_2b["memory_curve"])]
    peak = sympy.Max(*(_expr(*line) for line in _upper_envelope(memory_lines)))
    return {
        "symbol": str(BATCH),
        "batch": batch,
        "step_time_s": str(step),
        "comm_bytes": str(_expr(*comm_bytes)),
        "peak_memory_bytes": str(peak),
    }


def double_batch(args: Any) -> Any:
    """The example inputs with every tensor's dim 0 (the batch) doubled, repeating its rows."""
    if isinstance(args, torch.Tensor):
        return torch.cat([args, args]) if args.dim() else args
    if isinstance(args, (list, tuple)):
        return type(args)(double_batch(a) for a in args)
    if isinstance(args, dict):
        return {k: double_batch(v) for k, v in args.items()}
    return args


def batch_size(args: Any) -> int:
    """The batch size of the example inputs: dim 0 of the first tensor with dims."""
    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    raise ModelError(
        "symbolic costs need a tensor input whose dim 0 is the batch; the example inputs have none: pass the "
        "batch as a tensor input, or plan without symbolic_batch"
    )


__all__ = ["BATCH", "price_plan", "totals", "symbolic_costs", "double_batch", "batch_size"]
