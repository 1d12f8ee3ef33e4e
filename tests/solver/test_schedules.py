"""Pipeline schedules as the planner prices them (``autopar.solver.pricing.schedules``), checked against
torch.distributed.pipelining's own action lists, in one process."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.pipeline import first_microbatch
from autopar.solver.planners.stages import StageSettings, plan_stages
from autopar.solver.pricing import schedules
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch

TORCH_NAMES = {"1F1B": "1F1B", "Interleaved1F1B": "Interleaved1F1B", "ZBV": "ZBVZeroBubble"}


def _torch_peaks(schedule: str, groups: int, microbatches: int, virtual: int) -> tuple[list[int], bool]:
    """Per rank: the most chunk-microbatches whose forward ran and whose backward (the weight
    gradient, under zero bubble) has not, in torch's action list; and whether every action runs
    on the rank ``schedules.group_of`` puts its stage on."""
    ops = get_schedule_ops(TORCH_NAMES[schedule], groups, microbatches, virtual if virtual > 1 else None)
    peaks, placed = [], True
    for rank, actions in enumerate(ops):
        live = peak = 0
        for action in filter(None, actions):
            kind = action.computation_type.name
            placed &= schedules.group_of(schedule, groups, action.stage_index) == rank
            live += {"FORWARD": 1, "FULL_BACKWARD": -1, "BACKWARD_WEIGHT": -1}.get(kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks, placed


@pytest.mark.parametrize("schedule, virtual", [("1F1B", 1), ("Interleaved1F1B", 2), ("Interleaved1F1B", 4), ("ZBV", 2)])
@pytest.mark.parametrize("groups, microbatches", [(4, 8), (4, 16), (2, 8), (4, 4)])
def test_in_flight_and_placement_match_torchs_action_lists(schedule, virtual, groups, microbatches):
    peaks, placed = _torch_peaks(schedule, groups, microbatches, virtual)
    assert placed, f"{schedule}: a stage runs on another rank than group_of says"
    priced = [schedules.in_flight(schedule, groups, virtual, microbatches, r) for r in range(groups)]
    if schedule == "ZBV" and microbatches < 2 * groups:
        # Fewer microbatches than ZB-V's warm-up: the price is an upper bound.
        assert all(p >= t for p, t in zip(priced, peaks)), (priced, peaks)
    else:
        assert priced == peaks, f"{schedule} x{virtual}, S={groups}, M={microbatches}: priced {priced}, torch {peaks}"


def test_step_formulas():
    times, forwards, syncs = [3.0] * 8, [1.0] * 8, [0.0] * 8
    # 8 chunks on 4 groups, 8 microbatches: 1F1B on 4 stages of twice the work is (M + S - 1) * 6;
    # interleaving halves the bubble; zero bubble removes it when f = b = w.
    assert schedules.step_time("1F1B", 4, 8, [6.0] * 4, [2.0] * 4, [0.0] * 4) == pytest.approx((8 + 3) * 6)
    assert schedules.step_time("Interleaved1F1B", 4, 8, times, forwards, syncs) == pytest.approx(8 * 6 + 3 * 3)
    assert schedules.step_time("ZBV", 4, 8, times, forwards, syncs) == pytest.approx(8 * 6)
    assert schedules.virtual_counts("Interleaved1F1B", 4, 9, 16) == [], "torch needs M a multiple of its rounds"
    assert schedules.virtual_counts("ZBV", 4, 8, 6) == [], "ZB-V needs two layers per group"


def test_syncs_hide_behind_the_backward_that_follows_their_chunk():
    # 2 groups of 3 chunks (t = 3, f = 1: 2 s of backward each). The last microbatch's backward
    # runs the chunks 5, 4, ..., 0 one after another, so chunk j's last backward ends 2j s before
    # the step's compute does: group 0's syncs start 8, 4 and 0 s before it (chunks 4, 2, 0),
    # group 1's 10, 6 and 2 s before (the drain through group 0's chunk 0 hides group 1's last).
    times, forwards = [3.0] * 6, [1.0] * 6
    assert schedules.exposed_syncs("Interleaved1F1B", 2, times, forwards, [1.0] * 6) == [1.0, 0.0]
    # 3 s each: group 0's chunk 4 ends at -5, chunk 2's at -1, chunk 0's at 3 (it waits for the link)
    assert schedules.exposed_syncs("Interleaved1F1B", 2, times, forwards, [3.0] * 6) == [3.0, 1.0]
    assert schedules.exposed_syncs("Interleaved1F1B", 2, times, forwards, [0.0, 0, 0, 0, 5.0, 0]) == [0.0, 0.0]
    # a chunk whose forward prices above its time hides nothing, and shows no more than its sync
    assert schedules.exposed_syncs("Interleaved1F1B", 1, [1.0, 3.0], [2.0, 1.0], [1.0, 0.0]) == [1.0]
    # 1F1B: stage r's syncs hide behind the drain through stages r - 1, ..., 0 (2 s each)
    assert schedules.exposed_syncs("1F1B", 3, [3.0] * 3, [1.0] * 3, [1.0, 2.0, 3.0]) == [1.0, 0.0, 0.0]
    assert schedules.exposed_syncs("1F1B", 3, [3.0] * 3, [1.0] * 3, [1.0, 5.0, 6.0]) == [1.0, 3.0, 2.0]
    # ZBV's stages sync in their graphs: the whole sync
    assert schedules.exposed_syncs("ZBV", 2, [3.0] * 4, [1.0] * 4, [1.0] * 4) == [2.0, 2.0]
    body = 8 * 9 + 1 * 3
    assert schedules.step_time("Interleaved1F1B", 2, 8, times, forwards, [3.0] * 6) == pytest.approx(body + 3.0)


def test_syncs_start_in_their_chunks_last_backward_but_the_last_bucket():
    # one stage, 4 s of backward, 3 s of syncs of which all but the last bucket (0.5 s) may run
    # during it: 0.5 s exposed
    assert schedules.exposed_syncs("1F1B", 1, [5.0], [1.0], [3.0], early=[2.5]) == [0.5]
    # no more than the backward runs early (3 s of it here), nor more than the sync
    assert schedules.exposed_syncs("1F1B", 1, [4.0], [1.0], [5.0], early=[4.5]) == [2.0]
    assert schedules.exposed_syncs("1F1B", 1, [4.0], [1.0], [1.0], early=[4.0]) == [0.0]
    # under Interleaved1F1B a chunk's early part starts before its last backward ends: group 0's
    # chunk 2 (early 2 s) starts at -6 and ends at -3, chunk 0's starts at 0: 3 s exposed; with 2 s
    # of chunk 0's early too, it starts at -2: 1 s
    times, forwards = [3.0] * 4, [1.0] * 4
    assert schedules.exposed_syncs("Interleaved1F1B", 2, times, forwards, [3.0, 0, 3.0, 0], early=[0.0, 0, 2.0, 0])[0] == 3.0
    assert schedules.exposed_syncs("Interleaved1F1B", 2, times, forwards, [3.0, 0, 3.0, 0], early=[2.0, 0, 2.0, 0])[0] == 1.0


@pytest.fixture(scope="module")
def deep_plan() -> autopar.Plan:
    """A 16-layer GPT on 4 stages with every schedule allowed and a slow network: per-microbatch
    work is large against the bubble, so interleaving pays for its extra sends."""
    model = build_model("gpt", n_layer=16, n_embd=256, n_head=4, block_size=64, vocab_size=512, bias=False)
    inputs, _ = first_microbatch(example_batch("gpt", 32), None, 8)
    traced = trace(model, inputs)
    return plan_stages(
        traced,
        (4,),
        get_cluster("h100-80g"),
        StageSettings(num_stages=4, num_microbatches=8, schedules_allowed=schedules.ALL_SCHEDULES),
    )


def test_the_planner_chooses_a_multi_stage_schedule_and_says_why(deep_plan):
    plan = deep_plan
    pipeline = plan.pipeline
    rows = plan.stats["stage_search"]
    priced = {(r["schedule"], r["virtual_stages"]): r["step_time_s"] for r in rows if r["status"] == "ok"}
    assert {"1F1B", "Interleaved1F1B", "ZBV"} <= {schedule for schedule, _ in priced}
    # the rows price whole steps, the optimizer's after the flush included, as the plan's prediction
    assert plan.predicted.step_time_s == pytest.approx(min(priced.values()))
    assert pipeline.step_time_s == pytest.approx(plan.predicted.step_time_s - plan.predicted.optimizer_s)
    assert pipeline.schedule in ("Interleaved1F1B", "ZBV") and pipeline.virtual_stages >= 2
    assert plan.predicted.step_time_s < priced[("1F1B", 1)], "the chosen schedule beats 1F1B"
    assert pipeline.num_stages == 4 and pipeline.num_model_stages == 4 * pipeline.virtual_stages
    for j, stage in enumerate(pipeline.stages):
        assert stage.ranks == (schedules.group_of(pipeline.schedule, 4, j),)
    assert pipeline.reason.startswith(pipeline.schedule) and "beats 1F1B" in pipeline.reason
    text = plan.summary()
    assert f"{pipeline.virtual_stages} virtual stages per rank group" in text and "why:" in text
    assert autopar.Plan.from_json(plan.to_json()) == plan


def test_one_stage_schedules_stay_the_default():
    model = build_model("gpt", n_layer=4)
    plan = autopar.plan(model, (2,), example_inputs=example_batch("gpt", 8), cluster="h100-80g", pipeline=2, num_microbatches=4)
    assert plan.pipeline.schedule == "1F1B" and plan.pipeline.virtual_stages == 1


def test_autopar_plan_takes_the_schedules_to_choose_among():
    model = build_model("gpt", n_layer=16, n_embd=256, n_head=4, block_size=64, vocab_size=512, bias=False)
    kwargs = dict(example_inputs=example_batch("gpt", 32), cluster="h100-80g", pipeline=4, num_microbatches=8)
    plan = autopar.plan(model, (4,), pipeline_schedules="auto", **kwargs)
    assert plan.pipeline.schedule in ("Interleaved1F1B", "ZBV") and plan.pipeline.reason
    only = autopar.plan(model, (4,), pipeline_schedules=("Interleaved1F1B",), **kwargs)
    assert only.pipeline.schedule == "Interleaved1F1B"
    with pytest.raises(ValueError, match=r"pipeline_schedules must be 'auto' or some of"):
        autopar.plan(model, (4,), pipeline_schedules=("DualPipeV",), **kwargs)


def test_the_planner_chooses_the_microbatch_count():
    model = build_model("gpt", n_layer=4, bias=False)
    plan = autopar.plan(
        model, (2,), example_inputs=example_batch("gpt", 16), cluster="h100-80g", pipeline=2, num_microbatches="auto"
    )
    tried = plan.pipeline.reason.split("microbatches tried ")[1].split(", ")
    steps = {int(t.split(":")[0]): float(t.split(": ")[1].removesuffix(" s")) for t in tried if "none" not in t}
    assert len(steps) >= 2 and plan.pipeline.num_microbatches == min(steps, key=steps.get), plan.pipeline.reason
    assert plan.predicted.step_time_s == pytest.approx(steps[plan.pipeline.num_microbatches], rel=1e-3)
