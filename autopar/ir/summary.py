"""The plan in words: ``Plan.summary()``. It reads the plan and nothing else, so it lives beside it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autopar.ir.context import is_balanced, max_work_fraction
from autopar.ir.spec import VIEW_OP_NAMES, padded_axis, spec_text

if TYPE_CHECKING:
    from autopar.ir.plan import Plan


def _is_view(op: str) -> bool:
    # Plans name overloads ("aten.view.default"); VIEW_OP_NAMES are packets ("view").
    return op == "getitem" or op.rsplit(".", 1)[0].removeprefix("aten.") in VIEW_OP_NAMES


def format_bytes(num: float, digits: int = 1) -> str:
    """Bytes in binary units: "512 B", "3.4 MiB" (``digits`` after the point)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{int(num)} B" if unit == "B" else f"{num:.{digits}f} {unit}"
        num /= 1024
    return str(num)


def header_lines(plan: Plan) -> list[str]:
    """The summary's first lines: the plan, its predicted time, memory and bytes, the solver, the
    pipeline and the memory decisions."""
    pred = plan.predicted.to_json()
    # A pipelined plan's compute, resharding and bytes are for one microbatch through the whole
    # graph on the stage mesh (the stage planner keeps them apart from the pipeline's step).
    per = pred.get("one_microbatch_unpipelined", pred) if plan.pipeline is not None else pred
    lines = [
        f"autopar plan  mesh={tuple(plan.mesh_shape)}  cluster={plan.cluster or '-'}  "
        f"precision={plan.precision.name if plan.precision is not None else '32-true'}  "
        + (f"optimizer={plan.optimizer}  " if plan.declares_optimizer else "")
        + f"graph={plan.graph_hash}  plan={plan.hash}",
        f"  predicted step time {pred.get('step_time_s', 0) * 1e3:.3f} ms "
        + ("(one microbatch through every stage: " if plan.pipeline is not None else "(")
        + f"compute {per.get('compute_s', 0) * 1e3:.3f} ms, resharding {per.get('reshard_s', 0) * 1e3:.3f} ms)",
        f"  peak memory per device {format_bytes(pred.get('peak_memory_bytes', 0))}"
        + (f" ({pred['peak_memory_at']})" if pred.get("peak_memory_at") else "")
        + (
            f"   communication per device per microbatch {format_bytes(per.get('comm_bytes', 0))}"
            if plan.pipeline is not None
            else f"   communication per device per step {format_bytes(pred.get('comm_bytes', 0))}"
        ),
    ]
    if pred.get("memory_at_peak_bytes"):
        parts = ", ".join(f"{kind} {format_bytes(size)}" for kind, size in pred["memory_at_peak_bytes"].items() if size)
        lines.append(f"  memory at the peak: {parts}")
    if pred.get("allocator_peak_bytes"):
        peaks = pred["allocator_peak_bytes"]
        lines.append(
            f"  reserved by PyTorch's caching allocator: {format_bytes(peaks['reserved'])}"
            f" ({format_bytes(peaks['reserved_expandable'])} with expandable segments)"
        )
    if per.get("comm_bytes_per_axis"):
        parts = ", ".join(
            f"axis {axis} (size {size}): {format_bytes(sent)}"
            for axis, (size, sent) in enumerate(zip(plan.spec_mesh, per["comm_bytes_per_axis"]))
        )
        scope = "per microbatch by stage-mesh axis" if plan.pipeline is not None else "per step by mesh axis"
        lines.append(f"  bytes sent per device {scope}: {parts}")
    solver = plan.solver.to_json()
    if solver:
        lines.append(
            f"  solver: {solver.get('status')}"
            + (f" in {plan.stats['solve_time_s']:.2f} s" if "solve_time_s" in plan.stats else "")
            + ", "
            f"{solver.get('num_variables', 0)} variables, {solver.get('num_constraints', 0)} constraints"
            + (f", {solver['method']} by {solver.get('backend')}" if solver.get("method") else "")
            + (f", gap {solver['gap']:.2%} to the LP bound" if solver.get("gap") is not None else "")
        )
    if plan.data is not None:
        lines.append("  " + plan.data.describe())
    lines += [f"  note: {note}" for note in plan.notes]
    if plan.kept_layers is not None:
        lines.append(f"  gathered parameters kept from forward to backward (no re-gather): {kept_text(plan.kept_layers)}")
    lines += pipeline_lines(plan)
    if plan.memory is not None:
        lines.extend("  " + line for line in plan.memory.summary_lines())
    return lines


