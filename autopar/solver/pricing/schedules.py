r"""What a pipeline schedule costs: its step, its bubble and the microbatches each rank group holds.

S rank groups, v model stages ("chunks") per group, M microbatches. t_j is chunk j's forward and
backward of one microbatch (recomputation and the point-to-point receives of its inputs and
their gradients included, so a schedule with more chunks pays more sends), f_j its forward part,
and T_r = Σ_{j on r} t_j a group's work per microbatch.

1F1B, GPipe (v = 1)
    step = Σ_j t_j + (M − 1) · max_j t_j        (the first microbatch passes every stage, the others
                                                 follow at the slowest stage's pace)
    in flight on stage i: 1F1B min(S − i, M), GPipe M microbatches.
Interleaved1F1B (v ≥ 2; chunk j on group j mod S; torch's ScheduleInterleaved1F1B)
    step = M · max_r T_r + (S − 1) · max_j t_j  (warm-up and drain take S − 1 chunk times: 1/v of
                                                 1F1B's bubble; Narayanan et al., SC'21)
    in flight on group r, in chunk-microbatches: min(M · v, (v − 1) · R + 2 (S − 1 − r) + 1), with
    R = M / max(1, ⌊M / S⌋) microbatches per round (torch's warm-up operations, plus one).
ZBV (v = 2; chunks r and 2S − 1 − r on group r; torch's ScheduleZBVZeroBubble)
    The backward splits into the input gradient b_j and the weight gradient w_j, and the weight
    gradients fill the bubble (Qi et al., ICLR'24, ZB-V):
    step = M · max_r T_r + (S − 1) · max_j max(f_j + b_j − 2 w_j, 0),  b_j = w_j = (t_j − f_j) / 2;
    in flight on every group: min(2M, 2S) chunk-microbatches (ZB-V's peak equals 1F1B's first stage).
    Not with recomputation, whose backward runs the forward again before it can split.

The gradient synchronisation is added once per step, its part exposed on the slowest group
(``exposed_syncs``). The step's last microbatch runs its backward through the chunks from the last
to the first, one after another, so chunk j's last backward ends Σ_{i<j} b_i before the step's
compute does (b_j = t_j − f_j): a group's syncs run while the chunks below it still compute (the
drain). A chunk's syncs start in its last backward as its gradients become final
(``runtime.held_sync``), in buckets: all but the last bucket may run during that backward
(``early``, at most the backward itself), and a group's syncs run one after another (idle time
between them not counted). Under ZBV, whose stages sync in their graphs, the whole sync is exposed.
Bubble: the share of the step a group sits idle, 1 − M · Σ_j t_j / (S · (step − exposed sync)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from autopar.ir.pipeline import MULTI_STAGE_SCHEDULES, PLANNED_SCHEDULES, group_of, schedule_for

ALL_SCHEDULES = PLANNED_SCHEDULES
MAX_VIRTUAL_STAGES = 8


def in_flight(schedule: str, num_groups: int, virtual: int, num_microbatches: int, group: int) -> int:
    """Chunk-microbatches whose activations group ``group`` holds at its peak (module docstring)."""
    S, v, M = num_groups, virtual, num_microbatches
    if schedule == "GPipe":
        return M
    if schedule == "1F1B":
        return min(S - group, M)
    if schedule == "ZBV":
        return min(2 * M, 2 * S)
    per_round = M // max(1, M // S)
    return min(M * v, (v - 1) * per_round + 2 * (S - 1 - group) + 1)


def virtual_counts(schedule: str, num_groups: int, num_microbatches: int, num_layers: int) -> list[int]:
    """The virtual stages per group that ``schedule`` can run here (torch's constraints)."""
    if schedule not in MULTI_STAGE_SCHEDULES:
        return [1]
    if num_groups < 2:
        return []
    if schedule == "ZBV":
        return [2] if 2 * num_groups <= num_layers else []
    rounds = max(1, num_microbatches // num_groups)
    if num_microbatches % rounds:
        return []
    return [v for v in range(2, MAX_VIRTUAL_STAGES + 1) if v * num_groups <= num_layers]


def step_time(
    schedule: str,
    num_groups: int,
    num_microbatches: int,
    times: Sequence[float],
    forwards: Sequence[float],
    syncs: Sequence[float],
    early: Sequence[float] | None = None,
) -> float:
    """Seconds of one step (module docstring); per chunk ``times``, ``forwards``, ``syncs`` and
    ``early`` (the seconds of its syncs that may run during its own last backward; none if None)."""
    S, M = num_groups, num_microbatches
    per_group = [0.0] * S
    for j, t in enumerate(times):
        per_group[group_of(schedule, S, j)] += t
    if schedule in ("1F1B", "GPipe"):
        body = sum(times) + (M - 1) * max(times)
    elif schedule == "Interleaved1F1B":
        body = M * max(per_group) + (S - 1) * max(times)
    else:
        idle = max(max(f + (t - f) / 2 - (t - f), 0.0) for t, f in zip(times, forwards))
        body = M * max(per_group) + (S - 1) * idle
    return body + max(exposed_syncs(schedule, S, times, forwards, syncs, early))


def exposed_syncs(
    schedule: str,
    num_groups: int,
    times: Sequence[float],
    forwards: Sequence[float],
    syncs: Sequence[float],
    early: Sequence[float] | None = None,
) -> list[float]:
    """Per group, the seconds its gradient syncs run past the step's last computation (module
    docstring); ``early`` as ``step_time``'s."""
    if schedule == "ZBV":
        return [sum(sy for j, sy in enumerate(syncs) if group_of(schedule, num_groups, j) == r) for r in range(num_groups)]
    # a chunk's backward (its time less its forward: none below zero, where a stage's time leaves
    # out a forward its own cost counts), and when its last one ends, from the step's compute end
    backward = [max(t - f, 0.0) for t, f in zip(times, forwards)]
    ends = [-done for done in itertools.accumulate(backward[:-1], initial=0.0)]
    early = [0.0] * len(times) if early is None else early
    links = [-math.inf] * num_groups  # per group, when its syncs started so far end
    for j in reversed(range(len(times))):  # each group's chunks, the earliest ending first
        r = group_of(schedule, num_groups, j)
        links[r] = max(links[r], ends[j] - min(max(early[j], 0.0), backward[j], syncs[j])) + syncs[j]
    return [max(link, 0.0) for link in links]


def bubble(num_groups: int, num_microbatches: int, times: Sequence[float], step_without_sync: float) -> float:
    if step_without_sync <= 0:
        return 0.0
    return max(0.0, 1.0 - num_microbatches * sum(times) / (num_groups * step_without_sync))


__all__ = ["ALL_SCHEDULES", "group_of", "in_flight", "virtual_counts", "step_time", "exposed_syncs", "bubble", "schedule_for"]
