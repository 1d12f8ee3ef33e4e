"""Mixture of experts: the experts layer traced as one op, its rule, its kernels and its plans.

- The traced op computes what Hugging Face's Mixtral experts and the zoo's ``Experts`` compute
  (forward and gradients), and a module it does not compute is traced as it is.
- The plain rows of the rule are checked by simulation; each kernel equals the op without
  groups; every kernel runs on in-process ranks (the numerics guard) against eager.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar.cost.cluster import get_cluster
from autopar.ops import get_kernel
from autopar.rules.moe import EXPERT_PARALLEL_KERNELS
from autopar.rules.simulate import check_op
from autopar.runtime.tools.numerics import check_numerics
from autopar.solver import solve
from autopar.trace import trace
from autopar.trace.moe import EXPERTS_OP, experts_as_one_op, is_stacked_experts, moe_experts_eager
from autopar.zoo.models import Experts, build_model, example_batch
from tests.conftest import strategy_text

NUM_EXPERTS, HIDDEN, INTER, TOKENS, TOP_K = 4, 8, 6, 12, 2


def _routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(TOKENS, NUM_EXPERTS, generator=generator).softmax(-1)
    weights, index = scores.topk(TOP_K, dim=-1)
    return index, weights / weights.sum(-1, keepdim=True)


def _experts_args(seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    index, weights = _routing(seed)
    return dict(
        hidden=torch.randn(TOKENS, HIDDEN, generator=generator),
        top_k_index=index,
        top_k_weights=weights,
        gate_up=torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=generator),
        down=torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=generator),
        transposed=False,
    )


def _tiny_moe():
    model = build_model("moe", n_embd=32, hidden=64, num_experts=4, vocab_size=64)
    return model, example_batch("moe", 8, vocab_size=64)


# --------------------------------------------------------------------------------------------
# The traced op


def test_op_equals_the_zoo_experts_module_forward_and_gradients() -> None:
    torch.manual_seed(0)
    module = Experts(NUM_EXPERTS, HIDDEN, INTER)
    args = _experts_args()
    hidden = args["hidden"].requires_grad_()
    weights = args["top_k_weights"].requires_grad_()
    want = module(hidden, args["top_k_index"], weights)
    grads_want = torch.autograd.grad(want.square().sum(), [hidden, weights, module.gate_up_proj, module.down_proj])
    # The custom op (whose autograd recomputes) and its eager implementation.
    for fn in (torch.ops.autopar.moe_experts, moe_experts_eager):
        got = fn(hidden, args["top_k_index"], weights, module.gate_up_proj, module.down_proj, False)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.square().sum(), [hidden, weights, module.gate_up_proj, module.down_proj])
        for g, w in zip(grads, grads_want):
            torch.testing.assert_close(g, w)


def test_hf_mixtral_and_the_zoo_moe_trace_their_experts_as_one_op() -> None:
    from tests.zoo.hf_models import mixtral

    hf, kwargs = mixtral(batch_size=2)
    zoo, batch = _tiny_moe()
    for model, args, kw in ((hf, (), kwargs), (zoo, batch, {})):
        targets = [str(n.target) for n in trace(model, args, kw).gm.graph.nodes if n.op == "call_function"]
        assert targets.count(str(EXPERTS_OP)) == 2, targets
        assert not any("grouped_mm" in t or "histc" in t for t in targets), targets
        assert "forward" not in vars(model.model.layers[0].mlp.experts), "the patched forward must be undone"
    # Swapping the HF module's forward for the op changes nothing (HF's eager runs grouped_mm).
    reference = copy.deepcopy(hf)
    loss_want = reference(**kwargs).loss
    loss_want.backward()
    with experts_as_one_op(hf) as names:
        assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        loss = hf(**kwargs).loss
        loss.backward()
    torch.testing.assert_close(loss, loss_want)
    want = dict(reference.named_parameters())
    for name, param in hf.named_parameters():
        torch.testing.assert_close(param.grad, want[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_experts_the_op_does_not_compute_are_traced_as_they_are() -> None:
    module = Experts(NUM_EXPERTS, HIDDEN, INTER)
    assert is_stacked_experts(module)
    for change in ("gelu", "bias", "norm"):
        other = copy.deepcopy(module)
        if change == "gelu":
            other.act_fn = torch.nn.GELU()
        elif change == "bias":
            other.has_bias = True
        else:
            other.has_post_expert_norm = True
        assert not is_stacked_experts(other), change


# --------------------------------------------------------------------------------------------
# Rule and kernels


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
def test_moe_rule_plain_rows_simulate_and_kernel_rows_split_experts(mesh) -> None:
    args = _experts_args()
    results = check_op(EXPERTS_OP, (), args, mesh, atol=1e-4)
    bad = [f"{strategy_text(r.strategy)}: {r.detail}" for r in results if not r.ok]
    assert not bad, "\n".join(bad)
    kernels = {r.strategy.kernel for r in results}
    assert {"moe_experts_all_to_all", "moe_experts_local"} <= kernels
    for result in results:
        strategy = result.strategy
        if strategy.kernel is None:
            continue
        for axis in strategy.kernel_axes:  # experts split by expert on every axis of the kernel
            assert strategy.ins[3][axis] == Shard(0) and strategy.ins[4][axis] == Shard(0), strategy_text(strategy)
        if strategy.kernel == "moe_experts_all_to_all":
            assert len(strategy.kernel_axes) == 1, "the all-to-all runs over one mesh axis"


def test_moe_kernels_equal_the_op_without_groups() -> None:
    args = _experts_args()
    want = moe_experts_eager(**args)
    for name in ("moe_experts_all_to_all", "moe_experts_local"):
        torch.testing.assert_close(get_kernel(name)(axis_groups=(), **args), want)
    rows = torch.randn(10, HIDDEN)
    weight = torch.randn(NUM_EXPERTS, HIDDEN, INTER)
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)
    got = get_kernel("grouped_mm_local_experts")(axis_groups=(), input=rows, weight=weight, offs=offs)
    starts = [0, 3, 3, 7]
    want_mm = torch.cat([rows[s:e] @ weight[i] for i, (s, e) in enumerate(zip(starts, offs.tolist()))])
    torch.testing.assert_close(got, want_mm)
    assert {"moe_experts_all_to_all", "moe_experts_local", "grouped_mm_local_experts"} == EXPERT_PARALLEL_KERNELS


def _forced_ep_plan(model, batch, mesh, kernel):
    """A plan with the expert weights stored split by expert on the last mesh axis, and each
    experts op pinned to ``kernel`` (``moe_experts_all_to_all``: tokens split, the all-to-all;
    ``moe_experts_local``: tokens whole, partial sums). Pinning the op's output alone is not
    enough: with tokens split the solver may gather the experts whole instead (FSDP-style)."""
    traced = trace(model, batch)
    forced = {}
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder" and node.name.endswith(("gate_up_proj", "down_proj")):
            forced[node.name] = (Replicate(),) * (len(mesh) - 1) + (Shard(0),)
        if node.target is EXPERTS_OP:
            forced[node.name] = kernel
    return solve(traced, mesh, get_cluster("cpu"), forced=forced)


@pytest.mark.parametrize("kernel", ["moe_experts_all_to_all", "moe_experts_local"], ids=["all_to_all", "replicated_tokens"])
def test_numerics_guard_runs_expert_parallel_plans_equal_to_eager(kernel) -> None:
    model, batch = _tiny_moe()
    plan = _forced_ep_plan(model, batch, (2, 2), kernel)
    chosen = {d.kernel for d in plan.nodes.values() if d.op == str(EXPERTS_OP)}
    assert chosen == {kernel}
    result = check_numerics(model, plan, batch)
    assert result.ok, result.text()
    assert {fqn for fqn in result.grad_rel if "experts" in fqn or "mlp.gate" in fqn} == {
        f"model.layers.{i}.mlp.{name}" for i in range(2) for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
    }
