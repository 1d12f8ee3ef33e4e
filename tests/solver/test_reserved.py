"""A plan's peak as the caching allocator reserves it (``autopar.solver.pricing.reserved``), and
the memory budget kept on a sound footing: a plan that fits on paper but whose allocator would
run out of the device is planned again under less."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.plan import Plan
from autopar.solver.pricing.reserved import allocator_budget, fsdp2_stream_of
from autopar.zoo.models import GPT


def test_fsdp2_streams_gradients_and_gather_buffers_apart():
    spans = [
        ("w", "param", 0, 9, 1.0),
        ("w", "grad", 6, 9, 1.0),  # reduce-scattered: a comm_buffer names its gathered node
        ("gathered:w", "gathered", 2, 2, 1.0),  # the all-gather's buffer, inside the gathered span
        ("gathered:w", "gathered", 1, 3, 1.0),
        ("gathered:w", "comm_buffer", 6, 7, 2.0),
        ("v", "grad", 5, 9, 1.0),  # all-reduced: the compute stream
        ("gathered:u", "gathered", 4, 4, 1.0),  # a one-time gather of its own: a use, not a buffer
    ]
    streams = [fsdp2_stream_of(spans)(span) for span in spans]
    assert streams == ["compute", "reduce_scatter", "all_gather", "compute", "compute", "compute", "compute"]


def test_gpu_plans_carry_the_allocator_peaks_and_cpu_plans_none(meta_gpt_and_batch, tmp_path):
    model, batch = meta_gpt_and_batch
    plan = autopar.hand_plan("fsdp", model, (2,), example_inputs=batch, cluster="h100-80g")
    peaks = plan.predicted.allocator_peak_bytes
    reserved = {"reserved", "reserved_expandable", "reserved_fsdp2_expandable"}
    assert set(peaks) == {"allocated"} | reserved
    # every tensor's block is rounded up
    assert peaks["allocated"] >= plan.predicted.peak_memory_bytes
    assert all(peaks[key] >= peaks["allocated"] for key in reserved)
    # FSDP2's gradients wait on the reduce-scatter stream, where the compute stream cannot reuse them
    assert peaks["reserved_fsdp2_expandable"] >= peaks["reserved_expandable"]
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").predicted.allocator_peak_bytes == peaks
    cpu = autopar.hand_plan("fsdp", model, (2,), example_inputs=batch, cluster="cpu")
    assert cpu.predicted.allocator_peak_bytes is None  # host memory: no caching allocator


def test_a_plan_the_allocator_cannot_hold_is_planned_again_under_less(meta_gpt_and_batch, caplog):
    model, batch = meta_gpt_and_batch
    free = autopar.plan(model, (2,), example_inputs=batch, cluster="h100-80g", memory_budget=float("inf"))
    # a device exactly the size of the plan's tensors: they fit on paper, its 20 MiB segments do not
    device = free.predicted.peak_memory_bytes
    cluster = dataclasses.replace(get_cluster("h100-80g"), memory_bytes=device)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        plan = autopar.plan(model, (2,), example_inputs=batch, cluster=cluster, memory_budget=device)
    assert "more than the device holds; planning again under" in caplog.text
    peaks = plan.predicted.allocator_peak_bytes
    assert "short" not in peaks and peaks["reserved"] <= device
    assert plan.predicted.peak_memory_bytes < free.predicted.peak_memory_bytes
    assert plan.memory is not None and plan.memory.checkpoint  # it checkpoints to leave the allocator room


def test_allocator_budget_lowers_the_budget_by_the_reserve_beyond_the_tensors():
    class _Predicted:
        allocator_peak_bytes = {"allocated": 10, "reserved": 30, "short": 7}

    class _Plan:
        predicted = _Predicted()

    assert allocator_budget(_Plan(), 100.0) == 80.0  # what it reserves beyond its tensors
    # in a later round, of the budget asked for, not again of the one lowered: at least what it lacks
    assert allocator_budget(_Plan(), 90.0, asked=100.0) == 80.0
    assert allocator_budget(_Plan(), 80.0, asked=100.0) == 73.0
    _Predicted.allocator_peak_bytes = {"allocated": 10, "reserved": 12, "short": 7}
    assert allocator_budget(_Plan(), 100.0) == 93.0  # at least what it lacks
    assert allocator_budget(_Plan(), None) is None  # no budget: nothing to keep
    _Predicted.allocator_peak_bytes = {"allocated": 10, "reserved": 30}
    assert allocator_budget(_Plan(), 100.0) is None


def test_a_plan_the_allocator_never_holds_is_an_error(meta_gpt_and_batch, monkeypatch):
    from autopar.errors import InfeasibleError
    from autopar.solver.planners import sharding

    model, batch = meta_gpt_and_batch
    monkeypatch.setattr(sharding, "allocator_budget", lambda plan, budget, asked=None: budget - 1.0)
    with pytest.raises(InfeasibleError, match="caching allocator would still run out"):
        autopar.plan(model, (2,), example_inputs=batch, cluster="h100-80g", memory_budget=10**9)


def _captured_allocator(monkeypatch) -> list[tuple]:
    """Record each simulation's (spans, bytes_of, num_times, peaks) as the planners call it."""
    from autopar.solver.planners import memory_plan, sharding
    from autopar.solver.pricing import reserved

    calls = []

    def spy(spans, bytes_of, num_times, cluster):
        spans = [tuple(span) for span in spans]
        peaks = reserved.allocator_peaks(spans, bytes_of, num_times, cluster)
        calls.append((spans, bytes_of, num_times, peaks))
        return peaks

    monkeypatch.setattr(sharding, "allocator_peaks", spy)
    monkeypatch.setattr(memory_plan, "allocator_peaks", spy)
    return calls


