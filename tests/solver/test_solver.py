"""Golden plans: the solver must find the plans an expert would write, where those are clear.

Planned offline (no process group) on the h100-80g preset, so these run in one process.
"""

from __future__ import annotations

import pytest

from autopar.solver.solving import solve_ilp
import torch

import autopar
from autopar.cost.memory import param_state_bytes
from autopar.errors import InfeasibleError
from autopar.zoo.models import AttentionBlock, CausalSelfAttention, MLPBlock, WithMSELoss
from autopar.ir.spec import format_spec, transition_steps
from torch.distributed.tensor import Replicate, Shard


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
    replicated = autopar.plan(model, mesh, example_inputs=(x, y), cluster="h100-80g")
    # Too small to keep any one weight whole (with its gradient and AdamW state).
    budget = 0.35 * replicated.predicted["peak_memory_bytes"]
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
    budget = 0.3 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())
    plan = autopar.plan(model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g", memory_budget=budget)
    assert format_spec(plan.params["module.gate_up.weight"]) == ["S(0)/2"], plan.summary()
    assert plan.params["module.down.weight"] == (Shard(1),)
    assert _activation_all_reduces(plan) == [("linear_1", "broadcast_tensors")], plan.summary()
    assert len(plan.redistributions()) == 1, plan.redistributions()


def test_budget_is_respected_and_infeasible_budget_says_minimum():
    torch.manual_seed(0)
    model = WithMSELoss(MLPBlock(d=256, hidden=1024))
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    free = autopar.plan(model, (4,), example_inputs=(x, y))
    budget = 0.4 * free.predicted["peak_memory_bytes"]
    tight = autopar.plan(model, (4,), example_inputs=(x, y), memory_budget=budget)
    assert tight.predicted["peak_memory_bytes"] <= budget
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
    plan = autopar.plan(model, (2, 2), example_inputs=batch, memory_budget=0.6 * free.predicted["peak_memory_bytes"])
    assert any(spec != free.params[fqn] for fqn, spec in plan.params.items()), "the budget should change the plan"
    assert plan.params["lm_head.weight"] == plan.params["transformer.wte.weight"]
    placeholders = [n for n, p in plan.nodes.items() if n in ("p_lm_head_weight", "p_transformer_wte_weight")]
    assert len({plan.nodes[n].outs for n in placeholders}) == 1, "tied placeholders were planned apart"


def test_repeated_layers_share_one_choice_at_the_same_optimum():
    from autopar.cost.cluster import get_cluster
    from autopar.zoo.models import GPT
    from autopar.solver.choices import build_choice_graph
    from autopar.solver.ilp import ShardingILP
    from autopar.trace import trace

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
