"""Achieved rates (``autopar.cost.rates``): the compute model priced at what kernels reach."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autopar.cost.cluster import ClusterSpec, get_cluster
from autopar.cost.compute import compute_cost_s, node_flops
from autopar.cost.rates import ComputeRates, mask_kind, optimizer_step_s
from autopar.ir.spec import R
from autopar.rules.registry import Strategy
from tests.cost.test_cost import info_for, meta, round_cluster

aten = torch.ops.aten
REPLICATED_2 = Strategy(ins=((R,), (R,)), outs=((R,),))


def with_rates(**fields) -> ClusterSpec:
    return dataclasses.replace(round_cluster(), rates=ComputeRates(**fields))


def test_default_rates_price_the_plain_roofline():
    plain = round_cluster()
    info = info_for(aten.mm.default, meta(128, 256), meta(256, 512))
    for grad in (False, True):
        assert compute_cost_s(info, REPLICATED_2, (1,), with_rates(), grad) == compute_cost_s(
            info, REPLICATED_2, (1,), plain, grad
        )


def test_matmul_efficiency_saturates_in_the_gemm_size():
    rates = ComputeRates(matmul_efficiency=0.8, matmul_half_flops=1e9)
    assert rates.matmul_fraction(1e9) == pytest.approx(0.4)
    fractions = [rates.matmul_fraction(f) for f in (1e6, 1e8, 1e10, 1e12)]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(0.8, rel=1e-2)
    cluster = with_rates(matmul_efficiency=0.8, matmul_half_flops=1e9)
    small = info_for(aten.mm.default, meta(64, 64), meta(64, 64))  # 524,288 FLOPs: far from peak
    big = info_for(aten.mm.default, meta(4096, 4096), meta(4096, 4096))
    for info in (small, big):
        flops = node_flops(info)
        achieved = flops / compute_cost_s(info, REPLICATED_2, (1,), cluster, False)
        assert achieved == pytest.approx(cluster.peak_flops["float32"] * rates.matmul_fraction(flops))
    assert node_flops(small) / compute_cost_s(small, REPLICATED_2, (1,), cluster, False) < 0.01 * cluster.peak_flops["float32"]


def _sdpa(**kwargs):
    q = meta(2, 8, 1024, 64)
    return info_for(aten.scaled_dot_product_attention.default, q, q, q, **kwargs)


def test_attention_is_priced_by_its_mask_kind():
    causal, masked, full = _sdpa(is_causal=True), _sdpa(attn_mask=meta(1024, 1024, dtype=torch.bool)), _sdpa()
    assert [mask_kind(i.kw) for i in (causal, masked, full)] == ["causal", "masked", "full"]
    strategy = Strategy(ins=((R,), (R,), (R,)) + (((R,),) if masked.kw["attn_mask"] is not None else ()), outs=((R,),))
    cluster = with_rates(
        attention_efficiency=0.5, causal_work=0.5, masked_attention_efficiency=0.25, masked_backward_slowdown=3.0
    )
    peak = cluster.peak_flops["float32"]
    flops = node_flops(full)
    three = Strategy(ins=((R,), (R,), (R,)), outs=((R,),))
    assert compute_cost_s(full, three, (1,), cluster, False) == pytest.approx(flops / (0.5 * peak))
    # causal without a mask: half the blocks at the fused kernel's rate
    assert compute_cost_s(causal, three, (1,), cluster, False) == pytest.approx(flops * 0.5 / (0.5 * peak))
    # a materialized mask: every block, slower, and a backward 3x the unmasked one (2 -> 6 forwards)
    assert compute_cost_s(masked, strategy, (1,), cluster, False) == pytest.approx(flops / (0.25 * peak))
    assert compute_cost_s(masked, strategy, (1,), cluster, True) == pytest.approx(7 * flops / (0.25 * peak))
    assert compute_cost_s(causal, three, (1,), cluster, True) == pytest.approx(3 * flops * 0.5 / (0.5 * peak))


def test_a_mask_the_example_makes_causal_is_priced_causal_where_the_runtime_checks_it():
    # A mask from the batch that the example batch makes causal (trace.attention.causal_for_the_example):
    # the runtime attends without it in such calls (ops.causal_mask), but not under inductor,
    # which traces the graph without the batch's values.
    masked = _sdpa(attn_mask=meta(1024, 1024, dtype=torch.bool))
    seen = dataclasses.replace(masked, example_mask="causal")
    assert (mask_kind(masked.kw, masked.example_mask), mask_kind(seen.kw, seen.example_mask)) == ("masked", "causal")
    cluster = with_rates(
        attention_efficiency=0.5, causal_work=0.5, masked_attention_efficiency=0.25, masked_backward_slowdown=3.0
    )
    four = Strategy(ins=((R,), (R,), (R,), (R,)), outs=((R,),))
    three = Strategy(ins=((R,), (R,), (R,)), outs=((R,),))
    causal = _sdpa(is_causal=True)
    for grad in (False, True):
        assert compute_cost_s(seen, four, (1,), cluster, grad) == pytest.approx(
            compute_cost_s(causal, three, (1,), cluster, grad)
        )
        inductor = dataclasses.replace(cluster, executor="inductor")
        assert compute_cost_s(seen, four, (1,), inductor, grad) == pytest.approx(
            compute_cost_s(masked, four, (1,), inductor, grad)
        )
        assert compute_cost_s(seen, four, (1,), cluster, grad) < compute_cost_s(masked, four, (1,), cluster, grad)


def test_memory_bound_ops_and_the_launch_floor():
    cluster = with_rates(memory_efficiency=0.5, launch_overhead_s=1e-5)
    one = Strategy(ins=((R,),), outs=((R,),))
    big = info_for(aten.relu.default, meta(4096, 4096))
    moved = 2 * 4096 * 4096 * 4
    assert compute_cost_s(big, one, (1,), cluster, True) == pytest.approx(2 * moved / (0.5 * 1e11))
    tiny = info_for(aten.relu.default, meta(4))
    assert compute_cost_s(tiny, one, (1,), cluster, False) == pytest.approx(1e-5)
    assert compute_cost_s(tiny, one, (1,), cluster, True) == pytest.approx(2e-5)  # forward and backward kernels
    view = info_for(aten.view.default, meta(4, 4), [16])
    assert compute_cost_s(view, one, (1,), cluster, True) == 0.0
    # under inductor a pointwise op runs inside its neighbour's kernel: no launch of its own
    compiled = dataclasses.replace(cluster, executor="inductor")
    assert compute_cost_s(tiny, one, (1,), compiled, False) == pytest.approx(4 * 4 / (0.5 * 1e11))
    matmul = info_for(aten.mm.default, meta(2, 2), meta(2, 2))
    assert compute_cost_s(matmul, REPLICATED_2, (1,), compiled, False) == pytest.approx(1e-5)


def test_optimizer_step_reads_and_writes_params_grads_and_states():
    rates = ComputeRates(memory_efficiency=0.5, launch_overhead_s=1e-5)
    fused = optimizer_step_s(1e9, 2, 4, 100, 1e12, rates, "fused")
    assert fused == pytest.approx(1e9 * (3 * 2 + 4 * 4) / 0.5e12)
    assert optimizer_step_s(1e9, 2, 4, 100, 1e12, rates, "foreach") > 2.5 * fused
    assert optimizer_step_s(10, 4, 4, 1000, 1e12, rates, "foreach") == pytest.approx(1000 * 1e-5)
    with pytest.raises(ValueError, match="implementation"):
        optimizer_step_s(1, 4, 4, 1, 1e12, rates, "sgd")


def test_rates_round_trip_and_old_specs_load(tmp_path):
    h200 = get_cluster("h200-141g")
    assert h200.rates is not None and h200.rates.causal_work == 0.5 and h200.host_link is not None
    assert "datasheet" in h200.source and h200.rates.source
    for suffix in ("json", "toml"):
        h200.save(tmp_path / f"h200.{suffix}")
        assert ClusterSpec.load(tmp_path / f"h200.{suffix}") == h200
    old = h200.to_json()
    del old["rates"]
    assert ClusterSpec.from_json(old).rates is None  # written before rates: the plain roofline
    partial = {**old, "rates": {"matmul_efficiency": 0.6}}
    assert ClusterSpec.from_json(json.dumps(partial)).rates == ComputeRates(matmul_efficiency=0.6)
    with pytest.raises(ValueError, match="unknown keys \\['mfu'\\]"):
        ClusterSpec.from_json({**old, "rates": {"mfu": 0.5}})
    with pytest.raises(ValueError, match="matmul_efficiency"):
        ComputeRates(matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="masked_backward_slowdown"):
        ComputeRates(masked_backward_slowdown=0.5)


def test_cpu_presets_keep_the_plain_roofline():
    # the CPU calibration (bench_cost_accuracy) and the golden plans price these unchanged
    for name in ("cpu", "cpu-gloo"):
        assert get_cluster(name).rates is None
