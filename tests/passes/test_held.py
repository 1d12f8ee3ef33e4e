"""The held-parameter pass of a pipeline (``autopar.passes.held``), on the rewritten graphs alone.

Single process: the passes only name process groups, so the graphs are built with stand-in names.
The runs that these graphs make equal to eager are in tests/runtime/test_pipeline.py.
"""

from __future__ import annotations

import copy
import functools
import json
import types

import pytest
import torch

import autopar
from autopar.ir.options import precision_policy
from autopar.ir.pipeline import first_microbatch
from autopar.ops import collectives
from autopar.passes import default_passes, run_passes
from autopar.passes.held import HeldChains, hold_param_collectives
from autopar.passes.split import return_only, split_into_stages
from autopar.runtime.pipeline import _stage_view, loss_output
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.runtime.test_pipeline import BATCH, _gpt, _plan, fsdp_in_stages


@pytest.fixture(scope="module")
def ddp() -> autopar.Plan:
    """Two stages on mesh (2, 2), four microbatches; every parameter replicated in the stages."""
    return _plan((2, 2), 2, 4)


def _rewritten(plan: autopar.Plan, model=None) -> tuple[torch.fx.GraphModule, HeldChains]:
    examples = first_microbatch(example_batch("gpt", BATCH, seed=1), None, plan.pipeline.num_microbatches)
    policy = precision_policy(plan.precision.name) if plan.precision is not None else None
    traced = trace(model if model is not None else _gpt(), *examples, policy)
    held = HeldChains(frozenset(gi.name for gi in traced.inputs if gi.kind == "param"), gathers=plan.pipeline.hold_gathered)
    passes = [
        *default_passes(("axis0", "axis1"), held=held),
        functools.partial(return_only, position=loss_output(traced)[0]),
        functools.partial(split_into_stages, stages=plan.pipeline),
    ]
    return run_passes(copy.deepcopy(traced.gm), _stage_view(plan), passes), held


def _targets(gm: torch.fx.GraphModule) -> list:
    """The call targets of every graph under ``gm``: the stages, and their checkpointed segments."""
    return [n.target for m in gm.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]


def _chain_targets(held: HeldChains) -> list:
    return [n.target for _, chain in held.chains.values() for n in chain.graph.nodes]


def test_a_replicated_parameters_gradient_sync_leaves_the_microbatch_graphs(ddp):
    split, held = _rewritten(ddp)
    assert collectives.allreduce_grad not in _targets(split)
    params = len(held.params) - 1  # the head is tied to the embedding: one tensor
    assert len({source for source, _ in held.chains.values()}) == params
    assert _chain_targets(held).count(collectives.allreduce_grad) >= params
    weight = torch.randn(4, 4)
    for _, chain in held.chains.values():
        if [n.target for n in chain.graph.nodes if n.op == "call_function"] == [collectives.allreduce_grad]:
            assert torch.equal(chain(weight), weight)  # an identity in forward: the sum is its backward's


@pytest.mark.parametrize("hold", [False, True])
def test_a_sharded_parameters_gather_pairs_with_its_reduce_scatter_and_is_held_on_demand(ddp, hold):
    data = json.loads(fsdp_in_stages(ddp.to_json(), hold))
    split, held = _rewritten(autopar.Plan.from_json(json.dumps(data)))
    in_graphs, in_chains = _targets(split), _chain_targets(held)
    sharded = sum(1 for spec in data["params"].values() if spec == ["R", "S(0)"])
    assert sharded == 24
    # every gather of a parameter is FSDP's pair (its backward a reduce-scatter, not an
    # all-reduce of the whole gradient and a chunk); held, it leaves the microbatch graphs
    assert in_graphs.count(collectives.gather_param) == (0 if hold else sharded)
    assert in_chains.count(collectives.gather_param) == (sharded if hold else 0)
    assert collectives.allreduce_grad not in in_graphs


def test_gathers_pair_under_a_precision_policy():
    # bf16-mixed leaves an unused alias of each gathered parameter and its cast after the gather:
    # the pair is made all the same, the alias dropped, and the cast gathered (FSDP2's param_dtype)
    model = build_model("gpt", seed=0, n_layer=4, bias=False)
    options = dict(example_inputs=example_batch("gpt", BATCH, seed=1), cluster="cpu", pipeline=2, num_microbatches=4)
    plan = autopar.plan(model, (2, 2), precision="bf16-mixed", **options)
    split, _ = _rewritten(autopar.Plan.from_json(fsdp_in_stages(plan.to_json(), hold=False)), model)
    targets = _targets(split)
    assert targets.count(collectives.gather_cast_param) == 24 and collectives.gather_param not in targets
    gathered = [n for m in split.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    assert not [n for n in gathered if n.target is collectives.all_gather and n.args[0].op == "placeholder"]


@pytest.mark.parametrize("gathers", [False, True])
def test_a_parameter_gathered_on_two_axes_pairs_its_sum_and_is_held_whole(gathers):
    # as insert_collectives writes a gather on two axes whose gradient is summed on the first:
    # that axis's pair becomes gather_param, the other gather stays (its backward a chunk), and a
    # stage that holds what it gathers holds both (the stage planner prices the whole gather held)
    graph = torch.fx.Graph()
    x, param = graph.placeholder("x"), graph.placeholder("p_w")
    gathered = graph.call_function(collectives.all_gather, (param, 1, "axis0"))
    gathered = graph.call_function(collectives.all_gather, (gathered, 0, "axis1"))
    summed = graph.call_function(collectives.allreduce_grad, (gathered, "axis0"))
    graph.output(graph.call_function(torch.ops.aten.mm.default, (x, summed)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    held = HeldChains(frozenset({"p_w"}), gathers=gathers)
    hold_param_collectives(gm, types.SimpleNamespace(memory=None), held)
    in_graph = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    pair = [collectives.gather_param, collectives.all_gather]
    assert in_graph == ([] if gathers else pair) + [torch.ops.aten.mm.default]
    assert _chain_targets(held)[1:-1] == (pair if gathers else [])
