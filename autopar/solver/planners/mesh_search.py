"""Mesh search: plan one traced model on every mesh shape of N devices and keep the fastest.

The candidates are the ordered factorizations of N into one to three axes, every size at least
2 (``(N,)`` for one axis). Order matters: ranks are laid out row-major, so the innermost axis is
the one that stays inside a node (``ClusterSpec.axis_link``); ``(8, 4)`` and ``(4, 8)`` put
different groups on NVLink. Enumerating orders is therefore the same as enumerating the
assignments of axes to link levels. Each candidate is planned from the same trace; a mesh on
which no plan fits the memory budget is kept in the table as infeasible.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from autopar.cost.cluster import ClusterSpec
from autopar.errors import InfeasibleError, MeshError
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

MAX_AXES = 3


def mesh_candidates(num_devices: int, max_axes: int = MAX_AXES) -> list[tuple[int, ...]]:
    """Ordered factorizations of ``num_devices`` into 1..max_axes sizes, each at least 2."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise MeshError(f"devices must be a positive integer, got {num_devices!r}")
    if not 1 <= max_axes <= MAX_AXES:
        raise MeshError(f"max_axes must be between 1 and {MAX_AXES}, got {max_axes!r}")
    if num_devices == 1:
        return [(1,)]
    found: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], rest: int) -> None:
        if rest == 1:
            found.append(prefix)
            return
        if len(prefix) == max_axes:
            return
        for size in range(2, rest + 1):
            if rest % size == 0:
                extend(prefix + (size,), rest // size)

    extend((), num_devices)
    return sorted(found, key=lambda shape: (len(shape), shape))


def search_mesh(
    traced: TracedModel,
    num_devices: int,
    cluster: ClusterSpec,
    options: PlanOptions,
    plan_one: Callable[[TracedModel, tuple[int, ...], ClusterSpec, PlanOptions], tuple[Plan, Callable[[Plan], Plan]]],
    *,
    on_progress: Callable[[str], None] | None = None,
) -> Plan:
    """The fastest plan over ``mesh_candidates(num_devices)``; its ``stats["mesh_search"]`` holds
    the table of every candidate (``mesh``, ``status``, ``step_time_s``, ``peak_memory_bytes``,
    ``plan_time_s``, ``reason``), fastest first, infeasible ones last. ``plan_one`` plans one mesh
    (``solver.planners.traced.plan_traced_unexplained``): (its plan without decisions, the function that
    explains them), which runs for the chosen plan alone; ``options.max_axes`` bounds the meshes' axes."""
    rows: list[dict[str, Any]] = []
    best: Plan | None = None
    explain_best: Callable[[Plan], Plan] | None = None
    best_row: dict[str, Any] = {}
    candidates = mesh_candidates(num_devices, options.max_axes)
    for number, shape in enumerate(candidates, 1):
        if on_progress:
            so_far = (
                f"; best so far {tuple(best_row['mesh'])} at {best_row['step_time_s'] * 1e3:.1f} ms" if best is not None else ""
            )
            on_progress(
                f"mesh search {number}/{len(candidates)}: planning on mesh {shape} "
                f"({len(candidates) - number} after it{so_far}) ..."
            )
        # What the last mesh left behind (its choice graph and ILP) went when its plan was
        # dropped: planning makes no reference cycles (tests/solver/test_mesh_search.py), so
        # memory stays flat from mesh to mesh without a full collection (0.3 s each on LLaMA-3-8B).
        start = time.perf_counter()
        try:
            plan, explained = plan_one(traced, shape, cluster, options)
        except InfeasibleError as error:
            reason = str(error).splitlines()[0]
            rows.append(
                {
                    "mesh": list(shape),
                    "status": "infeasible",
                    "step_time_s": None,
                    "peak_memory_bytes": None,
                    "plan_time_s": time.perf_counter() - start,
                    "reason": reason,
                }
            )
            continue
        rows.append(
            {
                "mesh": list(shape),
                "status": "ok",
                "step_time_s": plan.predicted.step_time_s,
                "peak_memory_bytes": plan.predicted.peak_memory_bytes,
                "plan_time_s": time.perf_counter() - start,
                "reason": "",
            }
        )
        if best is None or _rank(rows[-1]) < _rank(best_row):
            best, best_row, explain_best = plan, rows[-1], explained
        del plan, explained  # a plan not kept lets its choice graph go at the next collection
    rows.sort(key=_rank)
    if best is None:
        raise InfeasibleError(
            f"no mesh of {num_devices} devices (tried {', '.join(str(tuple(r['mesh'])) for r in rows)}) "
            f"has a plan within memory_budget={options.memory.budget}: {rows[0]['reason']}"
        )
    log.info("autopar: mesh search chose %s of %d candidates", best.mesh_shape, len(rows))
    return dataclasses.replace(explain_best(best), stats={**best.stats, "mesh_search": rows})


def _rank(row: dict[str, Any]) -> tuple:
    """Fastest first; among equals, fewer axes, then the smaller shape; infeasible last."""
    return (row["status"] != "ok", row["step_time_s"] or 0.0, len(row["mesh"]), row["mesh"])


def mesh_search_text(rows: list[dict[str, Any]]) -> str:
    """The search table, one line per mesh, fastest first."""
    lines = [
        f"Mesh search ({len(rows)} meshes)",
        f"  {'mesh':<16} {'step time':>14} {'vs best':>9} {'peak memory':>12} {'plan time':>10}  status",
    ]
    best = next((row["step_time_s"] for row in rows if row["status"] == "ok"), None)
    for row in rows:
        mesh = "x".join(str(n) for n in row["mesh"])
        if row["status"] == "ok":
            ratio = row["step_time_s"] / best if best else float("nan")
            memory = row["peak_memory_bytes"] or 0
            lines.append(
                f"  {mesh:<16} {row['step_time_s'] * 1e3:>11.4f} ms {ratio:>8.2f}x "
                f"{memory / 2**30:>8.2f} GiB {row['plan_time_s']:>8.1f} s  ok" + ("  <- chosen" if row is rows[0] else "")
            )
        else:
            lines.append(
                f"  {mesh:<16} {'-':>14} {'-':>9} {'-':>12} {row['plan_time_s']:>8.1f} s  {row['status']}: {row['reason']}"
            )
    return "\n".join(lines)


__all__ = ["mesh_candidates", "search_mesh", "mesh_search_text", "MAX_AXES"]
