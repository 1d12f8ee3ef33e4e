"""The ILP's objective is the plan's predicted step time (single process).

The ILP prices each parameter's gradient reduction once, bucketed (``ilp.add_param_sync_variables``);
``solver.pricing.comm_schedule`` re-prices the solved plan. Both must price the same reductions: the only
terms the ILP does not carry are listed in ``predicted.grad_schedule.post_solve_s`` (one gather per
parameter, FSDP's reduce-scatter, the buckets' whole latencies) and the part of the buckets that
backward hides (``grad_sync_s - exposed_grad_sync_s``). The optimizer step (``optimizer_s``) is in
both, each parameter's at its placement (``solver.problem.optimizer_terms``). ``compute_s`` carries
no parameter gradient reduction: those are in ``grad_sync_s``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.cost.cluster import get_cluster
from autopar.zoo.models import build_model, example_batch
from tests.conftest import gpt_and_batch


def assert_objective_is_step_time(plan: autopar.Plan) -> None:
    predicted = plan.predicted
    objective = plan.solver.objective_s
    post_solve = predicted.grad_schedule["post_solve_s"]
    hidden = predicted.grad_sync_s - predicted.exposed_grad_sync_s
    # the AdamW step (``cost.optimizer``) is in the ILP's objective, parameter by parameter
    assert predicted.optimizer_s > 0
    assert predicted.step_time_s == pytest.approx(objective + post_solve - hidden, rel=1e-6)
    # Only the scheduled buckets' latency (at most one bucket's, 2(k-1)·α of the widest axis, on
    # these plans with no FSDP-style gather) is left out of the ILP's price.
    cluster = get_cluster(plan.cluster)
    latency = max(2 * (k - 1) * cluster.axis_link(plan.mesh_shape, a).latency_s for a, k in enumerate(plan.mesh_shape) if k > 1)
    assert 0.0 <= post_solve <= latency * (1 + 1e-9)
    # compute_s is compute (and activation collectives): the per-use parameter reductions,
    # which the bucketed grad_sync_s replaces, are not in it
    # and the objective's optimizer terms are the plan's optimizer_s (these plans' step is bandwidth-bound)
    assert predicted.compute_s + predicted.reshard_s + predicted.grad_sync_s + predicted.optimizer_s == pytest.approx(
        objective + post_solve, rel=1e-6
    )


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_zoo_gpt_objective_is_the_predicted_step(mesh) -> None:
    model, batch = gpt_and_batch()
    plan = autopar.plan(model, mesh, example_inputs=batch, cluster="cpu", solver="highs")
    assert plan.predicted.grad_sync_s > 0, "the plan reduces parameter gradients (ddp-like)"
    assert_objective_is_step_time(plan)


# FSDP2's default policy: bf16 compute and gradient reductions, fp32 master weights.
BF16_REDUCE = autopar.MixedPrecision("bfloat16", "bfloat16", "float32", name="bf16-reduce")


def test_bf16_reductions_are_priced_alike_by_the_ilp_and_the_plan() -> None:
    model, batch = gpt_and_batch()
    plan = autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu", solver="highs", precision=BF16_REDUCE)
    assert plan.precision.reduce_dtype == "bfloat16" and plan.predicted.grad_sync_s > 0
    assert_objective_is_step_time(plan)


def test_a_bf16_reduction_sends_half_the_bytes_of_fp32_masters() -> None:
    """DDP on 4 ranks: each parameter gradient all-reduce sends 2(k-1)/k of its bytes; in bf16
    half those of fp32, so 3 bytes per element less. The positional table is the exception: its
    gradient is reduced at the lookup's output (an activation, bf16 under both policies). The
    gradients still land in the fp32 masters, so the peak does not move."""
    config = dict(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128)
    model = build_model("gpt", seed=0, **config)
    batch = example_batch("gpt", 16, seed=1, vocab_size=1024, block_size=64)
    plans = {
        precision: autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster="cpu", precision=precision)
        for precision in ("bf16-mixed", BF16_REDUCE)
    }
    fp32, bf16 = (plans[p].predicted for p in ("bf16-mixed", BF16_REDUCE))
    reduced = sum(p.numel() for n, p in model.named_parameters() if n != "transformer.wpe.weight")
    assert fp32.comm_bytes - bf16.comm_bytes == 3 * reduced
    assert bf16.grad_sync_s < 0.6 * fp32.grad_sync_s
    assert bf16.peak_memory_bytes == fp32.peak_memory_bytes


class _Twice(torch.nn.Module):
    """One weight read by two matmuls: FSDP gathers it once for both."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(512, 512, bias=False)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.lin(torch.relu(self.lin(x))), y)


@pytest.mark.parametrize("precision, reduce_bytes", [("bf16-mixed", 4), (BF16_REDUCE, 2)])
def test_a_weight_gathered_for_two_uses_moves_param_dtype_and_reduces_reduce_dtype(precision, reduce_bytes) -> None:
    """FSDP on 4 ranks: the runtime gathers the weight once, in bf16 (the cast shards), and
    reduce-scatters its gradient in reduce_dtype; each sends 3/4 of the whole tensor's bytes.
    (The loss's all-reduce adds 3 bytes.)"""
    torch.manual_seed(0)
    model = _Twice()
    batch = (torch.randn(4096, 512), torch.randn(4096, 512))
    plan = autopar.hand_plan("fsdp", model, (4,), example_inputs=batch, cluster="cpu", precision=precision)
    assert plan.params["lin.weight"] == (Shard(0),) and plan.collective_counts()[("all_gather", 0)] == 2
    numel = model.lin.weight.numel()
    assert plan.predicted.comm_bytes == 3 * numel * 2 // 4 + 3 * numel * reduce_bytes // 4 + 3
