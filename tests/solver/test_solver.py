"""Golden plans: the solver must find the plans an expert would write, where those are clear.

Planned offline (no process group) on the h100-80g preset, so these run in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost.memory import param_state_bytes
from autopar.errors import InfeasibleError
from autopar.ir.spec import format_spec, transition_steps
from autopar.solver.search.solving import solve_ilp
from autopar.zoo.models import AttentionBlock, CausalSelfAttention, MLPBlock, WithMSELoss


def _activation_all_reduces(plan: autopar.Plan) -> list[tuple[str, str]]:
    """Forward all-reduces of non-scalar tensors: (producer, consumer) per all-reduce step."""
    found = []
    for producer, consumer, src, dst in plan.redistributions():
        shape = plan.nodes[producer].shapes[0] if plan.nodes[producer].shapes else ()
        for step in transition_steps(src, dst) or ():
            if step.kind == "all_reduce" and len(shape) > 0:
                found.append((producer, consumer))
    return found


def test_batch_heavy_with_ample_memory_is_data_parallel():
    # A million tokens through a small block: planned on the meta device, nothing allocated.
    with torch.device("meta"):
        model = WithMSELoss(MLPBlock(d=256, hidden=1024))
        x, y = torch.randn(1 << 20, 256), torch.randn(1 << 20, 256)
    plan = autopar.plan(model, (2, 4), example_inputs=(x, y), cluster="h100-80g")
    for fqn, spec in plan.params.items():
        assert spec == (Replicate(), Replicate()), f"{fqn} should be replicated under DP, got {spec}"
    for name in ("linear", "linear_1"):
        assert plan.nodes[name].outs[0] == (Shard(0), Shard(0)), f"{name}: batch not sharded over both axes"
    assert _activation_all_reduces(plan) == [], "DP moves no activations"


def _megatron_plan(model: torch.nn.Module, x: torch.Tensor, mesh=(4,)) -> autopar.Plan:
    y = torch.randn_like(x)
    replicated = autopar.hand_plan("ddp", model, mesh, example_inputs=(x, y), cluster="h100-80g")
    # Too small to keep any one weight whole (with its gradient and AdamW state). (Without a
    # budget these small batches already go Megatron: its AdamW step is a quarter of DDP's.)
    budget = 0.35 * replicated.predicted.peak_memory_bytes
    return autopar.plan(model, mesh, example_inputs=(x, y), cluster="h100-80g", memory_budget=budget)


def test_tight_budget_small_batch_mlp_gets_megatron_split():
    torch.manual_seed(0)
    model = WithMSELoss(MLPBlock(d=1024, hidden=4096))
    plan = _megatron_plan(model, torch.randn(8, 1024))
    assert plan.params["module.fc1.weight"] == (Shard(0),), "fc1 should be column-parallel"
    assert plan.params["module.fc1.bias"] == (Shard(0),)
    assert plan.params["module.fc2.weight"] == (Shard(1),), "fc2 should be row-parallel"
    assert len(_activation_all_reduces(plan)) == 1, plan.summary()


def test_tight_budget_small_batch_attention_gets_megatron_split():
    torch.manual_seed(0)
    model = WithMSELoss(AttentionBlock(n_embd=1024, n_head=16))
    plan = _megatron_plan(model, torch.randn(2, 4, 1024))
    for proj in ("q_proj", "k_proj", "v_proj"):
        assert plan.params[f"module.attn.{proj}.weight"] == (Shard(0),), f"{proj} should be split by heads"
    assert plan.params["module.attn.c_proj.weight"] == (Shard(1),), "c_proj should be row-parallel"
    assert len(_activation_all_reduces(plan)) == 1, plan.summary()


def test_tight_budget_fused_qkv_is_split_by_heads_with_a_strided_shard():
    # One Linear makes q, k and v, then split(n_embd). Megatron cuts its weight so that each rank
    # holds its own heads' q, k and v: the strided shard S(0)/3. Between c_attn and c_proj no
    # collective runs; the block's only all-reduce follows the row-parallel c_proj.
    torch.manual_seed(0)
    model = WithMSELoss(CausalSelfAttention(1024, 16, fused_qkv=True))
    plan = _megatron_plan(model, torch.randn(2, 4, 1024))
    assert format_spec(plan.params["module.c_attn.weight"]) == ["S(0)/3"], plan.summary()
    assert format_spec(plan.params["module.c_attn.bias"]) == ["S(0)/3"]
    assert plan.params["module.c_proj.weight"] == (Shard(1),), "c_proj should be row-parallel"
    c_attn, c_proj = "linear", "linear_1"
    between = list(plan.nodes)[list(plan.nodes).index(c_attn) : list(plan.nodes).index(c_proj) + 1]
    moved = [(p, c) for p, c, _, _ in plan.redistributions() if c in between and plan.nodes[p].op != "param"]
    assert moved == [], f"collectives inside the attention block: {moved}\n{plan.summary()}"
    assert _activation_all_reduces(plan) == [(c_proj, "broadcast_tensors")], plan.summary()


class _FusedSwiGLU(torch.nn.Module):
    """A SwiGLU MLP with gate and up fused into one Linear, then chunked (Phi-3's layout)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_up = torch.nn.Linear(d, 2 * hidden, bias=False)
        self.down = torch.nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(torch.nn.functional.silu(gate) * up)


def test_tight_budget_fused_gate_up_is_split_with_a_strided_shard():
    torch.manual_seed(0)
    model = WithMSELoss(_FusedSwiGLU(1024, 4096))
    x = torch.randn(8, 1024)
    # room for a quarter of each parameter, gradient and AdamW state, and the foreach step's temporary
    # (a quarter of the state again: 0.3125), not for one replicated weight
    budget = 0.35 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())
    plan = autopar.plan(model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g", memory_budget=budget)
    assert format_spec(plan.params["module.gate_up.weight"]) == ["S(0)/2"], plan.summary()
    assert plan.params["module.down.weight"] == (Shard(1),)
    assert _activation_all_reduces(plan) == [("linear_1", "broadcast_tensors")], plan.summary()
    assert len(plan.redistributions()) == 1, plan.redistributions()


def test_a_budget_the_optimizer_step_breaks_names_its_temporary():
    model = WithMSELoss(_FusedSwiGLU(1024, 4096))
    x = torch.randn(8, 1024)
    # a quarter of each parameter, gradient and AdamW state fits, the foreach step's temporary does not
    budget = 0.3 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())
    with pytest.raises(InfeasibleError, match="at the optimizer step") as caught:
        autopar.plan(model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g", memory_budget=budget)
    assert "optimizer_temporary" in str(caught.value) and "foreach AdamW" in str(caught.value)
    # on CPU ranks torch's AdamW steps one parameter at a time: the same budget fits
    autopar.plan(model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="cpu", memory_budget=budget)


def test_budget_is_respected_and_infeasible_budget_says_minimum():
    torch.manual_seed(0)
    model = WithMSELoss(MLPBlock(d=256, hidden=1024))
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    free = autopar.plan(model, (4,), example_inputs=(x, y))
    budget = 0.4 * free.predicted.peak_memory_bytes
    tight = autopar.plan(model, (4,), example_inputs=(x, y), memory_budget=budget)
    assert tight.predicted.peak_memory_bytes <= budget
    with pytest.raises(InfeasibleError, match="leanest plan needs"):
        autopar.plan(model, (4,), example_inputs=(x, y), memory_budget=1000)


def test_solve_is_deterministic():
    torch.manual_seed(0)
    model = WithMSELoss(MLPBlock(d=64, hidden=256))
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    first = autopar.plan(model, (2, 2), example_inputs=(x, y), cluster="cpu").to_json()
    second = autopar.plan(model, (2, 2), example_inputs=(x, y), cluster="cpu").to_json()
    assert first == second


def test_tied_weights_get_one_spec_even_under_a_tight_budget():
    from autopar.zoo.models import build_model, example_batch

    model = build_model("gpt", seed=0)
    batch = example_batch("gpt", 8, seed=1)
    free = autopar.plan(model, (2, 2), example_inputs=batch)
    # A budget tight enough that the tied weight itself must be sharded (the ILP prices each
    # parameter's gradient reduction once, bucketed: at 0.6 of the free peak, splitting the
    # batch alone fits, and the tie would hold trivially with both names replicated).
    plan = autopar.plan(model, (2, 2), example_inputs=batch, memory_budget=0.25 * free.predicted.peak_memory_bytes)
    assert any(spec != free.params[fqn] for fqn, spec in plan.params.items()), "the budget should change the plan"
    assert any(not p.is_replicate() for p in plan.params["lm_head.weight"]), plan.params["lm_head.weight"]
    assert plan.params["lm_head.weight"] == plan.params["transformer.wte.weight"]
    placeholders = [n for n, p in plan.nodes.items() if n in ("p_lm_head_weight", "p_transformer_wte_weight")]
    assert len({plan.nodes[n].outs for n in placeholders}) == 1, "tied placeholders were planned apart"


def test_repeated_layers_share_one_choice_at_the_same_optimum():
    from autopar.cost.cluster import get_cluster
    from autopar.solver.problem.choices import build_choice_graph
    from autopar.solver.problem.ilp import ShardingILP
    from autopar.trace import trace
    from autopar.zoo.models import GPT

    def solve(n_layer: int, share: bool):
        with torch.device("meta"):
            model = GPT(vocab_size=512, block_size=64, n_layer=n_layer, n_head=4, n_embd=128, bias=False)
            idx = torch.zeros(8, 64, dtype=torch.long)
        graph = build_choice_graph(trace(model, (idx, idx)), (2, 2), get_cluster("cpu"), share_layers=share)
        return graph, solve_ilp(ShardingILP(graph))

    tied_graph, tied = solve(3, True)
    _, untied = solve(3, False)
    assert tied_graph.layer_template, "the blocks of a GPT should be recognised as repeated layers"
    assert tied.objective_s == pytest.approx(untied.objective_s, rel=1e-9)
    assert tied.num_variables < untied.num_variables
    _, deeper = solve(6, True)
    assert deeper.num_variables == tied.num_variables, "the problem must not grow with depth"


def test_layers_tie_when_the_first_reads_another_producer_than_the_rest():
    """A Hugging Face LLaMA layer starts with a follower of its input: the embedding for layer 0,
    the previous layer's residual add for the others. With a vocabulary of 132 on mesh (4, 2)
    the embedding cannot be (P, P) (132 / 8 is not whole) while the add can, so the followers'
    lists differed and no layer was tied (54k variables at 2 layers, 103k at 4). Layer
    boundaries are now real edges: every layer ties, at the untied optimum."""
    transformers = pytest.importorskip("transformers")
    from autopar.cost.cluster import get_cluster
    from autopar.solver.problem.choices import build_choice_graph
    from autopar.solver.problem.ilp import ShardingILP
    from autopar.trace import trace

    def graph(num_layers: int, share: bool = True):
        config = transformers.LlamaConfig(
            vocab_size=132,
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=num_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=16,
            use_cache=False,
            attn_implementation="sdpa",
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=2,
        )
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
        traced = trace(model, (), {"input_ids": ids, "labels": ids.clone()})
        return build_choice_graph(traced, (4, 2), get_cluster("cpu"), share_layers=share)

    two, four = graph(2), graph(4)
    assert len(four.layer_template) == 3 * len(set(four.layer_template.values())) > 0, "every later layer is tied"
    assert ShardingILP(two).size()[0] == ShardingILP(four).size()[0], "the ILP must not grow with depth"
    tied, untied = solve_ilp(ShardingILP(two)), solve_ilp(ShardingILP(graph(2, share=False)))
    assert tied.objective_s == pytest.approx(untied.objective_s, rel=1e-9)


def test_the_device_memory_is_the_default_budget():
    """memory_budget=None plans within the cluster's memory less its reserve; inf plans without."""
    import dataclasses

    from autopar.cost.cluster import get_cluster
    from autopar.zoo.models import GPT, example_batch

    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
    batch = example_batch("gpt", 8, seed=1)
    free = autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu", memory_budget=float("inf"))
    assert free.solver.memory_budget_bytes is None
    peak = free.predicted.peak_memory_bytes
    small = dataclasses.replace(get_cluster("cpu"), memory_bytes=int(peak / 0.9 * 0.8), name="small")
    plan = autopar.plan(model, (2, 2), example_inputs=batch, cluster=small)
    assert plan.solver.memory_budget_bytes == small.default_memory_budget < peak
    assert plan.predicted.peak_memory_bytes <= small.default_memory_budget


def test_mixed_precision_prices_bf16_compute_and_fp32_state_and_reductions():
    """DDP of an fp32 GPT under bf16-mixed: parameters, gradients, AdamW state and the gradient
    all-reduces cost what they do in fp32; activations half as much. Under bf16-true the
    reductions halve too. The plan records its policy.

    A batch of 16, so that every plan splits it and communicates (with 8 the fp32 and bf16 plans
    once all stayed whole, and equal communication meant 0 == 0)."""
    from autopar.zoo.models import build_model, example_batch

    model, batch = build_model("gpt", seed=0), example_batch("gpt", 16, seed=1)
    plans = {
        p: autopar.hand_plan("ddp", model, (2,), example_inputs=batch, cluster="cpu", precision=p)
        for p in ("32-true", "bf16-mixed", "bf16-true")
    }
    fp32, mixed, true16 = (plans[p].predicted for p in ("32-true", "bf16-mixed", "bf16-true"))
    assert plans["bf16-mixed"].precision.name == "bf16-mixed" and plans["32-true"].precision.param_dtype is None
    for plan in plans.values():
        assert plan.nodes["cross_entropy_loss"].ins[0] == (Shard(0),), plan.summary()
    assert fp32.comm_bytes > 0
    # Parameter gradients are reduced in fp32 under bf16-mixed; the activations' traffic halves.
    assert mixed.grad_sync_s == pytest.approx(fp32.grad_sync_s, rel=1e-9)
    assert true16.comm_bytes < mixed.comm_bytes < fp32.comm_bytes
    # ...and every byte halves under bf16-true: the loss's own all-reduce (its sum and
    # denominator, float64 under every policy: ops.parallel.cross_entropy_mean) sends no bytes
    # of its own on this 1-D mesh, where it rides the data check (op_prices.rides_data_check)
    assert true16.comm_bytes == pytest.approx(fp32.comm_bytes / 2, rel=1e-6)
    at_fp32, at_mixed = fp32.memory_at_peak_bytes, mixed.memory_at_peak_bytes
    assert at_mixed["param"] == at_fp32["param"] and at_mixed["optimizer_state"] == at_fp32["optimizer_state"]
    assert 0 < mixed.peak_memory_bytes < fp32.peak_memory_bytes
    assert mixed.compute_s < fp32.compute_s, "bf16 runs at the cluster's bf16 FLOP/s"
    assert autopar.Plan.from_json(plans["bf16-mixed"].to_json()).precision == plans["bf16-mixed"].precision


def test_a_bf16_model_without_a_policy_prices_adamw_state_in_bf16():
    """torch's AdamW keeps its moments in the dtype of what it steps: a bf16 model stepped as it
    is ("32-true" changes no dtype) holds two bf16 moments per parameter (twice the parameters'
    bytes), not two fp32 ones; under "bf16-mixed" it steps fp32 masters, whose moments are fp32."""
    from autopar.zoo.models import build_model, example_batch

    model, batch = build_model("gpt", seed=0).to(torch.bfloat16), example_batch("gpt", 8, seed=1)
    as_is = autopar.hand_plan("ddp", model, (1,), example_inputs=batch, cluster="cpu").predicted.memory_at_peak_bytes
    assert as_is["optimizer_state"] == pytest.approx(2 * as_is["param"], rel=1e-9)
    mixed = autopar.hand_plan("ddp", model, (1,), example_inputs=batch, cluster="cpu", precision="bf16-mixed")
    masters = mixed.predicted.memory_at_peak_bytes
    assert masters["param"] == pytest.approx(2 * as_is["param"], rel=1e-9), "fp32 masters of bf16 weights"
    assert masters["optimizer_state"] == pytest.approx(4 * as_is["param"], rel=1e-9)
