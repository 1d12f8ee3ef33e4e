"""``autopar explain plan.json`` for a pipelined plan: its schedule, stages, microbatches, bubble, and why.

Reads what the plan file records (``plan.pipeline``, ``plan.predicted``, ``plan.memory``): the
stage planner's choice and its reason (``StagePlan.reason``: the step against the best of the
other schedules and stage counts it priced), so it needs neither the model nor a re-solve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autopar.ir.pipeline import bubble_fraction, group_of
from autopar.ir.summary import format_bytes

if TYPE_CHECKING:
    from autopar.ir.plan import Plan

_BUBBLE_TEXT = {
    "1F1B": "the first microbatch passes every stage before the last one starts, and the last drains alone: "
    "S - 1 stage times of warm-up and drain against M microbatches of work (more microbatches shrink it)",
    "GPipe": "as 1F1B's (every forward, then every backward), with all M microbatches in flight on every stage",
    "Interleaved1F1B": "warm-up and drain take S - 1 chunk times, 1/v of 1F1B's bubble, for v times the "
    "point-to-point sends (priced in each chunk's time)",
    "ZBV": "each backward splits into its input and weight gradients, and the weight gradients fill the warm-up "
    "and drain (zero-bubble V: two chunks per group, r and 2S - 1 - r)",
}


def _field(record: Any, name: str) -> Any:
    """``name`` of the plan's predictions or solver record: a dict, or (issue #31) a frozen record."""
    return record.get(name) if isinstance(record, dict) else getattr(record, name, None)


def explain_pipeline_json(plan: Plan) -> dict[str, Any]:
    """The pipeline's choice as a dict (``explain_pipeline_text`` prints it)."""
    stages = plan.pipeline
    assert stages is not None
    recompute = list(_field(plan.predicted, "recompute") or [False] * len(stages.stages))
    S, M = stages.num_stages, stages.num_microbatches
    out: dict[str, Any] = {
        "schedule": stages.schedule,
        "rank_groups": S,
        "virtual_stages": stages.virtual_stages,
        "model_stages": stages.num_model_stages,
        "num_microbatches": M,
        "stage_mesh": list(stages.stage_mesh),
        "step_time_s": stages.step_time_s,
        "bubble_fraction": stages.bubble_fraction,
        "bubble": _BUBBLE_TEXT.get(stages.schedule, ""),
        "reason": stages.reason,
        "predicted_step_s": _field(plan.predicted, "step_time_s"),  # with the optimizer step after the flush
        "optimizer_s": _field(plan.predicted, "optimizer_s"),
        "grad_sync_s": _field(plan.predicted, "grad_sync_s"),
        "exposed_grad_sync_s": _field(plan.predicted, "exposed_grad_sync_s"),
        "hold_gathered": stages.hold_gathered,
        "stages": [
            {
                "index": s.index,
                "group": group_of(stages.schedule, S, s.index),
                "layers": list(s.layers),
                "ranks": list(s.ranks),
                "time_s": s.time_s,
                "memory_bytes": s.memory_bytes,
                "recompute": bool(recompute[s.index]) if s.index < len(recompute) else False,
            }
            for s in stages.stages
        ],
        "checkpoint_segments": [seg.name for seg in plan.memory.checkpoint] if plan.memory is not None else [],
        "memory_budget_bytes": _field(plan.solver, "memory_budget_bytes"),
    }
    if stages.schedule in ("1F1B", "GPipe"):  # doubling the microbatches: a share, the same for halved times
        out["bubble_with_twice_the_microbatches"] = bubble_fraction([s.time_s for s in stages.stages], 2 * M)
    return out


def explain_pipeline_text(plan: Plan) -> str:
    """Why this pipeline: schedule, groups and virtual stages, microbatches, bubble, stages, memory."""
    info = explain_pipeline_json(plan)
    v = info["virtual_stages"]
    lines = [
        f"explain pipeline  mesh={tuple(plan.mesh_shape)}  cluster={plan.cluster or '-'}  plan={plan.hash}",
        f"  schedule {info['schedule']}: {info['rank_groups']} rank groups (mesh axis 0 cut into {info['rank_groups']}), "
        f"each on stage mesh {tuple(info['stage_mesh'])}, running {v} model stage{'s' if v > 1 else ''} "
        f"({info['model_stages']} in all), {info['num_microbatches']} microbatches per step",
        _step_words(info) + f", bubble {info['bubble_fraction']:.1%}: {info['bubble']}",
    ]
    if info["hold_gathered"]:
        lines.append(
            "  the stages gather the parameters they shard once a step and hold them, with their summed gradients, "
            "through every microbatch (hold_gathered; reduce-scattered once, in the gradient sync)"
        )
    if "bubble_with_twice_the_microbatches" in info:
        lines.append(
            f"    with {2 * info['num_microbatches']} microbatches (each half as large, stage times halved) the "
            f"bubble would be {info['bubble_with_twice_the_microbatches']:.1%}"
        )
    lines.append("")
    lines.append(f"  {'stage':>5} {'group':>5}  {'layers':<9} {'ranks':<16} {'ms/microbatch':>13} {'memory':>11}  recompute")
    for s in info["stages"]:
        ranks = ",".join(str(r) for r in s["ranks"])
        layers = f"[{s['layers'][0]}, {s['layers'][1]})"
        lines.append(
            f"  {s['index']:>5} {s['group']:>5}  {layers:<9} {ranks:<16} "
            f"{s['time_s'] * 1e3:>13.4f} {format_bytes(s['memory_bytes']):>11}  {'yes' if s['recompute'] else 'no'}"
        )
    slowest = max(info["stages"], key=lambda s: s["time_s"])
    lines.append(
        f"  the slowest stage ({slowest['index']}, {slowest['time_s'] * 1e3:.4f} ms per microbatch) sets the "
        "steady-state pace; memory counts the microbatches each stage holds in flight under this schedule"
    )
    recomputing = [s["index"] for s in info["stages"] if s["recompute"]]
    if recomputing:
        budget = info["memory_budget_bytes"]
        lines.append(
            f"  stages {', '.join(map(str, recomputing))} recompute their activations in backward "
            f"(checkpointed: {', '.join(info['checkpoint_segments']) or '-'})"
            + (f" to fit the memory budget {format_bytes(budget)}" if budget else "")
        )
    if info["reason"]:
        lines += ["", f"  why: {info['reason']}"]
    return "\n".join(lines)


def _step_words(info: dict[str, Any]) -> str:
    """The step's line: the whole step, the schedule's part with its gradient sync, and the
    optimizer step every rank group runs after the flush (where the plan records them)."""
    schedule = f"{info['step_time_s'] * 1e3:.4f} ms" + _sync_words(info["grad_sync_s"], info["exposed_grad_sync_s"])
    whole, optimizer = info["predicted_step_s"], info["optimizer_s"]
    if whole is None or optimizer is None:
        return f"  predicted step {schedule}"
    return f"  predicted step {whole * 1e3:.4f} ms: the schedule's {schedule}, then the optimizer step's {optimizer * 1e3:.4f} ms"


def _sync_words(sync_s: float | None, exposed_s: float | None) -> str:
    """The gradient sync in the step's line: all of it, or the part the backward does not hide."""
    if sync_s is None:
        return ""
    if exposed_s is None or exposed_s >= sync_s * (1 - 1e-9):
        return f" (gradient sync {sync_s * 1e3:.4f} ms of it)"
    return f" (gradient sync {sync_s * 1e3:.4f} ms, {exposed_s * 1e3:.4f} ms of it after the last backward)"


__all__ = ["explain_pipeline_text", "explain_pipeline_json"]
