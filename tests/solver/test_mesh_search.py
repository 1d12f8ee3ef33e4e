"""Mesh search: every factorization of N devices into 1-3 axes, planned from one trace."""

from __future__ import annotations

import math

import pytest
from torch.distributed.tensor import Shard

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.options import PlanOptions
from autopar.solver.planners.mesh_search import mesh_candidates, mesh_search_text, search_mesh
from autopar.solver.planners.traced import plan_traced, plan_traced_unexplained
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


def test_candidates():
    assert mesh_candidates(1) == [(1,)]
    assert mesh_candidates(7) == [(7,)]
    assert mesh_candidates(8) == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    assert mesh_candidates(8, max_axes=2) == [(8,), (2, 4), (4, 2)]
    many = mesh_candidates(1024)
    # 2^10: one axis, 9 ordered pairs, C(9, 2) = 36 ordered triples.
    assert len(many) == 1 + 9 + 36 and len(set(many)) == len(many)
    assert all(math.prod(shape) == 1024 and min(shape) >= 2 for shape in many)
    with pytest.raises(autopar.MeshError, match="positive integer"):
        mesh_candidates(0)


def test_search_picks_the_fastest_and_lists_every_mesh():
    model, batch = build_model("mlp", seed=0), example_batch("mlp", 8)
    best = autopar.plan(model, "auto", devices=4, example_inputs=batch, cluster="h100-80g")
    rows = best.stats["mesh_search"]
    assert [tuple(r["mesh"]) for r in rows] and {tuple(r["mesh"]) for r in rows} == {(4,), (2, 2)}
    assert all(r["status"] == "ok" for r in rows)
    assert tuple(rows[0]["mesh"]) == best.mesh_shape
    assert best.predicted.step_time_s == min(r["step_time_s"] for r in rows)
    # Each row is what planning that mesh alone gives.
    for row in rows:
        alone = autopar.plan(model, tuple(row["mesh"]), example_inputs=batch, cluster="h100-80g")
        assert alone.predicted.step_time_s == pytest.approx(row["step_time_s"], rel=1e-12)
        if tuple(row["mesh"]) == best.mesh_shape:  # only the chosen mesh is explained, as when planned alone
            assert best.decisions and best.decisions == alone.decisions
    text = mesh_search_text(rows)
    assert "<- chosen" in text and "2x2" in text
    # The search table is a fact of the run, not part of the plan file.
    assert "mesh_search" not in best.to_json()


def test_infeasible_meshes_are_listed(monkeypatch):
    # The mlp's sizes (8, 32, 128) do not split by 3 or 6: on (6,) nothing can be sharded evenly,
    # on (2, 3) and (3, 2) the axis of 2 still can. A budget between the two is infeasible on (6,)
    # only, without padded shards (with them, FSDP2's uneven dim 0, (6,) shards too: below).
    from autopar.ir import spec as spec_module

    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", False)
    model, batch = build_model("mlp", seed=0), example_batch("mlp", 8)
    traced = trace(model, batch)
    cluster = get_cluster("cpu")
    free = autopar.plan(model, (6,), example_inputs=batch, cluster="cpu")
    budget = free.predicted.peak_memory_bytes * 0.9
    best = search_mesh(traced, 6, cluster, PlanOptions.from_keywords(memory_budget=budget), plan_traced_unexplained)
    rows = {tuple(r["mesh"]): r for r in best.stats["mesh_search"]}
    assert set(rows) == {(6,), (2, 3), (3, 2)}
    assert rows[(6,)]["status"] == "infeasible" and "memory_budget" in rows[(6,)]["reason"]
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", True)
    padded = autopar.plan(model, (6,), example_inputs=batch, cluster="cpu", memory_budget=budget)
    assert padded.predicted.peak_memory_bytes <= budget and (Shard(0),) in padded.params.values()
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", False)
    assert best.mesh_shape in ((2, 3), (3, 2)) and best.predicted.peak_memory_bytes <= budget
    assert best.stats["mesh_search"][-1]["status"] == "infeasible"
    assert "infeasible" in mesh_search_text(best.stats["mesh_search"])
    with pytest.raises(autopar.InfeasibleError, match="no mesh of 6 devices"):
        search_mesh(traced, 6, cluster, PlanOptions.from_keywords(memory_budget=1024), plan_traced_unexplained)


def test_auto_needs_devices_and_mesh_must_match_devices():
    model, batch = build_model("mlp", seed=0), example_batch("mlp", 8)
    with pytest.raises(autopar.MeshError, match="devices=N"):
        autopar.plan(model, "auto", example_inputs=batch)
    with pytest.raises(autopar.MeshError, match="not devices=8"):
        autopar.plan(model, (2, 2), devices=8, example_inputs=batch)


def test_the_searched_plan_records_its_precision():
    model = build_model("mlp", seed=0)
    best = autopar.plan(model, "auto", devices=2, example_inputs=example_batch("mlp", 8), cluster="cpu", precision="bf16-true")
    assert best.precision.name == "bf16-true" and "mesh_search" in best.stats


def test_a_plan_leaves_no_reference_cycles():
    """What a mesh's planning made goes when its plan is dropped, with no full collection (the
    search runs none between meshes): planning, on a 3-axis mesh and its hub tables, makes no
    reference cycles."""
    import gc

    traced = trace(build_model("mlp", seed=0), example_batch("mlp", 8))
    cluster, options = get_cluster("h100-80g"), PlanOptions()
    plan_traced(traced, (2, 2, 2), cluster, options)  # loads what loads once (the solver's libraries)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        plan = plan_traced(traced, (2, 2, 2), cluster, options)
        assert plan.decisions
        del plan
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
