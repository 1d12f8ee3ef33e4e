"""autopar profile's achieved rates and host link (``runtime.tools.profile_rates``), on CPU: the fits,
and the same measuring code the GPU runs, at small sizes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.cost.cluster import ClusterSpec, LinkSpec, get_cluster
from autopar.cost.rates import ComputeRates
from autopar.runtime.tools import profile_rates
from autopar.runtime.tools.profile import build_spec, measure_device

DEVICE = {"device": "test", "peak_flops": {"float32": 1e11}, "memory_bandwidth_bytes_per_s": 1e10, "memory_bytes": 2**34}
CPU = torch.device("cpu")


def test_fit_saturating_recovers_the_curve():
    flops = [1e6, 1e7, 1e8, 1e9, 1e10]
    fractions = [0.7 * f / (f + 3e7) for f in flops]
    efficiency, half = profile_rates.fit_saturating(flops, fractions)
    assert efficiency == pytest.approx(0.7, rel=0.02) and half == pytest.approx(3e7, rel=0.05)
    # one GEMM slowed 10x by noise moves the fit far less than a least-squares fit of 1/fraction would
    noisy = fractions[:1] + [fractions[1] / 10] + fractions[2:]
    assert profile_rates.fit_saturating(flops, noisy)[0] == pytest.approx(0.7, rel=0.35)
    # GEMMs all at the ceiling: no size dependence
    assert profile_rates.fit_saturating(flops, [0.5] * 5) == pytest.approx((0.5, 0.0))
    with pytest.raises(ValueError, match="two or more"):
        profile_rates.fit_saturating([1e6], [0.5])


def test_fit_link_recovers_alpha_beta():
    sizes = [1 << 20, 4 << 20, 16 << 20, 64 << 20]
    link = profile_rates.fit_link(sizes, [2e-5 + n / 25e9 for n in sizes])
    assert link.latency_s == pytest.approx(2e-5) and link.bandwidth_bytes_per_s == pytest.approx(25e9)
    with pytest.raises(ValueError, match="do not grow"):
        profile_rates.fit_link(sizes, [1e-3, 1e-3, 1e-4, 1e-5])


def test_measure_rates_on_cpu_gives_a_valid_spec_part():
    peak = measure_device("cpu", quick=True, rates=False)
    rates = profile_rates.measure_rates(
        CPU, torch.float32, peak["peak_flops"]["float32"], peak["memory_bandwidth_bytes_per_s"], True
    )
    assert isinstance(rates, ComputeRates)  # its __post_init__ checked every field's range
    assert rates.launch_overhead_s > 0 and "GEMM" in rates.source and "SDPA" in rates.source
    # torch.utils.checkpoint's Python hooks cost the host something per op of a segment
    assert 0 < rates.checkpoint_hook_s < 1e-2 and "checkpointed segments" in rates.source
    small, large = rates.matmul_fraction(2 * 32**3), rates.matmul_fraction(2 * 256**3)
    assert small <= large


def test_host_link_times_copies_both_ways(monkeypatch):
    # the copies run for real; their clock is a known link (a loaded CPU's timings are noise)
    def fake_time(fn, device, repeats, warmup):
        fn()
        bound = list(fn.__defaults__ or ()) + [cell.cell_contents for cell in fn.__closure__ or ()]
        tensors = [value for value in bound if isinstance(value, torch.Tensor)]
        return 2e-5 + tensors[0].numel() * tensors[0].element_size() / 25e9  # the copy's source and destination

    monkeypatch.setattr(profile_rates, "time_call", fake_time)
    found = profile_rates.measure_host_link(CPU, profile_rates.host_link_sizes(CPU, quick=True), repeats=2)
    for key in ("link", "host_to_device", "device_to_host"):
        assert isinstance(found[key], LinkSpec)
    assert found["link"].latency_s == pytest.approx(2e-5) and found["link"].bandwidth_bytes_per_s == pytest.approx(25e9)
    assert found["link"].bandwidth_bytes_per_s == min(
        found[k].bandwidth_bytes_per_s for k in ("host_to_device", "device_to_host")
    )


def test_a_gpu_profile_writes_rates_and_a_host_link():
    # what measure_device returns on CUDA, built into a spec: priced as NCCL, offload over PCIe
    rates = dataclasses.replace(get_cluster("h200-141g").rates, source="measured")
    measured = {**DEVICE, "rates": rates, "host_link": LinkSpec(1e-5, 5e10)}
    spec = build_spec(measured, None, (1,), 1, 1, base="h100-80g")
    assert spec.rates == rates and spec.host_link == LinkSpec(1e-5, 5e10) and not spec.gloo
    assert "host_link" in spec.notes and ClusterSpec.from_json(spec.to_json()) == spec
    # a CPU profile has no host link (the device is the host) and, unless asked, no rates
    cpu = build_spec(DEVICE, None, (1,), 1, 1)
    assert cpu.host_link is None and cpu.rates is None


def test_a_spec_with_measured_rates_plans(tmp_path):
    rates = ComputeRates(matmul_efficiency=0.5, matmul_half_flops=1e6, memory_efficiency=0.8, launch_overhead_s=1e-5)
    spec = dataclasses.replace(build_spec(DEVICE, None, (1,), 2, 1), rates=rates)
    spec.save(tmp_path / "c.json")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    slow = autopar.plan(model, mesh=(2,), example_inputs=(x,), cluster=str(tmp_path / "c.json"))
    fast = autopar.plan(model, mesh=(2,), example_inputs=(x,), cluster=dataclasses.replace(spec, rates=None))
    assert slow.predicted.compute_s > fast.predicted.compute_s  # below-peak rates and the launch floor cost time


def test_the_cli_shows_the_rates_and_host_link(monkeypatch, capsys, tmp_path):
    from autopar.cli.main import main
    from autopar.runtime.tools import profile

    monkeypatch.setattr(profile, "run_profile", lambda *args, **kwargs: get_cluster("h200-141g"))
    assert main(["profile", "--out", str(tmp_path / "c.json")]) == 0
    shown = capsys.readouterr().out
    assert "host link 5e+10 B/s" in shown and "rates: matmul 0.65 of peak" in shown and "causal work 0.50" in shown
    if not torch.cuda.is_available():  # a device alone takes its preset's links; without CUDA, cpu-gloo's
        assert profile._device_preset() == "cpu-gloo"
