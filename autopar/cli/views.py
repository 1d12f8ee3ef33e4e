"""The command line's views of plans: the grouped summary of ``show``, the mesh-search table and
``diff``. Each returns text blocks and ``console.Table`` values; ``console.emit`` prints them."""

# autopar.ir imports torch: it is imported inside the functions, for start-up speed.
from __future__ import annotations

import functools
import itertools
import math
import re
from typing import Any

from autopar.cli.console import Table, table_rows
from autopar.errors import PlanError

_INDEX_RE = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")
# Operators listed by ``show`` without --all: the costliest ones.
TOP_OPERATORS = 15


def format_bytes(num: float) -> str:
    from autopar.ir.summary import format_bytes as fmt

    return fmt(num)


def format_seconds(seconds: float) -> str:
    """Human-scaled time: 850 us, 12.3 ms, 4.56 s."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds:.2f} s"


def format_value(key: str, value: Any) -> str:
    """A predicted value in its unit: bytes and seconds human-scaled, components one by one."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {format_value(key, v)}" for k, v in value.items()) or "-"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(key, v) for v in value) + "]"
    if value is None:
        return "-"
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key.endswith("_bytes") or key.endswith("bytes_per_axis"):
        return format_bytes(value)
    if key.endswith("_s"):
        return format_seconds(value)
    return f"{value:g}"


def spec_label(texts: list[str] | None) -> str:
    return "-" if texts is None else "(" + ", ".join(texts) + ")"


# -- show ---------------------------------------------------------------------------------


def param_groups(plan) -> list[dict[str, Any]]:
    """Parameters grouped by FQN with layer indices replaced by ``*`` and by placements.

    A group of one keeps its own FQN; a larger group is named by its pattern, such as
    ``transformer.h.*.attn.q_proj.weight``. Groups are in order of first appearance.
    """
    from autopar.ir.spec import format_spec

    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for fqn, spec in plan.params.items():
        groups.setdefault((_INDEX_RE.sub("*", fqn), tuple(format_spec(spec))), []).append(fqn)
    return [
        {"fqn": pattern if len(members) > 1 else members[0], "placements": list(placements), "count": len(members)}
        for (pattern, placements), members in groups.items()
    ]


def collective_counts(plan) -> list[dict[str, Any]]:
    """Forward collectives of the plan's redistributions: kind, mesh axis, count."""
    return [{"kind": kind, "axis": axis, "count": n} for (kind, axis), n in plan.collective_counts().items()]


def groups_table(plan) -> Table:
    rows = param_groups(plan)
    return Table(
        f"Parameter groups ({len(rows)} groups, {len(plan.params)} parameters)",
        ("parameter", "placements", "count"),
        table_rows([(r["fqn"], spec_label(r["placements"]), f"x{r['count']}") for r in rows]),
        right=frozenset({2}),
        header=False,
    )


def _operator_rows(plan) -> list[tuple[str, Any]]:
    from autopar.ir.spec import VIEW_OP_NAMES

    def is_view(op: str) -> bool:  # as the summary: plans name overloads, VIEW_OP_NAMES packets
        return op == "getitem" or op.rsplit(".", 1)[0].removeprefix("aten.") in VIEW_OP_NAMES

    return [
        (name, node) for name, node in plan.nodes.items() if node.source not in ("placeholder", "output") and not is_view(node.op)
    ]


def operators_table(plan, limit: int | None) -> Table:
    from autopar.ir.summary import node_row

    nodes = _operator_rows(plan)
    shown = nodes if limit is None else sorted(nodes, key=lambda item: -item[1].cost_s)[:limit]
    rows = []
    for name, node in shown:
        rows.append(node_row(name, node, plan.mesh_shape))
    title = (
        f"Operators ({len(nodes)}, views omitted)"
        if limit is None or len(nodes) <= limit
        else f"Operators: the {len(shown)} costliest of {len(nodes)} (views omitted; --all lists every one)"
    )
    return Table(title, ("node", "op", "output shape", "placements", "cost ms", "note"), table_rows(rows), right=frozenset({4}))


