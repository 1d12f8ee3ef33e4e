"""The optimizer step in the sharding ILP (``solver.problem.optimizer_terms``): each parameter's
placement prices the AdamW step of its shard, with the rates the reported ``optimizer_s`` uses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost import optimizer
from autopar.cost.cluster import get_cluster
from autopar.solver.problem.choices import build_choice_graph
from autopar.trace import trace
from autopar.zoo.models import MLPBlock, WithMSELoss
from tests.conftest import gpt_and_batch


def _graph(cluster, mesh=(4,), **kwargs):
    model, batch = gpt_and_batch()
    return build_choice_graph(trace(model, batch), mesh, cluster, **kwargs)


def test_each_parameter_pays_the_step_of_its_shard():
    cluster = dataclasses.replace(get_cluster("cpu-gloo"), compute_slots_per_node=2)
    graph = _graph(cluster)
    params = [name for name, choice in graph.choices.items() if choice.kind == "param" and choice.requires_grad]
    tied = {member for group in graph.ties for member in group[1:]}
    assert set(graph.optimizer_s) == set(params) - tied, "every trained parameter once (a tied one by its first name)"
    name = next(n for n in graph.optimizer_s if len(graph.choices[n].strategies) > 1)
    choice, step_s = graph.choices[name], graph.optimizer_s[name]
    whole = choice.strategies.index(next(s for s in choice.strategies if all(p == Replicate() for p in s.outs[0])))
    split = next(i for i, s in enumerate(choice.strategies) if any(isinstance(p, Shard) for p in s.outs[0]))
    # fp32 AdamW: the parameter and both moments read and written, the gradient read (2·P + G + 2·S = 7·P)
    fused = 7 * choice.priced[whole].memory_bytes
    assert step_s[whole] == pytest.approx(optimizer.tensor_step_s(fused, cluster, "for-loop", (4,)))
    assert step_s[split] == pytest.approx(step_s[whole] / 4), "a shard on 4 ranks steps a quarter"


def test_zero_stages_split_the_state_and_gradient_terms():
    cluster = get_cluster("h100-80g")
    ddp = _graph(cluster, mesh=(2,))
    forced = {name: (Replicate(),) for name, choice in ddp.choices.items() if choice.kind == "param"}
    zero1 = _graph(cluster, mesh=(2,), forced=forced, zero_stage=1)
    zero2 = _graph(cluster, mesh=(2,), forced=forced, zero_stage=2)
    name = next(iter(zero1.optimizer_s))
    size = zero1.choices[name].priced[0].memory_bytes
    per_byte = optimizer.tensor_step_s(1.0, cluster, "foreach")
    assert zero1.optimizer_s[name][0] == pytest.approx(per_byte * (2 + 1 + 2 * 2 / 2) * size)  # half of both moments
    assert zero2.optimizer_s[name][0] == pytest.approx(per_byte * (2 + 1 / 2 + 2 * 2 / 2) * size)  # and of the gradient


@pytest.mark.parametrize("cluster", ["cpu", "h100-80g"])
def test_the_ilp_prices_the_step_the_plan_reports(cluster):
    # The objective's optimizer terms at the solved choice are the plan's optimizer_s (these
    # steps are bandwidth-bound: no list kernels' floor), so the ILP and the plan agree.
    model, batch = gpt_and_batch()
    plan = autopar.plan(model, (2, 2), example_inputs=batch, cluster=cluster, solver="highs")
    p = plan.predicted
    post_solve, hidden = p.grad_schedule["post_solve_s"], p.grad_sync_s - p.exposed_grad_sync_s
    # what the objective holds in place of the whole gathers and reductions where NCCL overlaps them
    overlap = p.grad_schedule.get("overlap_s", 0.0)
    assert ("overlap_s" in p.grad_schedule) == (cluster != "cpu")
    assert p.optimizer_s > 0
    assert plan.solver.objective_s - overlap + post_solve - hidden == pytest.approx(p.step_time_s, rel=1e-6)
    assert plan.solver.objective_s - overlap + post_solve == pytest.approx(
        p.compute_s + p.reshard_s + p.grad_sync_s + p.optimizer_s, rel=1e-6
    )


def test_a_step_bound_job_shards_what_the_optimizer_steps():
    # A small batch through a large MLP: AdamW over its 8.4M fp32 weights takes longer than
    # forward and backward; Megatron's split steps a quarter of them for one small all-reduce.
    torch.manual_seed(0)
    model = WithMSELoss(MLPBlock(d=1024, hidden=4096))
    x = torch.randn(8, 1024)
    auto = autopar.plan(model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g")
    ddp = autopar.hand_plan("ddp", model, (4,), example_inputs=(x, torch.randn_like(x)), cluster="h100-80g")
    assert auto.params["module.fc1.weight"] == (Shard(0),) and auto.params["module.fc2.weight"] == (Shard(1),)
    assert auto.predicted.optimizer_s == pytest.approx(ddp.predicted.optimizer_s / 4, rel=0.05)
    assert auto.predicted.step_time_s < ddp.predicted.step_time_s


def _cpu_gloo():
    return dataclasses.replace(get_cluster("cpu-gloo"), compute_slots_per_node=2)


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_dtensor_parameters_pay_the_dispatch_once_in_the_ilp_and_the_plan(kind):
    # Sharding any parameter makes the runtime hold them all as DTensors (runtime.module), and
    # torch's AdamW then dispatches each of its ops through DTensor: one price D for the plan,
    # the d variable of the ILP, and the same seconds in the plan's optimizer_s.
    cluster = _cpu_gloo()
    assert cluster.dtensor_op_s > 0, "the cpu-gloo preset measured DTensor's dispatch"
    model, batch = gpt_and_batch()
    plan = autopar.hand_plan(kind, model, (2,), example_inputs=batch, cluster=cluster)
    graph = _graph(cluster, mesh=(2,))
    stepped = len(graph.optimizer_s)
    dispatch = optimizer.dtensor_dispatch_s(stepped, cluster, (2,))
    assert graph.dtensor_step_s == pytest.approx(dispatch) and dispatch == pytest.approx(stepped * 8 * cluster.dtensor_op_s)
    sharded = kind == "fsdp"
    assert optimizer.holds_dtensors(plan.params.values()) is sharded
    p = plan.predicted
    post_solve, hidden = p.grad_schedule["post_solve_s"], p.grad_sync_s - p.exposed_grad_sync_s
    assert plan.solver.objective_s + post_solve - hidden == pytest.approx(p.step_time_s, rel=1e-6)
    plain = sum(graph.optimizer_s[name][0] for name in graph.optimizer_s)  # every parameter replicated
    if sharded:
        assert p.optimizer_s > dispatch
    else:
        assert p.optimizer_s == pytest.approx(plain)


def test_a_pipeline_stage_holds_plain_parameters():
    from autopar.solver.planners.stage_costs import build_stage_graph

    model, batch = gpt_and_batch()
    assert build_stage_graph(trace(model, batch), (2,), _cpu_gloo()).dtensor_step_s == 0.0


def test_explain_prices_the_dispatch_a_decision_would_bring():
    # A DDP plan on CPU ranks: sharding any one parameter would bring DTensor's dispatch to the
    # whole step, so every runner-up that shards pays it, and the chosen replicas stay cheapest.
    from autopar.solver.pricing.runner_ups import explain_decisions
    from autopar.solver.problem.ilp import ShardingILP
    from autopar.solver.search.solving import solve_ilp

    cluster = _cpu_gloo()
    graph = _graph(cluster, mesh=(2,))
    solution = solve_ilp(ShardingILP(graph))
    decisions = explain_decisions(graph, solution, cluster, None)
    params = [r for r in decisions.values() if r.get("fqns")]
    assert params and all(r["binding"] == "cost" for r in params)
    sharding = [c for r in params for c in r["candidates"][1:] if any(p != "R" for spec in c["out"] for p in spec)]
    assert sharding and all(c["optimizer_s"] >= graph.dtensor_step_s for c in sharding)
