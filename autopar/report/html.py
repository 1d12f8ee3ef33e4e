"""``autopar show plan.json --html report.html``: one self-contained HTML page about a plan.

Inline CSS and SVG only, nothing fetched: the page works offline and can be attached to a
ticket. It shows

- the layer graph: one box per module (named from parameter FQNs; repeated layers with the same
  sharding collapse into one ``layers.*`` box), in model order, colored by the placements of its
  parameters;
- the step-time breakdown: compute, communication per mesh axis (``predicted`` keys the cost
  model writes; the total resharding time when it writes none), and the pipeline bubble (0 until
  pipelining exists);
- memory per device: the timeline over forward and backward by kind (``plan.memory_timeline``),
  with the peak marked, if the plan has one, else its components if it has them, else the peak
  against the device's memory; for pipelines, each stage's time and memory;
- the forward collectives per mesh axis, and the solver's facts.
"""

from __future__ import annotations

import html
import re
from typing import TYPE_CHECKING, Any

from autopar.ir.spec import spec_text
from autopar.ir.summary import format_bytes

if TYPE_CHECKING:
    from autopar.ir.plan import Plan

_PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#86bcb6",
    "#d37295",
]
_REPLICATED = "#d9d9d9"
_INDEX_RE = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")

_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin-bottom: 4px; } h2 { font-size: 16px; margin-top: 28px; }
.facts { color: #555; font-size: 13px; } table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; } th { background: #f4f4f4; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }
svg text { font-family: Menlo, Consolas, monospace; font-size: 12px; }
.note { color: #777; font-size: 12px; }
"""

# After layout, count the layer labels and the memory timeline's areas that the browser actually
# drew (non-zero boxes), so a headless browser's DOM dump can prove that the page rendered them.
_SCRIPT = """
window.addEventListener('load', function () {
  var labels = document.querySelectorAll('.layer-name'), drawn = 0;
  labels.forEach(function (el) { var b = el.getBBox(); if (b.width > 0 && b.height > 0) drawn++; });
  document.body.setAttribute('data-layers-drawn', drawn + '/' + labels.length);
  var kinds = document.querySelectorAll('.memory-kind'), filled = 0;
  kinds.forEach(function (el) { var b = el.getBBox(); if (b.width > 0) filled++; });
  var peak = document.getElementById('memory-peak');
  document.body.setAttribute('data-memory-drawn', filled + '/' + kinds.length + (peak && peak.getBBox().height > 0 ? ' peak' : ''));
});
"""


def _esc(text: Any) -> str:
    return html.escape(str(text))


def _bytes(num: float) -> str:
    return format_bytes(num, digits=2)


def layer_rows(plan: Plan) -> list[dict[str, Any]]:
    """Modules in model order: ``name`` (with ``*`` for collapsed layer indices), ``count``, and
    ``params``: (leaf name, placements text) per parameter. Layers collapse when every one of
    them has the same placements."""
    modules: dict[str, list[tuple[str, str]]] = {}
    for fqn, spec in plan.params.items():
        module, _, leaf = fqn.rpartition(".")
        modules.setdefault(module or "(root)", []).append((leaf, spec_text(spec)))
    rows: dict[tuple[str, tuple], dict[str, Any]] = {}
    for module, params in modules.items():
        key = (_INDEX_RE.sub("*", module), tuple(params))
        row = rows.setdefault(key, {"name": key[0], "params": list(params), "members": []})
        row["members"].append(module)
    out = []
    for row in rows.values():
        name = row["name"] if len(row["members"]) > 1 else row["members"][0]
        out.append({"name": name, "count": len(row["members"]), "params": row["params"]})
    return out


def _colors(rows: list[dict[str, Any]]) -> dict[str, str]:
    specs = sorted({spec for row in rows for _, spec in row["params"]})
    colors, index = {}, 0
    for spec in specs:
        if all(p == "R" for p in spec.strip("()").split(", ")):
            colors[spec] = _REPLICATED
        else:
            colors[spec] = _PALETTE[index % len(_PALETTE)]
            index += 1
    return colors


def _layer_graph_svg(rows: list[dict[str, Any]], colors: dict[str, str]) -> str:
    box_w, row_h, gap, left = 560, 22, 14, 20
    parts, y = [], 10
    for i, row in enumerate(rows):
        height = row_h * (1 + len(row["params"]))
        weight = next((spec for leaf, spec in row["params"] if leaf == "weight"), row["params"][0][1])
        parts.append(
            f'<g class="layer"><rect x="{left}" y="{y}" width="{box_w}" height="{height}" rx="6" '
            f'fill="{colors[weight]}" fill-opacity="0.25" stroke="{colors[weight]}" stroke-width="2"/>'
        )
        count = f"  x{row['count']}" if row["count"] > 1 else ""
        parts.append(
            f'<text class="layer-name" x="{left + 10}" y="{y + 16}" font-weight="bold">{_esc(row["name"])}{_esc(count)}</text>'
        )
        for j, (leaf, spec) in enumerate(row["params"]):
            ty = y + row_h * (j + 1) + 15
            parts.append(f'<rect x="{left + 20}" y="{ty - 10}" width="12" height="12" fill="{colors[spec]}"/>')
            parts.append(f'<text x="{left + 38}" y="{ty}">{_esc(leaf)}  {_esc(spec)}</text>')
        parts.append("</g>")
        y += height
        if i + 1 < len(rows):
            mid = left + box_w / 2
            parts.append(
                f'<line x1="{mid}" y1="{y + 1}" x2="{mid}" y2="{y + gap - 3}" stroke="#888" stroke-width="2" '
                f'marker-end="url(#arrow)"/>'
            )
            y += gap
    defs = (
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="2" refY="4" orient="auto" markerUnits="userSpaceOnUse">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#888"/></marker></defs>'
    )
    return (
        f'<svg id="layer-graph" xmlns="http://www.w3.org/2000/svg" width="{box_w + 2 * left}" '
        f'height="{y + 10}">{defs}{"".join(parts)}</svg>'
    )


def _per_axis(predicted: dict[str, Any], unit: str) -> dict[str, float]:
    """Per-axis numbers the cost model writes: a list or a dict under a key with the words
    ``axis`` (or ``axes``) and ``unit``, such as ``comm_s_per_axis``."""
    for key, value in sorted(predicted.items()):
        words = key.split("_")
        if not any(w.startswith("axis") or w == "axes" for w in words) or unit.strip("_") not in words:
            continue
        if isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
            return {f"axis {i}": float(v) for i, v in enumerate(value)}
        if isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            return {f"axis {k}": float(v) for k, v in value.items()}
    return {}


def time_breakdown(plan: Plan) -> list[tuple[str, float]]:
    """(label, seconds) parts of the predicted step: compute, communication, bubble."""
    pred = plan.predicted.to_json()
    parts = [("compute (incl. gradient sync)", float(pred.get("compute_s", 0.0)))]
    per_axis = _per_axis(pred, "_s")
    if per_axis:
        parts += [(f"communication {axis}", seconds) for axis, seconds in per_axis.items()]
    else:
        parts.append(("communication, all axes (resharding)", float(pred.get("reshard_s", 0.0))))
    parts.append(("pipeline bubble", float(pred.get("bubble_s", 0.0))))
    return parts


def _bar_svg(parts: list[tuple[str, float]], fmt, svg_id: str) -> str:
    total = sum(v for _, v in parts) or 1.0
    width, x, rects, legend = 640, 0.0, [], []
    for i, (label, value) in enumerate(parts):
        color = _PALETTE[i % len(_PALETTE)]
        w = width * value / total
        if w > 0:
            rects.append(
                f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="28" fill="{color}">'
                f"<title>{_esc(label)}: {_esc(fmt(value))}</title></rect>"
            )
        x += w
        legend.append(
            f'<tr><td><span class="swatch" style="background:{color}"></span>{_esc(label)}</td>'
            f"<td>{_esc(fmt(value))}</td><td>{100 * value / total:.1f}%</td></tr>"
        )
    svg = f'<svg id="{svg_id}" xmlns="http://www.w3.org/2000/svg" width="{width}" height="30">{"".join(rects)}</svg>'
    return svg + "<table>" + "".join(legend) + "</table>"


def _timeline_svg(timeline: dict[str, Any], capacity: int | None, note: str) -> str:
    """Stacked areas of bytes by kind over forward and backward, the peak marked with a line."""
    times, kinds, rows = timeline["times"], timeline["kinds"], timeline["bytes"]
    num_times = max(2 * int(timeline["num_forward"]) - 1, 1)
    totals = [sum(row) for row in rows]
    top = max(totals + [1.0])
    width, height, left, bottom = 720, 220, 70, 24
    plot_w, plot_h = width - left - 10, height - bottom - 16

    def x(time: float) -> float:
        return left + plot_w * time / num_times

    def y(num: float) -> float:
        return 16 + plot_h - plot_h * num / top

    parts, legend = [], []
    below = [0.0] * len(times)
    for k, kind in enumerate(kinds):
        above = [low + row[k] for low, row in zip(below, rows)]
        upper = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in zip(times, above))
        lower = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in reversed(list(zip(times, below))))
        color = _PALETTE[k % len(_PALETTE)]
        parts.append(
            f'<polygon class="memory-kind" data-kind="{_esc(kind)}" points="{upper} {lower}" '
            f'fill="{color}" fill-opacity="0.85" stroke="none"/>'
        )
        peak_row = rows[times.index(timeline["peak_time"])] if timeline["peak_time"] in times else None
        at_peak = f" ({_esc(_bytes(peak_row[k]))} at the peak)" if peak_row is not None else ""
        legend.append(
            f'<span style="margin-right:14px"><span class="swatch" style="background:{color}"></span>'
            f"{_esc(kind.replace('_', ' '))}{at_peak}</span>"
        )
        below = above
    peak_x, boundary_x = x(timeline["peak_time"]), x(int(timeline["num_forward"]) - 0.5)
    peak_total = max(totals) if totals else 0.0
    axes = (
        f'<line x1="{left}" y1="{16 + plot_h}" x2="{left + plot_w}" y2="{16 + plot_h}" stroke="#999"/>'
        f'<line x1="{left}" y1="16" x2="{left}" y2="{16 + plot_h}" stroke="#999"/>'
        f'<text x="{left - 4}" y="22" text-anchor="end">{_esc(_bytes(top))}</text>'
        f'<text x="{left - 4}" y="{16 + plot_h}" text-anchor="end">0</text>'
        f'<line x1="{boundary_x:.1f}" y1="16" x2="{boundary_x:.1f}" y2="{16 + plot_h}" stroke="#777" '
        f'stroke-dasharray="4 3"/>'
        f'<text x="{(left + boundary_x) / 2:.1f}" y="{height - 6}" text-anchor="middle">forward</text>'
        f'<text x="{(boundary_x + left + plot_w) / 2:.1f}" y="{height - 6}" text-anchor="middle">backward</text>'
    )
    peak = (
        f'<line id="memory-peak" x1="{peak_x:.1f}" y1="12" x2="{peak_x:.1f}" y2="{16 + plot_h}" '
        f'stroke="#d62728" stroke-width="2"/>'
        f'<text x="{min(peak_x + 4, width - 150):.1f}" y="12" fill="#d62728">peak {_esc(_bytes(peak_total))}</text>'
    )
    capacity_line = ""
    if capacity and capacity <= top:
        capacity_line = (
            f'<line x1="{left}" y1="{y(capacity):.1f}" x2="{left + plot_w}" y2="{y(capacity):.1f}" '
            f'stroke="#000" stroke-dasharray="2 2"/>'
        )
    return (
        f'<svg id="memory-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
        + "".join(parts)
        + axes
        + capacity_line
        + peak
        + "</svg>"
        + f"<div>{''.join(legend)}</div>"
        + f'<p class="note">bytes alive per device over the step by kind; peak {_esc(_bytes(peak_total))} '
        f"{_esc(timeline.get('peak_at', ''))}{note}</p>"
    )


def _stages_section(plan: Plan) -> str:
    """A pipelined plan's stages: time per microbatch and memory, one bar each."""
    stages = plan.pipeline
    if stages is None:
        return ""
    slowest = max((s.time_s for s in stages.stages), default=0.0) or 1.0
    fullest = max((s.memory_bytes for s in stages.stages), default=0.0) or 1.0
    rows = []
    for stage in stages.stages:
        time_bar = (
            f'<svg class="stage-bar" width="200" height="12"><rect width="{200 * stage.time_s / slowest:.1f}" '
            f'height="12" fill="{_PALETTE[0]}"/></svg>'
        )
        memory_bar = (
            f'<svg class="stage-bar" width="200" height="12"><rect width="{200 * stage.memory_bytes / fullest:.1f}" '
            f'height="12" fill="{_PALETTE[1]}"/></svg>'
        )
        rows.append(
            f"<tr><td>{stage.index}</td><td>[{stage.layers[0]}, {stage.layers[1]})</td>"
            f"<td>{_esc(','.join(str(r) for r in stage.ranks))}</td>"
            f"<td>{stage.time_s * 1e3:.4f} ms {time_bar}</td><td>{_esc(_bytes(stage.memory_bytes))} {memory_bar}</td></tr>"
        )
    return (
        f'<h2>Pipeline stages</h2><p class="facts">{stages.num_stages} stages x {stages.num_microbatches} '
        f"microbatches, schedule {_esc(stages.schedule)}, bubble {stages.bubble_fraction:.1%}</p>"
        '<table id="pipeline-stages"><tr><th>stage</th><th>layers</th><th>ranks</th>'
        "<th>time per microbatch</th><th>memory</th></tr>" + "".join(rows) + "</table>"
    )


def _memory_section(plan: Plan, capacity: int | None) -> str:
    pred = plan.predicted.to_json()
    if plan.memory_timeline and plan.memory_timeline.get("times"):
        note = ""
        if plan.memory is not None:
            note = (
                f"; before checkpointing and offload, which bring the peak to {_bytes(float(pred.get('peak_memory_bytes', 0)))}"
            )
        elif plan.pipeline is not None:
            note = "; one microbatch through the whole graph on the stage mesh (stages below)"
        return _timeline_svg(plan.memory_timeline, capacity, _esc(note))
    timeline = next((v for k, v in sorted(pred.items()) if "timeline" in k and isinstance(v, list) and v), None)
    if timeline is not None:
        values = [float(v[-1] if isinstance(v, (list, tuple)) else v) for v in timeline]
        peak = max(values) or 1.0
        width, height = 640, 160
        step = width / max(len(values) - 1, 1)
        points = " ".join(f"{i * step:.1f},{height - height * v / peak:.1f}" for i, v in enumerate(values))
        return (
            f'<svg id="memory-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">'
            f'<polyline points="{points}" fill="none" stroke="#4e79a7" stroke-width="2"/></svg>'
            f'<p class="note">bytes live per device over the step, peak {_esc(_bytes(peak))}</p>'
        )
    components = [
        (k[: -len("_bytes")].replace("_", " "), float(v))
        for k, v in sorted(pred.items())
        if k.endswith("_bytes")
        and k not in ("peak_memory_bytes", "comm_bytes")
        and "axis" not in k
        and isinstance(v, (int, float))
    ]
    peak = float(pred.get("peak_memory_bytes", 0))
    if components:
        return (
            _bar_svg(components, _bytes, "memory-components")
            + f'<p class="note">no memory timeline in this plan: components shown; peak {_esc(_bytes(peak))}</p>'
        )
    parts = [("peak per device", peak)]
    if capacity and capacity > peak:
        parts.append(("free on the device", capacity - peak))
    return (
        _bar_svg(parts, _bytes, "memory-components")
        + '<p class="note">this plan records only the peak (no timeline or components yet)'
        + (f"; device memory {_esc(_bytes(capacity))}" if capacity else "")
        + "</p>"
    )


def _comm_bytes_table(predicted: dict[str, Any]) -> str:
    per_axis = _per_axis(predicted, "_bytes")
    if not per_axis:
        return ""
    rows = "".join(f"<tr><td>{_esc(axis)}</td><td>{_esc(_bytes(value))}</td></tr>" for axis, value in per_axis.items())
    return f"<table><tr><th>mesh axis</th><th>bytes sent per device per step</th></tr>{rows}</table>"


def render_html(plan: Plan, title: str = "", device_memory_bytes: int | None = None) -> str:
    """The report page. ``device_memory_bytes`` (the cluster's, where the caller knows it) shows
    the free memory beside the peak."""
    pred = plan.predicted.to_json()
    rows = layer_rows(plan)
    colors = _colors(rows)
    legend = "".join(
        f'<span style="margin-right:14px"><span class="swatch" style="background:{c}"></span>{_esc(spec)}</span>'
        for spec, c in colors.items()
    )
    collectives = "".join(
        f"<tr><td>{_esc(kind)}</td><td>{axis}</td><td>{count}</td></tr>"
        for (kind, axis), count in plan.collective_counts().items()
    )
    solver = "".join(
        f"<tr><td>{_esc(k)}</td><td>{_esc(v)}</td></tr>" for k, v in plan.solver.to_json().items() if k != "fallbacks"
    )
    fallbacks = ", ".join(plan.solver.fallbacks) or "none"
    heading = title or f"autopar plan {plan.hash}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(heading)}</title><style>{_CSS}</style></head>
<body>
<h1>{_esc(heading)}</h1>
<div class="facts">mesh {_esc(tuple(plan.mesh_shape))} &middot; cluster {_esc(plan.cluster or "-")} &middot;
graph {_esc(plan.graph_hash)} &middot; plan {_esc(plan.hash)} &middot; torch {_esc(plan.torch_version)}<br>
predicted step time <b>{float(pred.get("step_time_s", 0)) * 1e3:.4f} ms</b> &middot;
peak memory per device <b>{_esc(_bytes(float(pred.get("peak_memory_bytes", 0))))}</b> &middot;
communication per device per step {_esc(_bytes(float(pred.get("comm_bytes", 0))))}</div>
<h2>Layer graph, colored by sharding</h2>
<div>{legend}</div>
{_layer_graph_svg(rows, colors) if rows else '<p class="note">this plan has no parameters</p>'}
<h2>Step time</h2>
{_bar_svg(time_breakdown(plan), lambda s: f"{s * 1e3:.4f} ms", "time-breakdown")}
{_comm_bytes_table(pred)}
<h2>Memory per device</h2>
{_memory_section(plan, device_memory_bytes)}
{_stages_section(plan)}
<h2>Collectives in forward</h2>
<table><tr><th>kind</th><th>mesh axis</th><th>count</th></tr>{collectives or '<tr><td colspan="3">none</td></tr>'}</table>
<h2>Solver</h2>
<table>{solver}<tr><td>fallbacks (replicated, no rule)</td><td>{_esc(fallbacks)}</td></tr></table>
<script>{_SCRIPT}</script>
</body></html>
"""


def write_html(plan: Plan, path: str, title: str = "", device_memory_bytes: int | None = None) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(render_html(plan, title, device_memory_bytes))


__all__ = ["render_html", "write_html", "layer_rows", "time_breakdown"]
