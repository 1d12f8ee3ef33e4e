"""A plan given to compile is checked against the model (``passes.plan_check``): hand edits
that no strategy allows are refused naming the node, the placement and what is allowed;
plans the solver wrote pass."""

from __future__ import annotations

import json
import operator

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.cost.memory import param_state_bytes
from autopar.errors import PlanError
from autopar.passes.plan_check import check_plan_strategies
from autopar.runtime.agreement import resolve_plan
from autopar.runtime.tools.numerics import check_numerics
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch

MESH = (2, 2)
WEIGHT = "transformer.h.0.mlp.c_fc.weight"


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    model = build_model("gpt").double()
    batch = example_batch("gpt", 8)
    plan = autopar.plan(model, MESH, example_inputs=batch, cluster="cpu")
    return model, batch, plan, trace(model, batch)


def _edited(plan: autopar.Plan, edit) -> autopar.Plan:
    data = json.loads(plan.to_json())
    edit(data)
    return autopar.Plan.from_json(json.dumps(data))


@pytest.mark.parametrize("name", ["gpt", "llama", "moe", "cnn"])
def test_plans_the_solver_wrote_pass(name):
    torch.manual_seed(0)
    model, batch = build_model(name), example_batch(name, 8)
    traced = trace(model, batch)
    tight = 0.6 * sum(param_state_bytes(p.shape, p.dtype, (), ()) for p in model.parameters())
    for budget in (float("inf"), tight) if name in ("gpt", "moe") else (float("inf"),):
        plan = autopar.plan(model, MESH, example_inputs=batch, cluster="cpu", memory_budget=budget)
        check_plan_strategies(autopar.Plan.from_json(plan.to_json()), traced)


def test_a_pipelined_plan_passes(gpt):
    model, batch, _, traced = gpt
    plan = autopar.plan(model, MESH, example_inputs=batch, cluster="cpu", pipeline=2)
    check_plan_strategies(autopar.Plan.from_json(plan.to_json()), traced)


def test_a_weight_edited_from_replicated_to_sharded_is_refused_before_it_runs(gpt):
    model, batch, _, traced = gpt
    # DDP's layout, where the weight is replicated (the solver's plan may shard it: it prices the
    # optimizer step that sharding saves)
    plan = autopar.hand_plan("ddp", model, MESH, example_inputs=batch, cluster="cpu")
    assert plan.params[WEIGHT] == plan.nodes["p_" + WEIGHT.replace(".", "_")].outs[0] == (Replicate(), Replicate())

    def edit(data):
        data["params"][WEIGHT] = ["S(0)", "R"]

    with pytest.raises(PlanError, match=rf"parameter '{WEIGHT}' has placements \(S\(0\), R\).*Allowed: \(R, R\)"):
        resolve_plan(_edited(plan, edit), traced, MESH, None, None)


def test_an_op_edited_to_a_strategy_its_rule_lacks_is_refused(gpt):
    _, _, plan, traced = gpt
    name = next(n for n, d in plan.nodes.items() if d.op.endswith("linear.default"))

    def edit(data):
        data["nodes"][name]["out"] = [["S(1)", "S(1)"]]

    with pytest.raises(PlanError, match=rf"node '{name}' .*-> out \(S\(1\), S\(1\)\), which no strategy.*Allowed: in "):
        check_plan_strategies(_edited(plan, edit), traced)


def test_a_getitem_that_does_not_pass_its_producers_placement_on_is_refused():
    torch.manual_seed(0)
    model, batch = build_model("llama"), example_batch("llama", 8)
    traced = trace(model, batch)
    plan = autopar.plan(model, MESH, example_inputs=batch, cluster="cpu")
    name = next(n.name for n in traced.gm.graph.nodes if n.target is operator.getitem and n.name in plan.nodes)

    def edit(data):
        data["nodes"][name]["out"] = [["R", "R"] if data["nodes"][name]["out"][0] != ["R", "R"] else ["S(0)", "R"]]
        data["nodes"][name]["in"] = data["nodes"][name]["out"]

    with pytest.raises(PlanError, match=rf"node '{name}' \(output \d+ of .*passes its producer's placement on"):
        check_plan_strategies(_edited(plan, edit), traced)


def test_tied_parameters_that_disagree_are_refused(gpt):
    _, _, plan, traced = gpt
    fqn, canonical = next((f, c) for f, c in traced.ties.items() if f != c)
    assert fqn in plan.params and canonical in plan.params

    def edit(data):
        data["params"][fqn] = ["R", "S(0)"] if data["params"][canonical] != ["R", "S(0)"] else ["R", "R"]

    with pytest.raises(PlanError, match=rf"'{fqn}' and '{canonical}' are one tensor \(tied\).*Allowed: one placement"):
        check_plan_strategies(_edited(plan, edit), traced)


def test_a_consistent_edit_passes_and_equals_eager(gpt):
    model, batch, plan, traced = gpt
    name = "p_" + WEIGHT.replace(".", "_")

    def edit(data):
        data["params"][WEIGHT] = ["S(0)", "R"]
        data["nodes"][name]["out"] = [["S(0)", "R"]]

    edited = _edited(plan, edit)
    check_plan_strategies(edited, traced)
    result = check_numerics(model, edited, batch)
    assert result.ok, result.text()


def test_a_whole_grad_the_rule_does_not_give_is_refused(gpt):
    _, _, plan, traced = gpt
    name = next(n for n, d in plan.nodes.items() if d.op.endswith("linear.default") and not d.whole_grad)

    def edit(data):  # would skip the weight's gradient all-reduce on mesh axis 0
        data["nodes"][name]["whole_grad"] = [[1, 0]]

    with pytest.raises(PlanError, match=rf"node '{name}' .*which no strategy of its rule allows"):
        check_plan_strategies(_edited(plan, edit), traced)
