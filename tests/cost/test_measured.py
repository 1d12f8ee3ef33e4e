"""Measured compute mode: timing on local shapes, the disk cache, and the roofline fallback."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cost import measured
from autopar.cost.cluster import get_cluster
from autopar.cost.compute import compute_cost_s
from autopar.ir.spec import R, S
from autopar.rules.registry import Strategy, op_info_from_values

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE", str(tmp_path))
    monkeypatch.setattr(measured, "_CACHES", {})
    return tmp_path


def _linear_info():
    x, w, b = torch.empty(64, 32, device="meta"), torch.empty(16, 32, device="meta"), torch.empty(16, device="meta")
    kw = {"input": x, "weight": w, "bias": b}
    return op_info_from_values("linear", aten.linear.default, kw, aten.linear.default(x, w, b))


def test_measures_local_shapes_and_caches_on_disk(private_cache, monkeypatch):
    info = _linear_info()
    batch_split = Strategy(((S(0),), (R,), (R,)), ((S(0),),))
    key, kw = measured.op_key(info, batch_split, (2,), requires_grad=True)
    assert kw["input"] == ("tensor", (32, 32), torch.float32)  # the local half of the batch
    seconds = measured.measured_seconds(info, batch_split, (2,), True)
    assert seconds is not None and 0 < seconds < 1
    cpu = get_cluster("cpu")
    measured_cpu = type(cpu)(**{**{f: getattr(cpu, f) for f in cpu.__dataclass_fields__}, "compute": "measured"})
    assert compute_cost_s(info, batch_split, (2,), measured_cpu, True) == pytest.approx(seconds)
    measured.get_cache().save()
    files = list(private_cache.glob("compute-*-torch*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())[key] == seconds
    # a fresh process reads the file instead of measuring again
    monkeypatch.setattr(measured, "_CACHES", {})
    monkeypatch.setattr(measured, "_step", lambda *a: pytest.fail("measured again despite the cache"))
    assert measured.measured_seconds(info, batch_split, (2,), True) == seconds


def test_ops_it_cannot_run_fall_back_to_the_roofline():
    cpu = get_cluster("cpu")
    measured_cpu = type(cpu)(**{**{f: getattr(cpu, f) for f in cpu.__dataclass_fields__}, "compute": "measured"})
    # a reshape to the global shape cannot run on a local shard: None, and the roofline price
    x = torch.empty(8, 6, device="meta")
    info = op_info_from_values("reshape", aten.reshape.default, {"self": x, "shape": [48]}, aten.reshape.default(x, [48]))
    strategy = Strategy(((S(0),),), ((S(0),),))
    assert measured.measured_seconds(info, strategy, (2,), False) is None
    assert compute_cost_s(info, strategy, (2,), measured_cpu, False) == compute_cost_s(info, strategy, (2,), cpu, False)
    # an op run as an autopar kernel is priced by the roofline too
    kernel = Strategy(((R,), (S(1),), (S(0),)), ((R,),), kernel="linear_bias_split", kernel_axes=(0,))
    assert measured.measured_seconds(_linear_info(), kernel, (2,), True) is None


def test_plan_with_measured_compute():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    roofline = autopar.plan(model, (2,), example_inputs=(x,), cluster="cpu")
    timed = autopar.plan(model, (2,), example_inputs=(x,), cluster="cpu", compute="measured")
    assert timed.predicted.step_time_s > 0
    assert timed.predicted.compute_s != roofline.predicted.compute_s
    assert measured.get_cache().entries, "measured mode must time ops"
    with pytest.raises(ValueError, match="compute must be one of roofline, measured"):
        autopar.plan(model, (2,), example_inputs=(x,), cluster="cpu", compute="guess")
