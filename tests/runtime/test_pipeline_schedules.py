"""Multi-stage pipeline schedules on real gloo ranks: interleaved 1F1B and zero-bubble ZBV.

ONE 4-rank job (the shared RankPool) runs a float64 GPT of 8 layers on mesh (4, 1) as 8 model
stages, two per rank, under torch's ScheduleInterleaved1F1B (stages g and g + 4 on rank g) and
ScheduleZBVZeroBubble (stages g and 7 - g on rank g, so the tied embedding and LM head of stages
0 and 7 are one parameter in two stages of rank 0), with 4 microbatches. Each must give eager's
loss and gradients, take an AdamW step to eager's parameters, and evaluate under no_grad. Plans
are made in the parent with ``schedules_allowed`` naming the one schedule. Then the interleaved
pipeline's DCP checkpoint is loaded into the ZBV one (other stages on each rank).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.pipeline import first_microbatch
from autopar.runtime.tools.launch import max_rel_diff
from autopar.solver.planners.stages import StageSettings, plan_stages
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.conftest import eager_grads

MESH, MICROBATCHES, BATCH, TOL = (4, 1), 4, 8, 1e-9


def _gpt() -> torch.nn.Module:
    return build_model("gpt", seed=0, n_layer=8, bias=False).to(torch.float64)


def _plan(schedule: str) -> autopar.Plan:
    inputs, _ = first_microbatch(example_batch("gpt", BATCH, seed=1), None, MICROBATCHES)
    return plan_stages(
        trace(_gpt(), inputs),
        MESH,
        get_cluster("cpu"),
        StageSettings(num_stages=4, num_microbatches=MICROBATCHES, schedules_allowed=(schedule,)),
    )


def _run(rank: int, world: int, plans: dict[str, str], path: str) -> dict:
    results, modules = {}, {}
    for name, text in plans.items():
        model = _gpt()
        eager = copy.deepcopy(model)
        batch = example_batch("gpt", BATCH, seed=1)
        pm = autopar.compile(model, MESH, example_inputs=batch, plan=autopar.Plan.from_json(text))
        loss = pm(*batch)
        loss.backward()
        want = eager(*batch)
        want.backward()
        result = {
            "loss": (loss.item(), want.item()),
            "grad_rel": max_rel_diff(pm.full_grads(), eager_grads(eager)),
            "chunks": list(pm._chunks),
        }
        modules[name] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-2))
        modules[name][1].step()
        torch.optim.AdamW(eager.parameters(), lr=1e-2).step()
        result["state_rel"] = max_rel_diff(pm.full_state_dict(), eager.state_dict())
        batch = example_batch("gpt", BATCH, seed=2)
        with torch.no_grad():
            result["no_grad_loss"] = (pm(*batch).item(), eager(*batch).item())
        results[name] = result
    results["moved"] = _move(modules["Interleaved1F1B"], modules["ZBV"], path)
    return results


def _move(source: tuple, target: tuple, path: str) -> dict:
    """The interleaved pipeline's checkpoint (model and AdamW state) loaded into the ZBV one, whose
    ranks hold other model stages (and the tied embedding and head twice on rank 0): the same
    state, and the same next step."""
    autopar.checkpoint.save(path, *source)
    autopar.checkpoint.load(path, *target)
    moved = {"loaded": max_rel_diff(target[0].full_state_dict(), source[0].full_state_dict()), "losses": []}
    batch = example_batch("gpt", BATCH, seed=3)
    for pm, opt in (source, target):
        opt.zero_grad()
        loss = pm(*batch)
        loss.backward()
        opt.step()
        moved["losses"].append(loss.item())
    moved["stepped"] = max_rel_diff(target[0].full_state_dict(), source[0].full_state_dict())
    return moved


@pytest.mark.multiproc
def test_interleaved_and_zero_bubble_schedules_match_eager(rank_pool, tmp_path):
    plans = {name: _plan(name) for name in ("Interleaved1F1B", "ZBV")}
    for name, plan in plans.items():
        assert plan.pipeline.schedule == name and plan.pipeline.virtual_stages == 2
    results = rank_pool(4).run(
        _run, {name: plan.to_json() for name, plan in plans.items()}, str(tmp_path / "ckpt"), timeout_s=300
    )
    for rank, result in enumerate(results):
        moved = result.pop("moved")
        assert max(moved["loaded"].values()) == 0, f"rank {rank}: interleaved -> ZBV checkpoint: {moved['loaded']}"
        assert math.isclose(*moved["losses"], rel_tol=TOL), f"rank {rank}: a step after the move {moved['losses']}"
        assert max(moved["stepped"].values()) < 1e-9, f"rank {rank}: after the move and a step: {moved['stepped']}"
    assert [r["Interleaved1F1B"]["chunks"] for r in results] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [r["ZBV"]["chunks"] for r in results] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    for rank, by_name in enumerate(results):
        for name, result in by_name.items():
            where = f"rank {rank} {name}"
            assert math.isclose(*result["loss"], rel_tol=TOL), f"{where}: loss {result['loss']}"
            worst = max(result["grad_rel"], key=result["grad_rel"].get)
            assert result["grad_rel"][worst] < TOL, f"{where}: gradient of {worst} off by {result['grad_rel'][worst]:.2e}"
            worst = max(result["state_rel"], key=result["state_rel"].get)
            assert result["state_rel"][worst] < 1e-6, f"{where}: after AdamW {worst} off by {result['state_rel'][worst]:.2e}"
            assert math.isclose(*result["no_grad_loss"], rel_tol=TOL), f"{where}: no_grad {result['no_grad_loss']}"
