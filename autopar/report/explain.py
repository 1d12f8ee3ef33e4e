"""``autopar explain``: why a plan chose a node's or a parameter's sharding.

Reads the plan's ``decisions`` section (written at solve time by ``autopar.solver.pricing.runner_ups``), so
it needs neither the model nor a re-solve.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

from autopar.errors import PlanError
from autopar.ir.spec import spec_text
from autopar.ir.summary import EXPERT_PARALLEL_TEXT, KERNEL_NAMES, format_bytes

if TYPE_CHECKING:
    from autopar.ir.plan import Plan

_BINDING_TEXT = {
    "cost": "cost: the chosen strategy is the cheapest way to take this decision given the rest of the plan",
    "memory_budget": "the memory budget: every cheaper strategy needs more memory per device, and the budget "
    "({budget}) does not leave room for it",
    "time_limit": "the solver's time limit: it stopped before proving this choice optimal, and a cheaper "
    "strategy exists; re-plan with a larger --time-limit",
    "coupled": "the coupling to other decisions (a cheaper strategy exists for this decision alone)",
}


def find_decision(plan: Plan, key: str) -> tuple[str | None, dict[str, Any] | None]:
    """(representative, decision record) for a node name or parameter FQN of ``plan``.

    The record is None for a node or parameter that had a single strategy (nothing to decide).
    Raises PlanError, with close matches, when ``key`` names nothing in the plan.
    """
    if key in plan.decisions:
        return key, plan.decisions[key]
    for rep, record in plan.decisions.items():
        if key in record["members"] or key in record.get("fqns", ()):
            return rep, record
    if key in plan.nodes or key in plan.params:
        return None, None
    names = list(plan.nodes) + list(plan.params)
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    hint = (
        f"; did you mean {', '.join(repr(c) for c in close)}?"
        if close
        else ("; pass a node name (autopar show --json lists parameters; the plan JSON lists nodes) or a parameter FQN")
    )
    raise PlanError(f"{key!r} is neither a node nor a parameter of this plan{hint}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4f} ms"


def _specs(specs: list[list[str]]) -> str:
    return ", ".join("(" + ", ".join(spec) + ")" for spec in specs) or "-"


def explain_json(plan: Plan, key: str) -> dict[str, Any]:
    rep, record = find_decision(plan, key)
    node = plan.nodes.get(key)
    out: dict[str, Any] = {
        "query": key,
        "decision": rep,
        "node": key if node is not None else None,
        "op": node.op if node is not None else None,
    }
    if record is None:
        out["note"] = "a single strategy: nothing to decide"
        return out
    return {**out, **record}


def explain_text(plan: Plan, key: str) -> str:
    rep, record = find_decision(plan, key)
    node = plan.nodes.get(key)
    title = f"{key} ({node.op})" if node is not None else f"parameter {key}"
    lines = [f"explain {title}  mesh={tuple(plan.mesh_shape)}  cluster={plan.cluster or '-'}  plan={plan.hash}"]
    if record is None:
        spec = plan.params.get(key) if node is None else (node.outs[0] if node.outs else None)
        placed = spec_text(spec) if spec is not None else "-"
        lines.append(f"  placement {placed}: this had a single strategy, so there was nothing to decide")
        return "\n".join(lines)
    members = record["members"]
    copies = len(members) - 1
    lines.append(
        f"  decision {rep}: {record['num_strategies']} strategies"
        + (
            f", {record['num_impossible']} of them impossible here (no resharding reaches them)"
            if record.get("num_impossible")
            else ""
        )
    )
    if copies:
        shown = ", ".join(members[:6]) + (f", ... ({len(members) - 6} more)" if len(members) > 6 else "")
        lines.append(f"  taken together by {len(members)} nodes (repeated layers, tied names, followers): {shown}")
        lines.append("  costs below are per training step, summed over all of them")
    candidates = record["candidates"]
    chosen = next(c for c in candidates if c.get("chosen"))
    lines.append("")
    lines.append(
        f"  chosen: out {_specs(chosen['out'])}   in {_specs(chosen['in'])}"
        + (f"   kernel {chosen['kernel']}" if chosen.get("kernel") else "")
    )
    if chosen.get("kernel") in KERNEL_NAMES:
        lines.append(f"    ({KERNEL_NAMES[chosen['kernel']]})")
    if chosen.get("kernel") in EXPERT_PARALLEL_TEXT:
        lines.append(
            f"  expert parallel: experts split by expert on axes {chosen.get('kernel_axes')}, "
            f"{EXPERT_PARALLEL_TEXT[chosen['kernel']]}"
        )
    fields = [
        ("compute", "compute_s"),
        ("gradient sync", "grad_sync_s"),
        ("resharding in", "reshard_in_s"),
        ("resharding out", "reshard_out_s"),
        ("total", "total_s"),
    ]
    if "kernel_comm_s" in chosen:  # the kernel's own collectives: K/V gathers, all-to-alls
        fields.insert(1, ("kernel comm", "kernel_comm_s"))
    for label, field in fields:
        lines.append(f"    {label:<15} {_ms(chosen[field]):>14}")
    lines.append(f"    {'memory':<15} {format_bytes(chosen['memory_bytes']):>14} per device")
    lines.append("")
    lines += _runner_ups(chosen, [c for c in candidates if not c.get("chosen")])
    budget = plan.solver.memory_budget_bytes
    reason = _BINDING_TEXT.get(record["binding"], record["binding"]).format(budget=format_bytes(budget) if budget else "none")
    lines.append("")
    lines.append(f"  decided by {reason}")
    return "\n".join(lines)


def _runner_ups(chosen: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    """The runner-ups' table: each one's terms, total and difference from ``chosen``."""
    if not others:
        return ["  runner-ups: none (every other strategy is impossible here)"]
    overlap = "overlap_s" in chosen  # (NCCL meshes: solver/problem/gather_overlap.py)
    lines = [
        f"  runner-ups (the {len(others)} cheapest of the other strategies):",
        f"    {'out':<22} {'compute':>11} {'grad sync':>11} {'reshard in':>11} {'reshard out':>11}"
        + (f" {'overlap':>11}" if overlap else "")
        + f" {'total':>11} {'vs chosen':>11} {'memory':>11}  kernel",
    ]
    for c in others:
        delta = c["total_s"] - chosen["total_s"]
        lines.append(
            f"    {_specs(c['out']):<22} {c['compute_s'] * 1e3:>11.4f} {c['grad_sync_s'] * 1e3:>11.4f}"
            f" {c['reshard_in_s'] * 1e3:>11.4f} {c['reshard_out_s'] * 1e3:>11.4f}"
            + (f" {c['overlap_s'] * 1e3:>+11.4f}" if overlap else "")
            + f" {c['total_s'] * 1e3:>11.4f} {delta * 1e3:>+11.4f} {format_bytes(c['memory_bytes']):>11}"
            + (f"  kernel {c['kernel']}" if c.get("kernel") else "")
        )
    lines.append("    (milliseconds; memory per device)")
    if overlap:
        lines.append(
            "    (overlap: how much more of the FSDP gathers and gradient reductions compute would leave"
            " exposed than under the chosen strategy; the columns before it price them whole)"
        )
    return lines


__all__ = ["find_decision", "explain_text", "explain_json"]
