"""Hugging Face models (transformers 5.x) built from tiny configs: traced, planned, compiled.

The multi-process test compiles GPT-2 and LLaMA on mesh (2, 2) over 4 gloo ranks, once with no
memory budget and once with a budget that no plan keeping every parameter whole can meet, and
compares the loss and every gradient with eager PyTorch. One spawn serves every check.
"""

from __future__ import annotations

import copy
import math
import operator

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.cost.cluster import get_cluster
from autopar.cost.memory import param_state_bytes
from autopar.ir.options import PlanOptions
from autopar.ir.spec import SS, format_spec
from autopar.rules.registry import node_strategies, op_info
from autopar.solver import solve
from autopar.solver.planners.traced import plan_traced
from autopar.trace import trace
from tests.conftest import collective_counts, eager_grads, step_against_eager
from tests.solver.test_objective_price import assert_objective_is_step_time
from tests.zoo.hf_models import BUILDERS, COVERAGE

MESH = (2, 2)
CLUSTER = "cpu"  # the machine the ranks run on; on h100-80g prices these models stay replicated
AMPLE_BATCH = 32  # large enough that the cpu preset finds tensor parallelism worth its all-reduces
TIGHT_BATCH = 4  # small, so that parameters (not activations) dominate memory
TOL = 1e-4


def tight_budget(name: str) -> float:
    """90% of the replicated parameters' own bytes (with gradients and AdamW state): no plan
    that keeps every parameter whole fits, so the plan must shard parameters."""
    model, _ = {**BUILDERS, **COVERAGE}[name](batch_size=TIGHT_BATCH)
    return 0.9 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())


def gpt2_head_split_plan(model, kwargs, budget: float):
    """GPT-2's plan under ``budget`` with each c_attn matmul's output pinned split by heads
    (``S(1)/3``: every rank holds its heads of q, k and v), the rest left to the solver."""
    traced = trace(model, (), kwargs)
    forced = {
        node.name: (Replicate(), SS(1, 3))
        for node in traced.gm.graph.nodes
        if node.target is torch.ops.aten.addmm.default and any("c_attn_weight" in arg.name for arg in node.all_input_nodes)
    }
    assert len(forced) == 2, forced
    options = PlanOptions.from_keywords(memory_budget=budget, solver="highs", checkpointing=False)
    return solve(traced, MESH, get_cluster(CLUSTER), options, forced=forced)


@pytest.fixture(scope="module")
def gpt2_head_split() -> autopar.Plan:
    """GPT-2 (batch ``TIGHT_BATCH``) with c_attn split by heads under 80% of its replicated
    parameters' state, solved once: pinned by the test below, run on gloo ranks above."""
    model, kwargs = BUILDERS["gpt2"](batch_size=TIGHT_BATCH)
    return gpt2_head_split_plan(model, kwargs, head_split_budget())


def head_split_budget() -> float:
    """80% of GPT-2's replicated parameters' state (``tight_budget`` is 90%)."""
    return 0.8 * tight_budget("gpt2") / 0.9


def _compile_and_compare(name: str, batch_size: int, budget: float | None, plan: str | None = None, padded_rows: int = 0) -> dict:
    """Plan (or take ``plan``, a plan's JSON), compile and run one step of ``name`` on this rank;
    with ``padded_rows``, an ``attention_mask`` that pads the last rows of the batch (left padding)."""
    model, kwargs = {**BUILDERS, **COVERAGE}[name](batch_size=batch_size)
    if padded_rows:
        mask = torch.ones_like(kwargs["input_ids"])
        mask[-padded_rows:, :3] = 0
        kwargs = {**kwargs, "attention_mask": mask}
    eager = copy.deepcopy(model)
    plan = None if plan is None else autopar.Plan.from_json(plan)
    pm = autopar.compile(
        model, MESH, example_kwargs=kwargs, cluster=CLUSTER, plan=plan, memory_budget=None if plan is not None else budget
    )
    compared = step_against_eager(pm, eager, kwargs=kwargs, output_loss=lambda out: out.loss)
    grads = eager_grads(eager)
    scale = max(g.abs().max().item() for g in grads.values())
    return {
        # Parameters whose gradient is zero in exact arithmetic (an attention key bias: softmax
        # is unchanged by adding the same number to every score) hold rounding noise in both
        # runs, so their relative error means nothing.
        "zero_grad": sorted(fqn for fqn, g in grads.items() if g.abs().max().item() < 1e-6 * scale),
        **compared,
        "collectives": collective_counts(pm),
        "params": {fqn: format_spec(spec) for fqn, spec in pm.plan.params.items()},
        "local_param_bytes": pm.local_param_bytes(),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in eager.parameters()),
        "plan_hash": pm.plan.hash,
        "masked_calls": _masked_calls(pm, kwargs),
    }


