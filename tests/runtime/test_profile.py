"""autopar profile: the alpha-beta fit, the spec it writes, and one live run on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.cluster import ClusterSpec, LinkSpec
from autopar.runtime.tools.profile import build_spec, fit_alpha_beta, measure_device, run_profile

DEVICE = {"device": "test", "peak_flops": {"float32": 1e11}, "memory_bandwidth_bytes_per_s": 1e10, "memory_bytes": 2**34}


def test_fit_alpha_beta_recovers_a_ring_all_reduce():
    # k = 4, α = 20 us, β = 1e9 B/s: t = 6·2e-5 + 1.5 · n / 1e9
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    times = [1.2e-4 + 1.5 * n / 1e9 for n in sizes]
    link = fit_alpha_beta(sizes, times, 4)
    assert link.latency_s == pytest.approx(2e-5)
    assert link.bandwidth_bytes_per_s == pytest.approx(1e9)
    with pytest.raises(ValueError, match="do not grow with size"):
        fit_alpha_beta(sizes, list(reversed(times)), 4)
    with pytest.raises(ValueError, match="k >= 2"):
        fit_alpha_beta(sizes, times, 1)


def test_build_spec_maps_axes_to_link_levels():
    slow, fast = LinkSpec(1e-4, 1e8), LinkSpec(1e-5, 1e9)
    axes = [{"axis": 0, "size": 2, "link": slow}, {"axis": 1, "size": 4, "link": fast}]
    # mesh (2, 4) with 4 devices per node: axis 1 inside a node, axis 0 across nodes
    spec = build_spec(DEVICE, axes, (2, 4), devices_per_node=4, num_nodes=2)
    assert (spec.intra_node, spec.inter_node) == (fast, slow)
    assert spec.axis_link((2, 4), 0) == slow
    # every axis inside one node: the inter-node link copies the intra-node one, and says so
    spec = build_spec(DEVICE, axes, (2, 4), devices_per_node=8, num_nodes=1)
    assert spec.inter_node == spec.intra_node == LinkSpec(1e-4, 1e8)  # the slower of the two axes
    assert "copied from intra_node" in spec.notes
    # CPU ranks that share 2 cores: 4 ranks on the node each get half a device
    # CPU ranks that shared 2 cores: 8 ranks each got a quarter of a core, so the links they
    # measured are stored at full speed, and pricing the same mesh gives back what was measured
    shared = build_spec(DEVICE, axes, (2, 4), devices_per_node=8, num_nodes=1, compute_slots_per_node=2)
    assert spec.compute_share((2, 4)) == 1.0 and shared.compute_share((2, 4)) == 0.25
    assert shared.intra_node.latency_s == pytest.approx(0.25e-4)
    assert shared.intra_node.bandwidth_bytes_per_s == pytest.approx(4e8)
    assert shared.axis_link((2, 4), 0).latency_s == pytest.approx(1e-4)
    assert shared.axis_link((2, 4), 0).bandwidth_bytes_per_s == pytest.approx(1e8)
    assert "shared 2 compute slots" in shared.notes


def test_measure_device_on_cpu_is_positive():
    device = measure_device("cpu", quick=True)
    assert device["peak_flops"]["float32"] > 1e7
    assert device["memory_bandwidth_bytes_per_s"] > 1e7
    assert device["memory_bytes"] > 2**20


def test_profile_without_a_process_group_refuses_a_mesh(tmp_path):
    with pytest.raises(ValueError, match="add --spawn"):
        run_profile(str(tmp_path / "c.json"), (2,), spawn=False, quick=True)


@pytest.mark.multiproc
def test_profile_spawn_writes_a_spec_that_plan_accepts(tmp_path):
    path = tmp_path / "cluster.json"
    spec = run_profile(str(path), (2,), spawn=True, quick=True, timeout_s=120)
    loaded = ClusterSpec.load(path)
    assert loaded == spec and loaded.devices_per_node == 2
    assert "fitted from all-reduces on 1 mesh axis" in loaded.notes
    assert 0 < loaded.intra_node.latency_s < 1 and loaded.intra_node.bandwidth_bytes_per_s > 1e6
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    plan = autopar.plan(model, (2,), example_inputs=(torch.randn(4, 8),), cluster=path)
    assert plan.cluster == loaded.name


def test_an_axis_whose_times_fall_with_size_is_measured_once_more(monkeypatch):
    """A burst of load on a shared host (another job's step) made one size's all-reduces slower
    than the next size's, and the profile failed with 'do not grow with size'."""
    from autopar.errors import ClusterSpecError
    from autopar.runtime.tools import profile

    sizes = [4096, 65536, 1048576, 4194304]
    noisy, clean = [1.9e-3, 6.5e-3, 2.5e-3, 3.7e-3], [1.0e-4, 2.0e-4, 1.2e-3, 4.5e-3]
    rounds = iter([noisy, clean])
    monkeypatch.setattr(profile, "_time_all_reduces", lambda *args: next(rounds))
    times, link = profile._fitted_axis(sizes, None, torch.device("cpu"), 5, 2)
    assert times == clean and link == fit_alpha_beta(sizes, clean, 2)
    rounds = iter([noisy, noisy])  # twice: the error names the fix
    with pytest.raises(ClusterSpecError, match="do not grow with size"):
        profile._fitted_axis(sizes, None, torch.device("cpu"), 5, 2)