def _replayed_peak(spans, bytes_of, num_times) -> float:
    """The most bytes the replay's events hold at once, at the tensors' own sizes (no rounding)."""
    from autopar.cost.step_memory import step_events

    live: dict = {}
    now = peak = 0.0
    for event, key, size, _ in step_events(spans, bytes_of, num_times):
        if event == "malloc":
            live[key] = size
            now += size
            peak = max(peak, now)
        else:
            now -= live.pop(key)
    return peak


def _assert_allocated_is_the_walks_peak(plan, call) -> None:
    """The simulation's allocated peak is the walk's peak of tensors alive, AdamW's foreach
    temporary included, plus the allocator's rounding: the replay frees and allocates what the
    walk counts alive."""
    spans, bytes_of, num_times, peaks = call
    alive = plan.predicted.peak_memory_bytes
    assert _replayed_peak(spans, bytes_of, num_times) == pytest.approx(alive, rel=1e-9, abs=1)
    # rounding: every block up to a multiple of 512 bytes (these plans leave no cached block unsplit)
    assert alive <= peaks["allocated"] <= alive + 512 * len(spans)


def _temporary_share(spans, bytes_of, num_times) -> float:
    """The walk's foreach temporary per byte of the optimizer state that lives all step."""

    def total(kind, whole):
        return sum(f * bytes_of(n) for n, k, start, end, f in spans if k == kind and (end - start == num_times - 1) == whole)

    return total("optimizer_temporary", False) / total("optimizer_state", True)


@pytest.fixture(scope="module")
def wide_gpt_and_batch():
    with torch.device("meta"):  # tensors well above the allocator's 1 MiB granularity
        model = GPT(vocab_size=8192, block_size=512, n_layer=3, n_head=16, n_embd=1024, bias=False)
        idx = torch.zeros(8, 512, dtype=torch.long)
    return model, (idx, idx)


def test_allocated_is_the_walks_peak_on_a_two_axis_mesh(wide_gpt_and_batch, monkeypatch):
    model, batch = wide_gpt_and_batch
    calls = _captured_allocator(monkeypatch)
    plan = autopar.plan(model, (2, 4), example_inputs=batch, cluster="h100-80g", memory_budget=float("inf"))
    assert plan.memory is None and len(calls) == 1
    assert _temporary_share(*calls[-1][:3]) == pytest.approx(0.5)  # torch's foreach AdamW steps it
    _assert_allocated_is_the_walks_peak(plan, calls[-1])
    fsdp = autopar.hand_plan("fsdp", model, (2, 4), example_inputs=batch, cluster="h100-80g")
    _assert_allocated_is_the_walks_peak(fsdp, calls[-1])


@pytest.mark.parametrize(
    "tokens, share, memory",
    [
        ((8, 512), 0.5, {"checkpointing": True}),
        ((8, 512), 0.2, {"offload": "cpu"}),
        ((1, 64), 0.5, {"offload": "cpu"}),  # the optimizer step is the peak
    ],
)
def test_allocated_is_the_walks_peak_under_memory_decisions(wide_gpt_and_batch, monkeypatch, tokens, share, memory):
    model, _ = wide_gpt_and_batch
    batch = (torch.zeros(tokens, dtype=torch.long, device="meta"),) * 2
    free = autopar.plan(model, (2, 4), example_inputs=batch, cluster="h100-80g", memory_budget=float("inf"))
    calls = _captured_allocator(monkeypatch)
    budget = share * free.predicted.peak_memory_bytes
    plan = autopar.plan(model, (2, 4), example_inputs=batch, cluster="h100-80g", memory_budget=budget, **memory)
    assert plan.memory is not None
    # autopar.optim.AdamW steps what offloads, one parameter at a time: no foreach temporary
    assert (_temporary_share(*calls[-1][:3]) == 0.0) == bool(plan.memory.offload)
    _assert_allocated_is_the_walks_peak(plan, calls[-1])