def kept_text(kept: tuple[str, ...] | None) -> str:
    """``Plan.kept_layers`` in words: whose gathered parameters stay from forward to backward."""
    if kept is None:
        return "the root's (FSDP2's default)"
    layers = [layer for layer in kept if layer]
    shown = ", ".join(layers[:2] + (["..."] if len(layers) > 3 else []) + layers[2:][-1:])
    counted = f"{len(layers)} layer{'s' if len(layers) != 1 else ''}" + (f" ({shown})" if layers else "")
    if "" in kept:
        return f"the root's and {counted}"
    return counted if layers else "none (every layer resharded after forward, the root's too)"


# What a kernel does, in words, for the summary and ``explain``.
KERNEL_NAMES = {
    "sdpa_context_parallel": "context parallel: q, k, v split by sequence, K/V all-gathered, causal offsets by global position",
}

# Kernels that split experts by rank (``rules.moe``), in words.
EXPERT_PARALLEL_TEXT = {
    "moe_experts_all_to_all": "all-to-all dispatch and combine",
    "moe_experts_local": "tokens replicated, partial sums combined",
    "grouped_mm_local_experts": "grouped matmul of the local experts, partial sums",
}


def context_parallel_note(shape, kernel_axes, mesh_shape) -> str:
    """How the context-parallel attention splits its causal work (``ir.context``)."""
    sizes = tuple(mesh_shape[axis] for axis in kernel_axes)
    seq_len = shape[-2]
    layout = "queries head-tail" if is_balanced(seq_len, sizes) else "queries contiguous (odd slices)"
    return (
        f"context parallel over axes {list(kernel_axes)} (K/V all-gathered, {layout}; "
        f"most loaded rank {max_work_fraction(seq_len, sizes):.2f}x the mean causal work)"
    )


def node_row(name: str, node, mesh_shape=None) -> tuple[str, str, str, str, str, str]:
    """One row of a node table: name, op, output shape, placement, cost in ms, and notes (its
    kernel, or where its rule came from)."""
    note = []
    if node.kernel == "sdpa_context_parallel" and mesh_shape is not None and node.shapes:
        note.append(context_parallel_note(node.shapes[0], node.kernel_axes, mesh_shape))
    elif node.kernel in EXPERT_PARALLEL_TEXT:
        note.append(
            f"EXPERT PARALLEL on axes {list(node.kernel_axes)}: {EXPERT_PARALLEL_TEXT[node.kernel]} (kernel {node.kernel})"
        )
    elif node.kernel:
        note.append(f"kernel {node.kernel} on axes {list(node.kernel_axes)}")
    if node.source == "fallback":
        note.append("FALLBACK: replicated (no rule)")
    elif node.source == "dtensor":
        note.append("rule from DTensor")
    shape = ("x".join(str(d) for d in node.shapes[0]) or "scalar") if node.shapes else "-"
    placements = spec_text(node.outs[0]) if node.outs else "-"
    return name, node.op, shape, placements, f"{node.cost_s * 1e3:.4f}", "; ".join(note)


def _padded_note(plan: Plan, fqn: str, spec) -> str:
    """ "  padded: ceil(n / k) of n rows a rank" for a padded parameter shard (``spec.padded_axis``)."""
    node = plan.placeholder(fqn)
    shape = tuple(node.shapes[0]) if node is not None and node.op == "param" and node.shapes else None
    axis = padded_axis(shape, spec, plan.mesh_shape) if shape else None
    if axis is None:
        return ""
    return f"  padded: {-(-shape[0] // plan.mesh_shape[axis])} of {shape[0]} rows a rank"


