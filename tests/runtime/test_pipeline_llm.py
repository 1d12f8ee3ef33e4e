"""Pipelines as LLM runs use them: a Hugging Face LLaMA, bf16-mixed, checkpointed layers.

ONE 4-rank job (the shared RankPool): a tiny ``LlamaForCausalLM`` built on the meta device
(``init=SeededInit`` with HF's ``_init_weights``) on mesh (2, 2), two stages of stage mesh
(1, 2), two microbatches, ``precision="bf16-mixed"``, under a memory budget 80% of what its
stages need without recomputation, so the stage planner checkpoints the layers of both stages.
Three AdamW steps against the eager model under the same policy and init
(``tests.conftest.PolicyReference``: fp32 masters cast to bf16 at use). Then a DCP save, and
the checkpoint resumed on mesh (4,) under FSDP without a pipeline (``FromCheckpoint`` and
``checkpoint.load``): exactly the saved state, the same losses as the pipeline run on, and the
same checkpoint when saved again from there; and back into a pipeline of stage mesh (2,).

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
import torch.utils._pytree as pytree
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import autopar
from tests.conftest import PolicyReference

transformers = pytest.importorskip("transformers")
from tests.zoo.hf_models import llama  # noqa: E402

MESH, STAGES, MICROBATCHES, BATCH = (2, 2), 2, 2, 8
GRAD_TOL, LOSS_TOL, STEPS, RESUMED = 0.1, 0.02, 3, 2


def _l2_rel(got: dict, want: dict) -> dict[str, float]:
    return {name: ((got[name].double() - want[name].double()).norm() / want[name].double().norm()).item() for name in want}


def _plans() -> tuple[autopar.Plan, autopar.Plan]:
    model, kwargs = llama(batch_size=BATCH)
    options = dict(example_kwargs=kwargs, cluster="cpu", pipeline=STAGES, num_microbatches=MICROBATCHES, precision="bf16-mixed")
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


def _step(module, opt, step: int) -> tuple[float, object, dict]:
    """One AdamW step of ``module`` on batch ``step``: (loss, logits, gradients before the step)."""
    _, batch = llama(batch_size=BATCH, seed=step + 1)
    out = module(**batch)
    out.loss.backward()
    grads = (
        module.full_grads()
        if hasattr(module, "full_grads")
        else {name: p.grad.clone() for name, p in module.module.named_parameters(remove_duplicate=False)}
    )
    opt.step()
    opt.zero_grad()
    return out.loss.item(), out.logits, grads


def _meta_llama() -> torch.nn.Module:
    """The tiny LLaMA built on the meta device: shapes only."""
    model, _ = llama(batch_size=BATCH)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(model.config).float().train()


def _train(rank: int, world: int, text: str, flat_text: str, back_text: str, path: str) -> dict:
    """3 steps of the pipeline (meta-built, seeded) against eager, a DCP save, 2 more steps
    uninterrupted; then the checkpoint resumed on mesh (4,) without a pipeline for those 2 steps."""
    cpu_model, kwargs = llama(batch_size=BATCH)
    meta = _meta_llama()
    init = autopar.SeededInit(seed=7, fn=meta._init_weights)  # HF's init: weights and RoPE buffers
    reference = PolicyReference(init.apply(copy.deepcopy(cpu_model)), "bf16-mixed")
    opt_ref = torch.optim.AdamW(reference.module.parameters(), lr=1e-3)
    pm = autopar.compile(meta, MESH, example_kwargs=kwargs, plan=autopar.Plan.from_json(text), init=init)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    steps = []
    for step in range(STEPS):
        loss, logits, grads = _step(pm, opt, step)
        want, _, want_grads = _step(reference, opt_ref, step)
        steps.append({"loss": (loss, want), "logits": logits, "grad_l2": _l2_rel(grads, want_grads)})
    saved = {k: v.clone() for k, v in pm.full_state_dict().items()}  # a replicated entry may be the shard itself
    state_l2 = _l2_rel(saved, reference.module.state_dict())
    autopar.checkpoint.save(path, pm, opt)
    part = pm.state_dict()
    uninterrupted = [_step(pm, opt, step)[0] for step in range(STEPS, STEPS + RESUMED)]
    eager = [_step(reference, opt_ref, step)[0] for step in range(STEPS, STEPS + RESUMED)]

    flat = autopar.compile(
        _meta_llama(),
        (4,),
        example_kwargs=kwargs,
        plan=autopar.Plan.from_json(flat_text),
        init=autopar.FromCheckpoint(path, unsaved=init),
    )
    flat_opt = torch.optim.AdamW(flat.parameters(), lr=0.1)  # the checkpoint's lr must win
    autopar.checkpoint.load(path, flat, flat_opt)
    loaded = {k: torch.equal(v, saved[k]) for k, v in flat.full_state_dict().items()}
    autopar.checkpoint.save(path + "_loaded", flat, flat_opt)  # read back by the parent: the same numbers
    lr = flat_opt.param_groups[0]["lr"]
    resumed = [_step(flat, flat_opt, step)[0] for step in range(STEPS, STEPS + RESUMED)]
    # And back into another pipeline layout: two stages of stage mesh (2,), from mesh (4,)'s checkpoint.
    autopar.checkpoint.save(path + "_flat", flat, flat_opt)
    back = autopar.compile(
        _meta_llama(),
        (4,),
        example_kwargs=kwargs,
        plan=autopar.Plan.from_json(back_text),
        init=autopar.FromCheckpoint(path + "_flat", unsaved=init),
    )
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.1)
    autopar.checkpoint.load(path + "_flat", back, back_opt)
    back_state = {k: torch.equal(v, flat.full_state_dict()[k]) for k, v in back.full_state_dict().items()}
    back_loss = (_step(back, back_opt, STEPS + RESUMED)[0], _step(flat, flat_opt, STEPS + RESUMED)[0])
    checkpointed = [n for n in pm.graph.nodes if n.op == "call_module" and str(n.target).startswith("checkpoint")]
    return {
        "steps": steps,
        "state_l2": state_l2,
        "loaded": loaded,
        "lr": lr,
        "uninterrupted": uninterrupted,
        "eager": eager,
        "resumed": resumed,
        "back_state": back_state,
        "back_loss": back_loss,
        "back_stage": back.stage_index,
        "part": sorted(part),
        "part_ranks": sorted({tuple(v.device_mesh.mesh.flatten().tolist()) for v in part.values()}),
        "param_dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
        "sent_dtypes": sorted({str(t.dtype) for t in pm._pipeline_stage._stage_meta.outputs if t.dtype.is_floating_point}),
        "checkpointed": len(checkpointed),
        "stage": pm.stage_index,
    }


def _flat_plans() -> tuple[autopar.Plan, autopar.Plan]:
    """FSDP on mesh (4,), and a pipeline of two stages of stage mesh (2,) there."""
    model, kwargs = llama(batch_size=BATCH)
    return (
        autopar.hand_plan("fsdp", model, (4,), example_kwargs=kwargs, cluster="cpu", precision="bf16-mixed"),
        autopar.plan(
            model,
            (4,),
            example_kwargs=kwargs,
            cluster="cpu",
            pipeline=STAGES,
            num_microbatches=MICROBATCHES,
            precision="bf16-mixed",
        ),
    )


def _torch_save_of(path) -> dict:
    """A whole DCP checkpoint read in this one process (model and optimizer entries)."""
    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


@pytest.mark.multiproc
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp_to_torch_save, on purpose
def test_meta_hf_llama_bf16_checkpointed_pipeline_trains_saves_and_resumes_without_pipeline(rank_pool, tmp_path):
    _, tight = _plans()
    flat, back = _flat_plans()
    assert back.pipeline.stage_mesh == (2,)
    results = rank_pool(4).run(_train, tight.to_json(), flat.to_json(), back.to_json(), str(tmp_path / "ckpt"), timeout_s=500)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    for rank, result in enumerate(results):
        assert result["checkpointed"] == 2, f"rank {rank}: each stage checkpoints its two units"
        assert result["param_dtypes"] == ["torch.float32"], "fp32 master weights"
        for step, numbers in enumerate(result["steps"]):
            assert numbers["logits"] is None, "a pipelined call returns the loss; logits stay on the last stage"
            assert math.isclose(*numbers["loss"], rel_tol=LOSS_TOL), f"rank {rank} step {step}: {numbers['loss']}"
            worst = max(numbers["grad_l2"], key=numbers["grad_l2"].get)
            assert numbers["grad_l2"][worst] < GRAD_TOL, (
                f"rank {rank} step {step}: {worst} off by {numbers['grad_l2'][worst]:.3f}"
            )
        worst = max(result["state_l2"], key=result["state_l2"].get)
        assert result["state_l2"][worst] < 0.01, (
            f"rank {rank}: after {STEPS} steps {worst} off by {result['state_l2'][worst]:.4f}"
        )
        # The pipeline's checkpoint, loaded on mesh (4,) without a pipeline: exactly the saved state,
        # the saved lr, and the same losses as the pipeline run on uninterrupted (and as eager).
        assert all(result["loaded"].values()) and len(result["loaded"]) == len(results[0]["loaded"]), result["loaded"]
        assert result["lr"] == 1e-3
        for step, (got, want, eager) in enumerate(zip(result["resumed"], result["uninterrupted"], result["eager"]), STEPS):
            assert math.isclose(got, want, rel_tol=LOSS_TOL) and math.isclose(got, eager, rel_tol=LOSS_TOL), (
                f"rank {rank} step {step}: resumed {got}, uninterrupted pipeline {want}, eager {eager}"
            )
        # And back into a pipeline of another layout: the same state, and the same next step.
        assert result["back_stage"] == rank // 2
        assert all(result["back_state"].values()) and len(result["back_state"]) == len(result["loaded"])
        assert math.isclose(*result["back_loss"], rel_tol=LOSS_TOL), result["back_loss"]
    # pm.state_dict() is each rank's stage's part, as DTensors on its stage mesh.
    assert results[0]["part"] == results[1]["part"] and results[2]["part"] == results[3]["part"]
    assert not set(results[0]["part"]) & set(results[2]["part"])
    assert "model.embed_tokens.weight" in results[0]["part"] and "lm_head.weight" in results[2]["part"]
    assert [r["part_ranks"] for r in results] == [[(0, 1)], [(0, 1)], [(2, 3)], [(2, 3)]]
    assert results[0]["sent_dtypes"] == ["torch.bfloat16"], "stage 0 sends its activations (and a bool mask) in the compute dtype"
    # Saved again from mesh (4,): the same checkpoint, optimizer moments and param groups included.
    first, again = _torch_save_of(tmp_path / "ckpt"), _torch_save_of(tmp_path / "ckpt_loaded")
    flat_first, flat_again = (dict(pytree.tree_leaves_with_path(d)) for d in (first, again))
    assert flat_first.keys() == flat_again.keys() and any("exp_avg_sq" in str(k) for k in flat_first)
    for key, value in flat_first.items():
        same = torch.equal(value, flat_again[key]) if isinstance(value, torch.Tensor) else value == flat_again[key]
        assert same, f"{key}: differs after a pipeline -> mesh (4,) -> save round trip"