def params_table(plan) -> Table:
    from autopar.ir.spec import spec_text

    return Table(
        f"Parameters ({len(plan.params)})",
        ("parameter", "placements"),
        table_rows([(fqn, spec_text(spec)) for fqn, spec in plan.params.items()]),
        header=False,
    )


def collectives_block(plan) -> str | Table:
    counts = collective_counts(plan)
    if not counts:
        return "Collectives in forward: none"
    return Table(
        "Collectives in forward",
        ("kind", "mesh axis", "count"),
        table_rows([(r["kind"], r["axis"], r["count"]) for r in counts]),
        right=frozenset({1, 2}),
    )


def plan_blocks(plan, everything: bool = False) -> list[str | Table]:
    """``show``: the summary's header, the parameter groups, the collectives and fallbacks, then
    the costliest operators (``everything``: every parameter and operator)."""
    from autopar.ir.summary import fallback_lines, header_lines

    blocks: list[str | Table] = [
        "\n".join(header_lines(plan)),
        groups_table(plan),
        collectives_block(plan),
        "\n".join(fallback_lines(plan)),
    ]
    if everything:
        blocks.append(params_table(plan))
    blocks.append(operators_table(plan, None if everything else TOP_OPERATORS))
    return blocks


def show_json(plan) -> dict[str, Any]:
    out = {
        "mesh": list(plan.mesh_shape),
        "cluster": plan.cluster,
        "graph_hash": plan.graph_hash,
        "plan_hash": plan.hash,
        "predicted": plan.predicted.to_json(),
        "solver": plan.solver.to_json(),
        "params": param_groups(plan),
        "collectives": collective_counts(plan),
    }
    if plan.pipeline is not None:
        # The stages without their node lists, which the plan file has.
        data = plan.pipeline.to_json()
        data["stages"] = [{k: v for k, v in s.items() if k != "nodes"} | {"num_nodes": len(s["nodes"])} for s in data["stages"]]
        out["pipeline"] = data
    return out


def mesh_search_table(rows: list[dict[str, Any]]) -> Table:
    """The mesh search, one row per mesh, fastest first (``plan.stats["mesh_search"]``)."""
    best = next((row["step_time_s"] for row in rows if row["status"] == "ok"), None)
    cells = []
    for number, row in enumerate(rows):
        mesh = "x".join(str(n) for n in row["mesh"])
        if row["status"] == "ok":
            ratio = row["step_time_s"] / best if best else float("nan")
            cells.append(
                (
                    mesh,
                    format_seconds(row["step_time_s"]),
                    f"{ratio:.2f}x",
                    format_bytes(row["peak_memory_bytes"] or 0),
                    f"{row['plan_time_s']:.1f} s",
                    "ok  <- chosen" if number == 0 else "ok",
                )
            )
        else:
            cells.append((mesh, "-", "-", "-", f"{row['plan_time_s']:.1f} s", f"{row['status']}: {row['reason']}"))
    return Table(
        f"Mesh search ({len(rows)} meshes)",
        ("mesh", "step time", "vs best", "peak memory", "plan time", "status"),
        table_rows(cells),
        right=frozenset({1, 2, 3, 4}),
    )


# -- diff ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def _rank_pieces(spec: tuple[str, ...], mesh_shape: tuple[int, ...]) -> tuple | None:
    """What each rank holds, ranks in row-major order: per tensor dim (piece, pieces, blocks), and
    which partial sum of how many. None for a fully replicated spec, which means the same on any mesh."""
    if all(text == "R" or size == 1 for text, size in zip(spec, mesh_shape)):
        return None
    held = []
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        dims: dict[int, list[int]] = {}
        partial = [0, 1]
        for axis, (text, size) in enumerate(zip(spec, mesh_shape)):
            if size == 1 or text == "R":
                continue
            if text == "P":
                partial = [partial[0] * size + coordinate[axis], partial[1] * size]
                continue
            match = re.fullmatch(r"S\((\d+)\)(?:/(\d+))?", text)
            if match is None:
                raise PlanError(
                    f"unknown placement {text!r}: expected R, P, S(dim) or S(dim)/blocks; re-plan, or fix the plan file"
                )
            entry = dims.setdefault(int(match.group(1)), [0, 1, int(match.group(2) or 1)])
            entry[0], entry[1] = entry[0] * size + coordinate[axis], entry[1] * size
        held.append((tuple(sorted((dim, tuple(v)) for dim, v in dims.items())), tuple(partial)))
    return tuple(held)