def summary_text(plan: Plan, max_rows: int = 60) -> str:
    lines = header_lines(plan)
    lines.append("")
    lines.append("Parameters")
    width = max((len(f) for f in plan.params), default=10)
    for fqn, spec in plan.params.items():
        lines.append(f"  {fqn:<{width}}  {spec_text(spec)}{_padded_note(plan, fqn, spec)}")
    lines.append("")
    lines.append("Operators (views and getitems omitted)")
    rows = 0
    table = [("node", "op", "output shape", "placements", "cost ms", "note")]
    for name, node in plan.nodes.items():
        if node.source in ("placeholder", "output") or _is_view(node.op):
            continue
        rows += 1
        if rows > max_rows:
            continue
        table.append(node_row(name, node, plan.mesh_shape))
    # Columns as wide as their widest cell, so long node names (scaled_dot_product_attention_1)
    # keep the table aligned.
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        cells = [row[i].rjust(widths[i]) if i == 4 else row[i].ljust(widths[i]) for i in range(5)]
        lines.append(("  " + " ".join(cells) + "  " + row[5]).rstrip())
    if rows > max_rows:
        lines.append(f"  ... {rows - max_rows} more operators")
    lines.append("")
    counts = plan.collective_counts()
    if counts:
        lines.append("Collectives in forward (kind, mesh axis: count)")
        for (kind, axis), count in counts.items():
            lines.append(f"  {kind:<15} axis {axis}: {count}")
    else:
        lines.append("Collectives in forward: none")
    lines += expert_parallel_lines(plan)
    lines += fallback_lines(plan)
    return "\n".join(lines)


def expert_parallel_lines(plan: Plan) -> list[str]:
    """The experts ops that split experts by rank (``predicted.expert_parallel``): the degree
    and axes, the experts each device holds, and the op's cost with its all-to-all part."""
    records = plan.predicted.expert_parallel or ()
    if not records:
        return []
    factor = records[0].get("capacity_factor")
    lines = [
        "",
        f"Expert parallelism: {len(records)} experts ops split by expert"
        + (f" (busiest rank priced at capacity factor {factor})" if factor else ""),
    ]
    for record in records:
        exchange = (
            f", all-to-all {record['all_to_all_s'] * 1e3:.4f} ms ({format_bytes(record['all_to_all_bytes'])} sent)"
            if record.get("all_to_all_bytes")
            else ""
        )
        lines.append(
            f"  {record['node']}: EP {record['degree']} on axes {record['axes']}, "
            f"{record['experts_per_device']} of {record['num_experts']} experts per device, "
            f"{EXPERT_PARALLEL_TEXT.get(record['kernel'], record['kernel'])}; "
            f"cost {record['cost_s'] * 1e3:.4f} ms{exchange}"
        )
    return lines


def fallback_lines(plan: Plan) -> list[str]:
    """Every node that fell back to replication (no rule of ours, none from DTensor), grouped
    by op, so that a model's uncovered ops can be read off at once."""
    by_op: dict[str, list[str]] = {}
    for name, node in plan.nodes.items():
        if node.source == "fallback":
            by_op.setdefault(node.op, []).append(name)
    if not by_op:
        return ["Fallbacks (replicated, no rule): none"]
    total = sum(len(names) for names in by_op.values())
    lines = [f"Fallbacks (replicated, no rule): {total} node{'s' * (total != 1)} of {len(by_op)} op{'s' * (len(by_op) != 1)}"]
    for op, names in sorted(by_op.items()):
        lines.append(f"  {op} x{len(names)}: {', '.join(names)}")
    return lines


def pipeline_lines(plan: Plan) -> list[str]:
    """The stages of a pipelined plan: bubble, and each stage's layers, ranks, time and memory."""
    stages = plan.pipeline
    if stages is None:
        return []
    lines = [
        "",
        f"Pipeline: {stages.num_stages} stages x {stages.num_microbatches} microbatches, schedule {stages.schedule}"
        f"{f' ({stages.virtual_stages} virtual stages per rank group)' if stages.virtual_stages > 1 else ''}, "
        f"stage mesh {tuple(stages.stage_mesh)}; schedule's step {stages.step_time_s * 1e3:.3f} ms (the optimizer's after it), "
        f"bubble {stages.bubble_fraction:.1%} (specs below are per stage)",
        *([f"  why: {stages.reason}"] if stages.reason else []),
        f"  {'stage':>5}  {'layers':<9} {'ranks':<16} {'nodes':>6} {'ms/microbatch':>13} {'memory':>11}",
    ]
    for stage in stages.stages:
        ranks = ",".join(str(r) for r in stage.ranks)
        layers = f"[{stage.layers[0]}, {stage.layers[1]})"
        lines.append(
            f"  {stage.index:>5}  {layers:<9} {ranks:<16} {len(stage.nodes):>6} {stage.time_s * 1e3:>13.3f} "
            f"{format_bytes(stage.memory_bytes):>11}"
        )
    return lines
