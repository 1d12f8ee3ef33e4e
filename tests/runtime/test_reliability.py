"""Failure modes: disagreeing ranks, dead ranks, determinism, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import PlanError
from autopar.runtime import compile_checks
from autopar.runtime.tools.launch import DistributedRankError, run_distributed
from autopar.zoo.models import build_model, example_batch


@pytest.fixture
def one_rank_gloo():
    """A real gloo process group of one rank in this process, torn down afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1, timeout=timedelta(seconds=30))
        try:
            yield
        finally:
            dist.destroy_process_group()


def test_bfloat16_on_gloo_trains_where_gloo_sums_it(one_rank_gloo):
    """compile tries whether the backend sums bf16 (torch 2.13's gloo does) rather than refusing
    bf16 on gloo by name."""
    model = build_model("mlp", seed=0).to(torch.bfloat16)
    x, y = (t.to(torch.bfloat16) for t in example_batch("mlp", 8))
    pm = autopar.compile(model, (1,), example_inputs=(x, y))
    assert compile_checks._REDUCES[("gloo", torch.bfloat16)] is True
    pm(x, y).backward()
    assert {p.grad.dtype for p in pm.parameters()} == {torch.bfloat16}


def test_bfloat16_on_a_gloo_that_cannot_sum_it_is_refused_with_the_fix(one_rank_gloo, monkeypatch):
    monkeypatch.setitem(compile_checks._REDUCES, ("gloo", torch.bfloat16), False)  # an older gloo build
    model = build_model("mlp", seed=0).to(torch.bfloat16)
    x, y = (t.to(torch.bfloat16) for t in example_batch("mlp", 8))
    with pytest.raises(ValueError, match="cannot reduce.*float32"):
        autopar.compile(model, (1,), example_inputs=(x, y))
    with pytest.raises(ValueError, match="precision='bf16-mixed''s param_dtype is torch.bfloat16"):
        autopar.compile(build_model("mlp", seed=0), (1,), example_inputs=example_batch("mlp", 8), precision="bf16-mixed")


def test_mesh_must_match_world_size(one_rank_gloo):
    with pytest.raises(autopar.MeshError, match="world size is 1"):
        autopar.compile(build_model("mlp"), (2,), example_inputs=example_batch("mlp", 8))


def test_plan_from_another_torch_version_is_refused(one_rank_gloo, tmp_path):
    model = build_model("mlp", seed=0)
    batch = example_batch("mlp", 8)
    data = json.loads(autopar.plan(model, (1,), example_inputs=batch).to_json())
    data["torch_version"] = "1.13.1"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="torch 1.13.1.*re-plan"):
        autopar.compile(model, (1,), example_inputs=batch, plan=str(path))


def _agreement_and_determinism(rank: int, world: int, plan_dir: str) -> dict:
    model = build_model("mlp_block", seed=0)
    batch = example_batch("mlp_block", 8)
    # Determinism: the same plan, byte for byte, in every process.
    text = autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu").to_json()
    # Agreement: rank 1 is handed a plan for another cluster; every rank must refuse.
    cluster = "cpu" if rank == 0 else "h100-80g"
    path = os.path.join(plan_dir, f"plan{rank}.json")
    autopar.plan(model, (world,), example_inputs=batch, cluster=cluster).save(path)
    try:
        autopar.compile(model, (world,), example_inputs=batch, plan=path)
        refused = "compiled"
    except PlanError as error:
        refused = str(error)
    return {"plan_json": text, "refused": refused}


def test_ranks_with_different_plans_fail_clearly_and_plans_are_deterministic(tmp_path):
    start = time.monotonic()
    results = run_distributed(_agreement_and_determinism, 2, str(tmp_path), timeout_s=120, pg_timeout_s=30)
    assert time.monotonic() - start < 60
    assert results[0]["plan_json"] == results[1]["plan_json"], "plans differ between processes"
    here = autopar.plan(build_model("mlp_block", seed=0), (2, 2), example_inputs=example_batch("mlp_block", 8), cluster="cpu")
    assert here.to_json() == results[0]["plan_json"], "plans differ between this process and the ranks"
    for rank, result in enumerate(results):
        assert "ranks hold different plans" in result["refused"], f"rank {rank}: {result['refused']}"


def _one_rank_never_compiles(rank: int, world: int) -> str:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    autopar.compile(build_model("mlp", seed=0), (world,), example_inputs=example_batch("mlp", 8))
    return "compiled without rank 1"


def test_a_rank_missing_at_compile_is_named():
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_one_rank_never_compiles, 2, timeout_s=120, pg_timeout_s=30, grace_s=60)
    message = str(info.value)
    assert "rank 1 exited" in message and "rank 1 never reached autopar.compile" in message, message
