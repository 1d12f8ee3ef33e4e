"""Pipelines as LLM runs use them: a Hugging Face LLaMA, bf16-mixed, checkpointed layers.

ONE 4-rank job (the shared RankPool): a tiny ``LlamaForCausalLM`` on mesh (2, 2), two stages
of stage mesh (1, 2), two microbatches, ``precision="bf16-mixed"``, under a memory budget 80%
of what its stages need without recomputation, so the stage planner checkpoints the layers of
both stages. Three AdamW steps against the eager model under the same policy
(``tests.conftest.PolicyReference``: fp32 masters cast to bf16 at use).

Tolerances are those of tests/runtime/test_precision.py: in bf16 two correct evaluations of one
gradient differ by a few percent per tensor (here the pipeline sums two microbatches, and the
stage mesh shards over its second axis), so each gradient tensor must be within 10% (L2) of the
reference, where a lost or doubled reduction or a microbatch counted twice is off by 50% or
more, and the loss (fp32, from bf16 logits) within 2%.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from tests.conftest import PolicyReference

transformers = pytest.importorskip("transformers")
from tests.zoo.hf_models import llama  # noqa: E402

MESH, STAGES, MICROBATCHES, BATCH = (2, 2), 2, 2, 8
GRAD_TOL, LOSS_TOL, STEPS = 0.1, 0.02, 3


def _l2_rel(got: dict, want: dict) -> dict[str, float]:
    return {name: ((got[name].double() - want[name].double()).norm() / want[name].double().norm()).item()
            for name in want}


def _plans() -> tuple[autopar.Plan, autopar.Plan]:
    model, kwargs = llama(batch_size=BATCH)
    options = dict(example_kwargs=kwargs, cluster="cpu", pipeline=STAGES, num_microbatches=MICROBATCHES,
                   precision="bf16-mixed")
    free = autopar.plan(model, MESH, **options)
    budget = 0.8 * max(stage.memory_bytes for stage in free.pipeline.stages)
    return free, autopar.plan(model, MESH, memory_budget=budget, **options)


def test_the_planner_checkpoints_stages_under_a_tight_budget():
    free, tight = _plans()
    assert free.predicted.recompute == (False, False) and free.memory is None
    assert tight.predicted.recompute == (True, True), tight.predicted
    budget = 0.8 * max(stage.memory_bytes for stage in free.pipeline.stages)
    assert max(stage.memory_bytes for stage in tight.pipeline.stages) <= budget
    names = [segment.name for segment in tight.memory.checkpoint]
    assert names == ["pre", "model.layers.0", "model.layers.1", "post"], names
    assert tight.pipeline.stages[0].time_s > free.pipeline.stages[0].time_s, "recomputation costs time"
    assert tight.precision.name == "bf16-mixed"


def _train(rank: int, world: int, text: str) -> dict:
    model, kwargs = llama(batch_size=BATCH)
    reference = PolicyReference(copy.deepcopy(model), "bf16-mixed")
    pm = autopar.compile(model, MESH, example_kwargs=kwargs, plan=autopar.Plan.from_json(text))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.module.parameters(), lr=1e-3)
    steps = []
    for step in range(STEPS):
        _, batch = llama(batch_size=BATCH, seed=step + 1)
        out = pm(**batch)
        out.loss.backward()
        want = reference(**batch)
        want.loss.backward()
        grads = {name: p.grad for name, p in reference.module.named_parameters(remove_duplicate=False)}
        steps.append({"loss": (out.loss.item(), want.loss.item()), "logits": out.logits,
                      "grad_l2": _l2_rel(pm.full_grads(), grads)})
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    checkpointed = [n for n in pm.graph.nodes if n.op == "call_module" and str(n.target).startswith("checkpoint")]
    return {"steps": steps, "state_l2": _l2_rel(pm.full_state_dict(), reference.module.state_dict()),
            "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
            "sent_dtypes": sorted({str(t.dtype) for t in pm._pipeline_stage._stage_meta.outputs if t.dtype.is_floating_point}),
            "checkpointed": len(checkpointed), "stage": pm.stage_index}


@pytest.mark.multiproc
def test_hf_llama_bf16_checkpointed_pipeline_trains_like_eager(rank_pool):
    _, tight = _plans()
    results = rank_pool(4).run(_train, tight.to_json(), timeout_s=400)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        assert result["checkpointed"] == 2, f"rank {rank}: each stage checkpoints its two units"
        assert result["param_dtypes"] == ["torch.float32"], "fp32 master weights"
        for step, numbers in enumerate(result["steps"]):
            assert numbers["logits"] is None, "a pipelined call returns the loss; logits stay on the last stage"
            assert math.isclose(*numbers["loss"], rel_tol=LOSS_TOL), f"rank {rank} step {step}: {numbers['loss']}"
            worst = max(numbers["grad_l2"], key=numbers["grad_l2"].get)
            assert numbers["grad_l2"][worst] < GRAD_TOL, f"rank {rank} step {step}: {worst} off by {numbers['grad_l2'][worst]:.3f}"
        worst = max(result["state_l2"], key=result["state_l2"].get)
        assert result["state_l2"][worst] < 0.01, f"rank {rank}: after {STEPS} steps {worst} off by {result['state_l2'][worst]:.4f}"
    assert results[0]["sent_dtypes"] == ["torch.bfloat16"], "stage 0 sends its activations (and a bool mask) in the compute dtype"
