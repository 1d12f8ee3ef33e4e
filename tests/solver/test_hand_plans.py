"""Hand plans: the layouts they prescribe, and autopar never predicted slower than any of them."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost.cluster import get_cluster
from autopar.errors import InfeasibleError
from autopar.ir.options import PlanOptions
from autopar.solver import solve
from autopar.solver.planners.hand_plans import KINDS, hand_specs, zero_stage
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch

MESH = (2, 2)


@pytest.fixture(scope="module")
def plans(meta_gpt_and_batch):
    model, batch = meta_gpt_and_batch
    return {kind: autopar.hand_plan(kind, model, MESH, example_inputs=batch, cluster="cpu") for kind in KINDS}


def test_each_kind_lays_out_parameters_as_prescribed(plans):
    q, proj, ln = "transformer.h.0.attn.q_proj.weight", "transformer.h.1.mlp.c_proj.weight", "transformer.h.0.ln_1.weight"
    assert all(spec == (Replicate(), Replicate()) for spec in plans["ddp"].params.values())
    assert plans["fsdp"].params[q] == (Shard(0), Shard(0))
    assert plans["megatron"].params[q] == (Replicate(), Shard(0)), "column parallel on the inner axis"
    assert plans["megatron"].params[proj] == (Replicate(), Shard(1)), "row parallel on the inner axis"
    assert plans["megatron"].params[ln] == (Replicate(), Replicate())
    assert plans["tp_fsdp"].params[q] == (Shard(0), Shard(0)), "FSDP outside, TP inside"
    assert plans["tp_fsdp"].params[proj] == (Shard(0), Shard(1))
    assert plans["megatron_sp"].params == plans["megatron"].params
    assert plans["zero1"].params == plans["zero2"].params == plans["ddp"].params


def test_tp_fsdp_pads_dim_0_over_a_data_parallel_axis_that_divides_no_dim_of_the_tp_piece(meta_gpt_and_batch):
    """On (3, 2) no dim of the 256-wide GPT divides by 3: FSDP2 pads dim 0 there, beside TP's cut
    of dim 1 (row parallel, and whatever TP leaves whole); a column-parallel weight, whose dim 0 TP
    cuts, stays whole on the data-parallel axis (a pad inside TP's cut is not a padded shard)."""
    from autopar.ir.spec import padded_axis

    model, batch = meta_gpt_and_batch
    mesh = (3, 2)
    plan = autopar.hand_plan("tp_fsdp", model, mesh, example_inputs=batch, cluster="cpu")
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    proj, q, ln = "transformer.h.1.mlp.c_proj.weight", "transformer.h.0.attn.q_proj.weight", "transformer.h.0.ln_1.weight"
    assert plan.params[proj] == (Shard(0), Shard(1)) and padded_axis(shapes[proj], plan.params[proj], mesh) == 0
    assert plan.params[ln] == (Shard(0), Replicate()) and padded_axis(shapes[ln], plan.params[ln], mesh) == 0
    assert plan.params[q][1] == Shard(0) and padded_axis(shapes[q], plan.params[q], mesh) is None


def test_zero_shards_optimizer_state_then_gradients_at_ddp_speed(meta_gpt_and_batch, plans):
    ddp, zero1, zero2 = (plans[k].predicted for k in ("ddp", "zero1", "zero2"))
    ways = MESH[0] * MESH[1]
    for zero in (zero1, zero2):
        # ZeRO-1/2 move DDP's all-reduce bytes, and each rank steps AdamW on its 1/ways of the
        # state (cost.optimizer; the parameters and gradients it reads are whole under ZeRO-1)
        assert zero.step_time_s - zero.optimizer_s == pytest.approx(ddp.step_time_s - ddp.optimizer_s)
        assert ddp.optimizer_s / ways < zero.optimizer_s < ddp.optimizer_s
    # fp32 parameters (tied ones once); AdamW keeps two fp32 states per element.
    params_bytes = 4 * sum(p.numel() for p in meta_gpt_and_batch[0].parameters())
    assert ddp.peak_memory_bytes - zero1.peak_memory_bytes == pytest.approx(2 * params_bytes * (1 - 1 / ways), rel=1e-6)
    # Optimizer state lives through the whole step, so ZeRO-1 lowers the liveness peak by exactly
    # its split (above). Gradients exist only from their backward on, so ZeRO-2 lowers it by the
    # gradients alive at the peak: something, and at most all of them split.
    saved = zero1.peak_memory_bytes - zero2.peak_memory_bytes
    assert 0 < saved <= params_bytes * (1 - 1 / ways) * (1 + 1e-9)
    assert zero2.memory_at_peak_bytes["grad"] <= params_bytes / ways * (1 + 1e-9)


def test_sequence_parallel_splits_the_residual_stream_along_the_sequence(plans):
    sp, tp = plans["megatron_sp"], plans["megatron"]
    residual = [n for n, p in sp.nodes.items() if p.op == "aten.add.Tensor" and len(p.shapes[0]) == 3]
    assert residual and all(sp.nodes[n].outs[0] == (Shard(0), Shard(1)) for n in residual)
    assert sp.predicted.peak_memory_bytes < tp.predicted.peak_memory_bytes, "SP keeps 1/TP of those activations"


def test_tp_dp_is_megatron_on_two_axes(meta_gpt_and_batch, plans):
    model, batch = meta_gpt_and_batch
    tp_dp = autopar.hand_plan("tp_dp", model, MESH, example_inputs=batch, cluster="cpu")
    assert tp_dp.to_json() == plans["megatron"].to_json()


@pytest.mark.parametrize("cluster", ["cpu", "h100-80g"])
def test_autopar_is_never_predicted_slower_than_a_hand_plan(meta_gpt_and_batch, plans, cluster):
    model, batch = meta_gpt_and_batch
    auto = autopar.plan(model, MESH, example_inputs=batch, cluster=cluster)
    ddp = plans["ddp"] if cluster == "cpu" else autopar.hand_plan("ddp", model, MESH, example_inputs=batch, cluster=cluster)
    for kind in KINDS:
        # ``plans`` are these hand plans on "cpu", made once for the module
        hand = plans[kind] if cluster == "cpu" else autopar.hand_plan(kind, model, MESH, example_inputs=batch, cluster=cluster)
        # The ILP prices the AdamW step of each parameter's placement (solver.problem.optimizer_terms),
        # but no layout of autopar's shards the state of a replicated parameter as ZeRO-1/2 do:
        # against those it may lose the share of DDP's step that they shard, and no more.
        allowance = ddp.predicted.optimizer_s - hand.predicted.optimizer_s if zero_stage(kind) else 0.0
        assert auto.predicted.step_time_s <= (hand.predicted.step_time_s + allowance) * (1 + 1e-9), kind


def test_autopar_is_never_predicted_slower_than_a_hand_plan_with_the_optimizer_step(meta_gpt_and_batch, plans):
    model, batch = meta_gpt_and_batch
    auto = autopar.plan(model, MESH, example_inputs=batch, cluster="cpu")
    slower = [kind for kind in KINDS if auto.predicted.step_time_s > plans[kind].predicted.step_time_s * (1 + 1e-9)]
    assert not slower, f"hand plans predicted faster than autopar's: {slower}"


def test_under_a_budget_autopar_still_wins_over_every_feasible_hand_plan(meta_gpt_and_batch, plans):
    model, batch = meta_gpt_and_batch
    # Below autopar's free plan (0.73 of DDP's peak) and above the leanest plan (0.50: the
    # liveness peak counts backward temporaries that no sharding of parameters removes), so that
    # DDP and Megatron do not fit and FSDP and tp_fsdp (0.58) do.
    budget = 0.6 * plans["ddp"].predicted.peak_memory_bytes
    auto = autopar.plan(model, MESH, example_inputs=batch, cluster="cpu", memory_budget=budget)
    assert auto.predicted.peak_memory_bytes <= budget
    feasible = 0
    for kind in KINDS:
        try:
            hand = autopar.hand_plan(kind, model, MESH, example_inputs=batch, cluster="cpu", memory_budget=budget)
        except InfeasibleError:
            continue
        feasible += 1
        assert auto.predicted.step_time_s <= hand.predicted.step_time_s * (1 + 1e-9), kind
    assert feasible >= 2, "the budget should leave some hand plans feasible"


def test_unknown_kind_names_the_kinds(meta_gpt_and_batch):
    model, batch = meta_gpt_and_batch
    with pytest.raises(ValueError, match="ddp, zero1, zero2, fsdp, megatron, megatron_sp, tp_fsdp, ep_fsdp, tp_dp"):
        autopar.hand_plan("zero9", model, MESH, example_inputs=batch)


@pytest.mark.parametrize("kind", ["fsdp", "tp_fsdp", "megatron_sp"])
def test_hand_plans_on_a_mesh_with_a_size_one_axis_shard_only_the_other(meta_gpt_and_batch, kind):
    # A pipeline stage's mesh, or (1, 4): axis 0 carries only R, and the plan still shards on axis 1.
    from autopar.solver.planners.hand_plans import hand_specs
    from autopar.trace import trace

    model, batch = meta_gpt_and_batch
    specs = hand_specs(kind, trace(model, batch), (1, 4))
    assert all(isinstance(spec[0], Replicate) for spec in specs.values())
    assert any(isinstance(spec[1], Shard) for spec in specs.values())
    plan = autopar.hand_plan(kind, model, (1, 4), example_inputs=batch, cluster="cpu")
    assert all(isinstance(p, Replicate) for node in plan.nodes.values() for spec in node.ins + node.outs for p in spec[:1])


def test_a_hand_plan_that_fits_no_budget_alone_is_checkpointed_when_allowed():
    """Forced specs (a hand plan's parameters) whose leanest layout misses the budget get
    checkpointing when it is allowed (as bench_quality compares them), and stay an error when
    it is not."""
    model = build_model("gpt", n_layer=4)
    traced = trace(model, example_batch("gpt", 64, n_layer=4))
    cluster, mesh = get_cluster("cpu"), (4,)
    forced = hand_specs("fsdp", traced, mesh)
    budget = 0.6 * solve(traced, mesh, cluster, forced=forced).predicted.peak_memory_bytes
    with pytest.raises(InfeasibleError, match="forced specs"):
        solve(traced, mesh, cluster, PlanOptions.from_keywords(memory_budget=budget, checkpointing=False), forced=forced)
    plan = solve(traced, mesh, cluster, PlanOptions.from_keywords(memory_budget=budget, checkpointing=True), forced=forced)
    assert plan.memory is not None and plan.memory.checkpoint
    assert plan.predicted.peak_memory_bytes <= budget
    for name, spec in forced.items():
        assert plan.nodes[name].outs[0] == spec


@pytest.fixture(scope="module")
def torchtitan_8b():
    """torchtitan's Llama 3.1 8B FSDP job (benchmarks/llama3_h100_202412_torchtitan.md): local
    batch 2 × 8192 on 8 H100s with 96 GB, bf16; planned offline on the meta device."""
    import dataclasses

    from autopar.zoo.models import LLAMA_SHAPES

    with torch.device("meta"):
        model = build_model("llama", **LLAMA_SHAPES["llama-3-8b"])
    idx = torch.zeros(16, 8192, dtype=torch.long, device="meta")
    cluster = dataclasses.replace(get_cluster("h100-80g"), name="h100-96g", memory_bytes=96 * 10**9)
    return model, (idx, idx), cluster


def test_a_hand_plan_with_checkpointing_fits_where_one_without_cannot(torchtitan_8b):
    model, batch, cluster = torchtitan_8b
    kwargs = dict(example_inputs=batch, cluster=cluster, memory_budget=96e9, precision="bf16-mixed")
    with pytest.raises(InfeasibleError):
        autopar.hand_plan("fsdp", model, (8,), **kwargs)
    plan = autopar.hand_plan("fsdp", model, (8,), checkpointing="selective", **kwargs)
    segments = plan.memory.checkpoint
    assert len(segments) == 32 and {s.policy for s in segments} == {"selective"}, "the policy on every layer"
    assert plan.predicted.peak_memory_bytes <= 96e9 < plan.memory.peak_before_bytes
    assert all(spec == (Shard(0),) for fqn, spec in plan.params.items() if fqn.endswith("proj.weight")), "still FSDP"
    # torchtitan measured 82.4 GiB (Table 1, 8 GPUs); the issue asks for the peak within 15%.
    assert plan.predicted.peak_memory_bytes / (82.4 * 2**30) == pytest.approx(1.0, abs=0.15)
    # Whole-layer recompute saves more and costs more than selective; torchtitan's own op-level
    # policy ("selective-op", priced against its runs in benchmarks/bench_calibration.py) lies
    # between them.
    full = autopar.hand_plan("fsdp", model, (8,), checkpointing="full", **kwargs)
    assert full.predicted.peak_memory_bytes < plan.predicted.peak_memory_bytes
    assert full.predicted.step_time_s > plan.predicted.step_time_s
    titan = autopar.hand_plan("fsdp", model, (8,), checkpointing="selective-op", **kwargs)
    assert {s.policy for s in titan.memory.checkpoint} == {"selective-op"} and len(titan.memory.checkpoint) == 32
    assert full.predicted.peak_memory_bytes < titan.predicted.peak_memory_bytes < plan.predicted.peak_memory_bytes
    assert plan.predicted.step_time_s < titan.predicted.step_time_s < full.predicted.step_time_s


@pytest.mark.parametrize("mesh", [(3,), (6,), (48,)])
def test_fsdp_shards_dim_0_padded_on_a_world_size_that_divides_nothing(monkeypatch, mesh):
    """FSDP2 runs on any world size: with padded shards planned, the fsdp hand plan shards every
    parameter's dim 0 (its pieces padded to ceil(n / k) rows, some empty on 48 ranks) where no
    dim divides; with them off, such parameters stay replicated."""
    from autopar.ir import spec as spec_module
    from tests.conftest import WideNet

    model = WideNet()
    batch = (torch.randn(6, 64), torch.randint(0, 2, (6,)))
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", False)
    off = autopar.hand_plan("fsdp", model, mesh, example_inputs=batch, cluster="cpu")
    assert all(spec == (Replicate(),) for spec in off.params.values()), off.params
    monkeypatch.setattr(spec_module, "PADDED_PARAM_SHARDS", True)
    on = autopar.hand_plan("fsdp", model, mesh, example_inputs=batch, cluster="cpu")
    params = {fqn: spec for fqn, spec in on.params.items() if fqn != "scale"}  # (a buffer: never padded)
    assert len(params) == 4 and all(spec == (Shard(0),) for spec in params.values()), on.params
    assert on.params["scale"] == (Replicate(),)
    assert on.predicted.memory_at_peak_bytes["param"] < off.predicted.memory_at_peak_bytes["param"]