def _masked_calls(pm, kwargs: dict) -> list[bool]:
    """Whether each of this rank's attention calls passed a mask (``ops.causal_mask``: a mask
    from the batch is kept only where this rank's rows pad)."""
    from tests.trace.test_attention_compiled import _SdpaCalls

    with torch.no_grad(), _SdpaCalls() as calls:
        pm(**kwargs)
    return calls.masks


def _run(rank: int, world: int, budgets: dict[str, float], head_split: str) -> dict:
    results = {}
    for name in BUILDERS:
        results[name] = _compile_and_compare(name, AMPLE_BATCH, None)
        results[f"{name}_tight"] = _compile_and_compare(name, TIGHT_BATCH, budgets[name])
    # Encoder (masked LM), vision and mixture-of-experts models train too, under a tight budget
    # (with memory to spare the cpu preset keeps these tiny models replicated).
    for name in COVERAGE:
        results[f"{name}_tight"] = _compile_and_compare(name, TIGHT_BATCH, budgets[name])
    # LLaMA with the batch's last rows padded: a rank whose rows pad nothing attends causally,
    # the others with the mask (``ops.causal_mask``), and together they train as eager.
    results["llama_padded"] = _compile_and_compare("llama", AMPLE_BATCH, None, padded_rows=AMPLE_BATCH // 4)
    # GPT-2 with c_attn split by heads (strided shards: strided gathers, chunks and local splits).
    results["gpt2_heads"] = _compile_and_compare("gpt2", TIGHT_BATCH, None, plan=head_split)
    return results


def _worst_gradient(grad_rel: dict[str, float], zero: set[str]) -> tuple[str, float]:
    """The largest relative gradient error among parameters whose gradient is not zero."""
    return max(((fqn, err) for fqn, err in grad_rel.items() if fqn not in zero), key=lambda item: item[1])


@pytest.mark.multiproc
def test_hf_models_match_eager_on_mesh_2x2_with_ample_and_tight_budgets(rank_pool, gpt2_head_split) -> None:
    budgets = {name: tight_budget(name) for name in {**BUILDERS, **COVERAGE}}
    results = rank_pool(math.prod(MESH)).run(_run, budgets, gpt2_head_split.to_json(), timeout_s=1200)
    for rank, by_label in enumerate(results):
        for label, result in by_label.items():
            got, want = result["loss"]
            assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {label}: loss {got} vs eager {want}"
            worst, error = _worst_gradient(result["grad_rel"], set(result["zero_grad"]))
            assert error < TOL, f"rank {rank} {label}: gradient of {worst} off by {error:.2e}"
            assert all("key.bias" in fqn or "k_proj.bias" in fqn for fqn in result["zero_grad"]), result["zero_grad"]
            assert result["plan_hash"] == results[0][label]["plan_hash"], f"rank {rank} {label}: plan differs"
    for name in budgets:
        tight = results[0][f"{name}_tight"]
        assert tight["local_param_bytes"] < tight["full_param_bytes"], f"{name}: tight budget, nothing sharded"
        sharded = [fqn for fqn, spec in tight["params"].items() if any(p.startswith("S") for p in spec)]
        assert sharded, f"{name}: no parameter sharded under a tight budget: {tight['params']}"
        assert tight["collectives"], f"{name}: a sharded plan must communicate"
    # With c_attn pinned split by heads GPT-2's fused c_attn weight is a strided shard, so the
    # ranks above ran strided gathers, chunks and local splits against eager.
    strided = [fqn for fqn, spec in results[0]["gpt2_heads"]["params"].items() if any("/" in p for p in spec)]
    assert any("c_attn.weight" in fqn for fqn in strided), results[0]["gpt2_heads"]["params"]
    padded = [any(by_label["llama_padded"]["masked_calls"]) for by_label in results]
    assert any(padded) and not all(padded), f"the batch's padded rows on some ranks only: {padded}"
    # GPT-2's MLP is worth tensor parallelism on the cpu preset even with memory to spare.
    assert results[0]["gpt2"]["collectives"], "gpt2: the ample plan should shard on the cpu preset"


# --------------------------------------------------------------------------------------------
# Coverage beyond GPT-2 and LLaMA: single process, planning only.

COVERAGE_MESH = (4,)


@pytest.fixture(scope="module")
def coverage_plans() -> dict:
    plans = {}
    for name, build in COVERAGE.items():
        model, kwargs = build(batch_size=4)
        traced = trace(model, (), kwargs)
        plans[name] = (traced, plan_traced(traced, COVERAGE_MESH, get_cluster(CLUSTER), PlanOptions()))
    return plans


def _fallback_nodes(traced) -> dict[str, str]:
    """Node → op for every op that neither our rules nor DTensor's registry cover, found by
    asking the rule registry directly (independently of the solver)."""
    found = {}
    for node in traced.gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        strategies = node_strategies(op_info(node), COVERAGE_MESH)
        if all(s.source == "fallback" for s in strategies):
            found[node.name] = str(node.target)
    return found


@pytest.mark.parametrize("name", list(COVERAGE))
def test_encoder_vision_and_moe_models_trace_and_plan(coverage_plans, name) -> None:
    traced, plan = coverage_plans[name]
    assert set(plan.params) >= {i.fqn for i in traced.placeholders("param")}
    assert plan.solver.status == "Optimal"
    summary = plan.summary()
    for node in plan.solver.fallbacks:
        assert node in summary, f"{name}: fallback {node} missing from the summary"


def test_fallbacks_are_counted_replicated_and_listed_in_the_summary(coverage_plans) -> None:
    # Mixtral has the most op kinds of these (routing: topk, sort, histc, index_put, a custom
    # grouped-matmul op from transformers). Its causal mask's ops (diff, cumsum, index, le, ...)
    # are gone since ``trace.attention`` turns the mask back into is_causal: 32 kinds remain.
    traced, plan = coverage_plans["mixtral"]
    kinds = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert len(kinds) >= 30, f"expected a model with many op kinds, got {len(kinds)}"
    expected = _fallback_nodes(traced)
    assert expected, "Mixtral's routing has ops with no rule; the test needs some"
    got = {name: node.op for name, node in plan.nodes.items() if node.source == "fallback"}
    assert got == expected
    assert sorted(plan.solver.fallbacks) == sorted(expected)
    for name in expected:
        node = plan.nodes[name]
        assert all(isinstance(p, Replicate) for spec in node.ins + node.outs for p in spec), (
            f"fallback {name} must replicate every input and output: {node}"
        )
    summary = plan.summary()
    num_ops = len(set(expected.values()))
    nodes, ops = f"node{'s' * (len(expected) != 1)}", f"op{'s' * (num_ops != 1)}"
    assert f"Fallbacks (replicated, no rule): {len(expected)} {nodes} of {num_ops} {ops}" in summary
    for name, op in expected.items():
        line = next(l for l in summary.splitlines() if l.strip().startswith(f"{op} x"))
        assert name in line.split(": ", 1)[1].split(", "), f"{name} not listed under {op}: {line}"


def test_gpt2_c_attn_split_by_heads_runs_with_no_collective_before_c_proj(gpt2_head_split) -> None:
    # GPT-2's c_attn is a Conv1D: addmm with weight [n_embd, 3 n_embd], then split(n_embd). Split
    # by heads (S(1)/3 on a mesh axis) as Megatron does, q, k and v are each rank's own, and
    # nothing but parameters should move between c_attn and c_proj: the weight is used S(1)/3 (not
    # gathered whole and the product chunked) and c_proj is row-parallel.
    # The split is pinned on c_attn's output. Until the ILP priced each parameter's gradient
    # reduction once, at its bucketed price, the MILP chose this layout by itself under a budget of
    # 80% of the replicated parameters' state; under that price it stores c_attn sharded and gathers
    # it whole (FSDP-style). Which of the two is faster on this tiny model is a cost-model question
    # (the lead's note records it); that the head split, when chosen, moves nothing is what this
    # test pins, and the multi-process test above runs it against eager.
    plan = gpt2_head_split
    assert plan.predicted.peak_memory_bytes <= head_split_budget()
    order = list(plan.nodes)
    for layer in range(2):
        weight = f"p_transformer_h_{layer}_attn_c_attn_weight"
        c_attn = next(n for n, d in plan.nodes.items() if d.op == "aten.addmm.default" and any(p == weight for p, _ in d.inputs))
        c_proj = next(
            n
            for n, d in plan.nodes.items()
            if d.op == "aten.addmm.default" and any(p == f"p_transformer_h_{layer}_attn_c_proj_weight" for p, _ in d.inputs)
        )
        used = format_spec(plan.nodes[c_attn].ins[[p for p, _ in plan.nodes[c_attn].inputs].index(weight)])
        assert "S(1)/3" in used, f"layer {layer}: c_attn's matmul takes its weight as {used}, not split by heads"
        block = order[order.index(c_attn) + 1 : order.index(c_proj) + 1]
        moved = [(p, c) for p, c, _, _ in plan.redistributions() if c in block and plan.nodes[p].op != "param"]
        assert moved == [], f"layer {layer}: collectives between c_attn and c_proj: {moved}"


def test_tight_budget_gpt2_objective_is_the_predicted_step() -> None:
    """The ILP objective and the re-priced plan price GPT-2's tight plan the same (they once
    differed 2.3x: the ILP merged every parameter reduction, the re-pricing only some)."""
    model, kwargs = BUILDERS["gpt2"](batch_size=TIGHT_BATCH)
    budget = 0.8 * tight_budget("gpt2") / 0.9
    plan = autopar.plan(
        model, MESH, example_kwargs=kwargs, cluster=CLUSTER, memory_budget=budget, checkpointing=False, solver="highs"
    )
    assert_objective_is_step_time(plan)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_default_configs_with_use_cache_trace_and_the_plan_says_the_cache_is_dropped(name) -> None:
    """Configs default to use_cache=True, which makes forward return a key/value cache object that
    export cannot return. autopar traces with the cache off and says so in the plan's notes."""
    model, kwargs = BUILDERS[name](batch_size=4, use_cache=True)
    assert model.config.use_cache is True
    traced = trace(model, (), kwargs)
    assert "past_key_values" not in str(traced.out_spec), traced.out_spec
    assert model.config.use_cache is True, "tracing must leave the user's config as it was"
    plan = autopar.plan(model, (2,), example_kwargs=kwargs, cluster=CLUSTER)
    assert any("use_cache=True" in note and "past_key_values" in note for note in plan.notes), plan.notes
    assert autopar.Plan.from_json(plan.to_json()).notes == plan.notes
    assert "note: " in plan.summary()
    with pytest.raises(autopar.TraceError, match="use_cache"):
        trace(model, (), {**kwargs, "use_cache": True})