def same_layout(a: list[str] | None, mesh_a: tuple[int, ...], b: list[str] | None, mesh_b: tuple[int, ...]) -> bool:
    """Whether spec ``a`` on ``mesh_a`` and ``b`` on ``mesh_b`` give every rank (row-major) the same
    piece: (R, R) on (2, 2) is (R) on (4,), and (S(0), S(0)) on (2, 2) is (S(0)) on (4,)."""
    if a is None or b is None:
        return a is b
    if list(a) == list(b) and tuple(mesh_a) == tuple(mesh_b):
        return True
    pieces_a, pieces_b = _rank_pieces(tuple(a), tuple(mesh_a)), _rank_pieces(tuple(b), tuple(mesh_b))
    if pieces_a is None or pieces_b is None:
        return pieces_a is pieces_b
    return math.prod(mesh_a) == math.prod(mesh_b) and pieces_a == pieces_b


_MAIN_PREDICTED = ("step_time_s", "peak_memory_bytes", "comm_bytes")


def plan_diff(a, b) -> dict[str, Any]:
    """What differs between plans ``a`` and ``b``; empty sections are left out. Specs that give
    every rank the same piece on the two meshes count as equal (``same_layout``)."""
    from autopar.ir.spec import format_spec

    diff: dict[str, Any] = {}
    if tuple(a.mesh_shape) != tuple(b.mesh_shape):
        diff["mesh"] = {"a": list(a.mesh_shape), "b": list(b.mesh_shape)}
    for key, va, vb in (
        ("graph_hash", a.graph_hash, b.graph_hash),
        ("cluster", a.cluster, b.cluster),
        ("torch_version", a.torch_version, b.torch_version),
        ("kept_layers", a.kept_layers, b.kept_layers),
    ):
        if va != vb:
            diff[key] = {"a": list(va) if isinstance(va, tuple) else va, "b": list(vb) if isinstance(vb, tuple) else vb}
    pred_a, pred_b = a.predicted.to_json(), b.predicted.to_json()
    keys = [k for k in _MAIN_PREDICTED if k in pred_a or k in pred_b]
    keys += sorted((set(pred_a) | set(pred_b)) - set(keys))
    predicted = {}
    for key in keys:
        va, vb = pred_a.get(key), pred_b.get(key)
        if va == vb:
            continue
        entry: dict[str, Any] = {"a": va, "b": vb}
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)):
            entry["rel_change"] = (vb - va) / va if va else None
        predicted[key] = entry
    if predicted:
        diff["predicted"] = predicted
    solver_a, solver_b = a.solver.to_json(), b.solver.to_json()
    solver = {
        k: {"a": solver_a.get(k), "b": solver_b.get(k)}
        for k in ("status", "memory_budget_bytes", "fallbacks")
        if solver_a.get(k) != solver_b.get(k)
    }
    if solver:
        diff["solver"] = solver
    mesh_a, mesh_b = tuple(a.spec_mesh), tuple(b.spec_mesh)
    params = []
    for fqn in list(a.params) + [f for f in b.params if f not in a.params]:
        sa = format_spec(a.params[fqn]) if fqn in a.params else None
        sb = format_spec(b.params[fqn]) if fqn in b.params else None
        if not same_layout(sa, mesh_a, sb, mesh_b):
            params.append({"fqn": fqn, "a": sa, "b": sb})
    if params:
        diff["params"] = params
    nodes = []
    for name, na in a.nodes.items():
        nb = b.nodes.get(name)
        if nb is None:
            continue
        outs_a, outs_b = [format_spec(s) for s in na.outs], [format_spec(s) for s in nb.outs]
        same = len(outs_a) == len(outs_b) and all(same_layout(x, mesh_a, y, mesh_b) for x, y in zip(outs_a, outs_b))
        if not same or na.op != nb.op:
            nodes.append({"name": name, "op": na.op if na.op == nb.op else f"{na.op} -> {nb.op}", "a": outs_a, "b": outs_b})
    if nodes:
        diff["nodes"] = nodes
    only_a = [n for n in a.nodes if n not in b.nodes]
    only_b = [n for n in b.nodes if n not in a.nodes]
    if only_a:
        diff["only_in_a"] = only_a
    if only_b:
        diff["only_in_b"] = only_b
    return diff


