"""The compiled mode in one process (a world of one over gloo): numbers, inductor's cache, refusals.
The multi-rank checks are tests/zoo/test_zoo_compiled.py (one shared spawn)."""

from __future__ import annotations

import copy
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.launch import max_rel_diff
from autopar.zoo.models import build_model, example_batch
from tests.conftest import eager_grads


@pytest.fixture(scope="module")
def world_of_one():
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rdzv')}", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()


def _compiled_step(config: dict):
    model = build_model("mlp", seed=0, **config)
    eager = copy.deepcopy(model)
    batch = example_batch("mlp", batch_size=4, seed=1, **config)
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler="inductor")
    loss = pm(*batch)
    loss.backward()
    want = eager(*batch)
    want.backward()
    return pm, loss, want, max_rel_diff(pm.full_grads(), eager_grads(eager))


def test_compiled_mode_equals_eager_and_hits_inductors_cache_when_compiled_again(world_of_one):
    from torch._dynamo.utils import counters

    config = dict(d_in=8, d_hidden=16, d_out=4)
    pm, loss, want, grads = _compiled_step(config)
    assert pm._compiled_graph.first_call_s is not None, "the first call compiled (and timed) the graph"
    assert pm.plan.predicted.executor == "inductor"
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert max(grads.values()) <= 1e-4, grads
    torch._dynamo.reset()  # forget the compiled code, keep inductor's on-disk cache
    counters.clear()
    _compiled_step(config)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1, dict(counters["inductor"])


def test_compiler_is_checked_and_offload_refused(world_of_one):
    model = build_model("mlp", seed=0, d_in=8, d_hidden=16, d_out=4)
    batch = example_batch("mlp", batch_size=4, seed=1, d_in=8, d_hidden=16, d_out=4)
    with pytest.raises(ValueError, match="compiler must be None"):
        autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler="tvm")
    with pytest.raises(ValueError, match="offloading"):
        autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler="inductor", offload="cpu")
