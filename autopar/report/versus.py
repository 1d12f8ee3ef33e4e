"""A hand plan beside the solver's plan for the same model and mesh: by how much and why one is faster.

``versus(hand, solved)`` compares the predictions the two plans carry (step time, its compute
and resharding parts, bytes per device and per mesh axis, peak memory) and counts the
parameters placed differently; ``versus_text`` says it in a few lines. ``autopar plan
--colossal-config`` prints it under the Colossal-AI plan, and ``autopar diff`` under the list of
every placement that differs (the slower plan first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.ir.spec import format_spec
from autopar.ir.summary import format_bytes

if TYPE_CHECKING:  # typing only: report reads ir
    from autopar.ir.plan import Plan

# Each part of a plan's predicted step, with what it means when it is the larger.
_PARTS = (("compute_s", "compute (ops on smaller or fewer-copied shards)"), ("reshard_s", "resharding communication"))


def _part(predicted: dict[str, Any], key: str) -> Any:
    """A figure of the step; a pipelined plan keeps its compute, resharding and bytes per microbatch."""
    if key in predicted:
        return predicted[key]
    return predicted.get("one_microbatch_unpipelined", {}).get(key)


def _step(plan: Plan) -> float:
    return float(plan.predicted.step_time_s or 0.0)


def versus(hand: Plan, solved: Plan) -> dict[str, Any]:
    """The figures of the comparison (JSON-ready)."""
    pred_h, pred_s = hand.predicted.to_json(), solved.predicted.to_json()
    shared = {fqn for fqn in hand.params if fqn in solved.params}
    moved = sorted(fqn for fqn in shared if format_spec(hand.params[fqn]) != format_spec(solved.params[fqn]))
    out: dict[str, Any] = {
        "step_time_s": [_step(hand), _step(solved)],
        "speedup": _step(hand) / _step(solved) if _step(solved) else None,
        "params_placed_differently": len(moved),
        "examples": [{"fqn": f, "hand": format_spec(hand.params[f]), "solver": format_spec(solved.params[f])} for f in moved[:4]],
    }
    for key in ("compute_s", "reshard_s", "comm_bytes", "peak_memory_bytes", "comm_bytes_per_axis"):
        if _part(pred_h, key) is not None or _part(pred_s, key) is not None:
            out[key] = [_part(pred_h, key), _part(pred_s, key)]
    out["mesh"] = [list(hand.mesh_shape), list(solved.mesh_shape)]
    return out


def versus_text(hand: Plan, solved: Plan, hand_name: str = "the hand plan", solved_name: str = "the solver's plan") -> str:
    """A few lines: whether ``solved`` is faster than ``hand``, by how much, and the parts of the
    step that make it so."""
    figures = versus(hand, solved)
    t_hand, t_solved = figures["step_time_s"]
    lines = [
        f"{hand_name}: predicted step {t_hand * 1e3:.3f} ms; {solved_name} on mesh "
        f"{tuple(solved.mesh_shape)}: {t_solved * 1e3:.3f} ms"
    ]
    if not t_solved or t_hand <= t_solved * (1 + 1e-6):
        lines.append(f"{solved_name} is not faster: {hand_name} is as good under the autopar cost model")
        return "\n".join(lines)
    lines.append(f"{solved_name} is {t_hand / t_solved:.2f}x faster ({(t_hand - t_solved) * 1e3:.3f} ms less per step). Why:")
    for key, meaning in _PARTS:
        a, b = figures.get(key, (None, None))
        if a is not None and b is not None and abs(a - b) > 1e-12:
            lines.append(f"  {meaning}: {a * 1e3:.3f} -> {b * 1e3:.3f} ms ({_change(a, b)})")
    if "comm_bytes" in figures and None not in figures["comm_bytes"]:
        a, b = figures["comm_bytes"]
        lines.append(f"  bytes each device sends per step: {format_bytes(a)} -> {format_bytes(b)} ({_change(a, b)})")
    if (
        "comm_bytes_per_axis" in figures
        and None not in figures["comm_bytes_per_axis"]
        and list(hand.mesh_shape) == list(solved.mesh_shape)
    ):
        a, b = figures["comm_bytes_per_axis"]
        per_axis = ", ".join(f"axis {i}: {format_bytes(x)} -> {format_bytes(y)}" for i, (x, y) in enumerate(zip(a, b)))
        lines.append(f"    by mesh axis: {per_axis}")
    if "peak_memory_bytes" in figures and None not in figures["peak_memory_bytes"]:
        a, b = figures["peak_memory_bytes"]
        lines.append(f"  peak memory per device: {format_bytes(a)} -> {format_bytes(b)} ({_change(a, b)})")
    lines.append(
        f"  {figures['params_placed_differently']} parameters placed differently"
        + "".join(f"; {e['fqn']}: {e['hand']} -> {e['solver']}" for e in figures["examples"][:2])
    )
    return "\n".join(lines)


def _change(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:+.0f}%" if a else "new"


__all__ = ["versus", "versus_text"]