def diff_blocks(diff: dict[str, Any], path_a: str, path_b: str, a, b) -> list[str | Table]:
    head = [
        f"a: {path_a}  mesh={tuple(a.mesh_shape)}  cluster={a.cluster or '-'}  plan={a.hash}",
        f"b: {path_b}  mesh={tuple(b.mesh_shape)}  cluster={b.cluster or '-'}  plan={b.hash}",
    ]
    if not diff:
        return ["\n".join(head + ["plans are identical"])]
    if "mesh" in diff:
        head.append(
            f"mesh: {tuple(diff['mesh']['a'])} -> {tuple(diff['mesh']['b'])} (placements that give every "
            "rank the same piece on both meshes count as unchanged)"
        )
    for key, label in (("graph_hash", "graph hash"), ("cluster", "cluster"), ("torch_version", "torch")):
        if key in diff:
            head.append(f"{label}: {diff[key]['a']} -> {diff[key]['b']}")
    if "kept_layers" in diff:
        from autopar.ir.summary import kept_text

        a_kept, b_kept = (None if v is None else tuple(v) for v in (diff["kept_layers"]["a"], diff["kept_layers"]["b"]))
        head.append(f"gathered parameters kept from forward to backward: {kept_text(a_kept)} -> {kept_text(b_kept)}")
    for key, entry in diff.get("solver", {}).items():
        if key == "fallbacks":
            head.append(f"solver fallbacks: {len(entry['a'] or [])} -> {len(entry['b'] or [])} nodes")
        else:
            head.append(f"solver {key.replace('_', ' ')}: {format_value(key, entry['a'])} -> {format_value(key, entry['b'])}")
    blocks: list[str | Table] = ["\n".join(head)]
    if "predicted" in diff:
        rows = []
        for key, entry in diff["predicted"].items():
            rel = entry.get("rel_change")
            rows.append(
                (
                    key,
                    format_value(key, entry["a"]),
                    format_value(key, entry["b"]),
                    f"{rel * 100:+.1f}%" if rel is not None else "",
                )
            )
        blocks.append(Table("predicted", ("", "a", "b", "change"), table_rows(rows), right=frozenset({3})))
    if "params" in diff:
        rows = [(r["fqn"], spec_label(r["a"]), "->", spec_label(r["b"])) for r in diff["params"]]
        blocks.append(
            Table(
                f"Parameters with different placements ({len(rows)}):",
                ("parameter", "a", "", "b"),
                table_rows(rows),
                header=False,
            )
        )

    def outs_text(outs):
        return spec_label(outs[0]) if len(outs) == 1 else "[" + ", ".join(spec_label(s) for s in outs) + "]"

    if "nodes" in diff:
        rows = [(r["name"], r["op"], outs_text(r["a"]), "->", outs_text(r["b"])) for r in diff["nodes"]]
        blocks.append(
            Table(
                f"Nodes with different output placements ({len(rows)}):",
                ("node", "op", "a", "", "b"),
                table_rows(rows),
                header=False,
            )
        )
    for key, label in (("only_in_a", "a"), ("only_in_b", "b")):
        if key in diff:
            blocks.append(f"Nodes only in {label} ({len(diff[key])}): {', '.join(diff[key])}")
    return blocks
