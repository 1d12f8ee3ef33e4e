"""``benchmarks/bench_calibration.py``'s memory columns: each row is compared with the figure its
run measured, tensors allocated or the caching allocator's reserve (issue 44). Small models only."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_calibration as calibration  # noqa: E402

GIB = 2**30


def _row(**changes) -> calibration.Row:
    base = calibration.Row(
        "small gpt", "test", "gpt:2:128:4", 2, 64, (1,), "plan", "h100-80g", 80 * GIB, measured_step_s=0.01, measured_peak_gib=0.5
    )
    return dataclasses.replace(base, **changes)


def test_an_allocated_row_is_compared_with_the_tensors_alive():
    out = calibration.evaluate(_row(), None)
    assert out["measured_memory"] == "allocated"
    assert out["predicted_peak_gib"] == out["predicted_allocated_gib"]
    assert out["predicted_reserved_gib"] >= out["predicted_allocated_gib"]
    assert out["memory_ratio"] == pytest.approx(out["predicted_allocated_gib"] / 0.5)
    assert set(calibration.COLUMNS) >= {"measured_memory", "predicted_allocated_gib", "predicted_reserved_gib"}


def test_a_published_fsdp_row_that_measured_the_reserve_is_compared_with_fsdp2s():
    row = _row(
        mesh=(2,), layout="fsdp", published=True, measured_step_s=None, measured_tokens_per_s=1e5,
        measured_memory="reserved", allocator="expandable",
    )  # fmt: skip
    out = calibration.evaluate(row, None)
    model = calibration.build_model(row.model, calibration.torch.bfloat16)
    plan = calibration.price(row, model, calibration.row_cluster(row, None), "fsdp")["plan"]
    expected = plan.predicted.allocator_peak_bytes["reserved_fsdp2_expandable"] / GIB
    assert out["measured_memory"] == "reserved (expandable)"
    assert out["predicted_peak_gib"] == out["predicted_reserved_gib"] == pytest.approx(expected)
    assert out["memory_ratio"] == pytest.approx(expected / 0.5)


def test_torchtitans_rows_say_they_measured_the_reserve_with_expandable_segments():
    titan = [row for row in calibration.ROWS if row.name.startswith("torchtitan")]
    assert titan and all((row.measured_memory, row.allocator) == ("reserved", "expandable") for row in titan)
    assert all(row.measured_memory == "allocated" for row in calibration.ROWS if not row.published)


def test_gpt_options_build_the_published_widths():
    # MPT 7b as llm-foundry's table counts it (NumParams 6,658,859,008): biases, fused qkv, tied
    # embedding, learned positions of the sequence length
    mpt = calibration.build_model("gpt:32:4096:32:vocab=50368:block=2048:bias:fused", calibration.torch.float32)
    assert sum(p.numel() for p in mpt.parameters()) == 6_658_859_008
    # an untied LM head adds vocab x width
    tied = calibration.build_model("gpt:2:64:4:vocab=100:block=16", calibration.torch.float32)
    untied = calibration.build_model("gpt:2:64:4:vocab=100:block=16:untied", calibration.torch.float32)
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 100 * 64
    with pytest.raises(ValueError, match="unknown GPT option"):
        calibration.build_model("gpt:2:64:4:rope", calibration.torch.float32)


def test_megatron_tokens_per_s_inverts_megatrons_flop_count():
    # 1.7B of Megatron-LM's H100 table (408.8 TFLOP/s per GPU, 41% of 989: its MFU column)
    tokens = calibration.megatron_tokens_per_s(408.8, 24, 2048, 4096, 131072)
    per_token = 12 * 24 * 2048**2 * (6 + 4096 / 2048 + 131072 / (2 * 24 * 2048))
    assert tokens * per_token == pytest.approx(408.8e12)
    # the 2021 paper's count (eq. 3) includes full recompute's second forward: 4 passes, not 3
    tokens = calibration.megatron_2021_tokens_per_s(137, 24, 2304, 2048, 51200)
    assert tokens * 96 * 24 * 2304**2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304)) == pytest.approx(137e12)


def test_a_row_with_half_a_sequence_per_gpu_holds_a_whole_global_batch():
    assert _row(batch=0.5, mesh=(4, 2)).global_batch == 4
    with pytest.raises(ValueError, match="no whole batch"):
        _row(batch=0.5, mesh=(3,))


def test_a_tp_row_with_a_distributed_optimizer_prices_the_split_state():
    # TP 2 x DP 2: the hand plan holds AdamW state unsplit; the row takes away what a split over
    # 2 data-parallel ranks frees, and plans under the budget plus those bytes. Width 512: wide
    # enough that AdamW's step is priced by its bytes, not its launch.
    row = _row(
        model="gpt:2:512:8",
        mesh=(2, 2),
        batch=1,
        layout="megatron_sp",
        dtype="float32",
        precision="bf16-mixed",
        optimizer_shards=2,
    )
    model = calibration.build_model(row.model, calibration.torch.float32)
    cluster = calibration.row_cluster(row, None)
    split = calibration._distributed_optimizer_bytes(row, model, "megatron_sp")
    local = sum(
        p.numel() / (2 if calibration.megatron_placement(n, tuple(p.shape)).is_shard() else 1)
        for n, p in model.named_parameters()
    )
    assert split == pytest.approx(2 * 4 * local / 2)
    got = calibration.price(row, model, cluster, "megatron_sp")
    unsplit = calibration.price(dataclasses.replace(row, optimizer_shards=1), model, cluster, "megatron_sp")
    assert got["peak_gib"] == pytest.approx(unsplit["peak_gib"] - split / GIB)
    # the fused AdamW step of half the elements; autopar.plan's own plan splits nothing
    assert got["step_s"] < unsplit["step_s"]
    assert calibration._distributed_optimizer_bytes(row, model, "plan") == 0.0
