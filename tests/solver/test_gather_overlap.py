"""FSDP's gathers in the ILP's objective as the runtime overlaps them (``solver.problem.gather_overlap``).

Planned offline on the meta device, in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.cost.cluster import get_cluster
from autopar.solver.planners import sharding
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search import rounding
from autopar.solver.search.solving import solve_ilp
from autopar.trace import trace
from autopar.zoo.models import GPT


@pytest.fixture(scope="module")
def wide_gpt():
    """Megatron-LM's 1.7B GPT widths (2 of its 24 layers, vocabulary 131,072) at 4 × 4096 tokens
    a rank on 48 ranks, as its published DP 48 run: memory does not bind there."""
    with torch.device("meta"):
        model = GPT(vocab_size=131072, block_size=4096, n_layer=2, n_head=16, n_embd=2048, bias=True)
        idx = torch.zeros(48 * 4, 4096, dtype=torch.long)
    return model, dict(example_inputs=(idx, idx), cluster="h100-80g", precision="bf16-mixed", optimizer="adamw:fused")


def test_the_solver_shards_where_fsdp_is_faster_than_ddp(wide_gpt):
    # Priced whole (a ring latency per parameter, none of it hidden), FSDP's gathers made the ILP
    # keep DDP and its whole AdamW step: 0.0557 s where FSDP's plan is 0.0511 s.
    model, job = wide_gpt
    auto = autopar.plan(model, (48,), **job).predicted.step_time_s
    ddp = autopar.hand_plan("ddp", model, (48,), **job).predicted.step_time_s
    fsdp = autopar.hand_plan("fsdp", model, (48,), **job).predicted.step_time_s
    assert fsdp < 0.95 * ddp  # the case weighs something
    assert auto <= fsdp * (1 + 1e-9)


def test_the_ilp_a_fixed_plan_and_the_rounding_check_price_a_plan_alike(wide_gpt):
    model, job = wide_gpt
    traced = trace(model, job["example_inputs"])
    graph = build_choice_graph(traced, (48,), get_cluster("h100-80g"))
    assert graph.overlap is not None and graph.overlap.items
    ilp = ShardingILP(graph, None)
    assert [side.name for side, *_ in ilp.exposed_gathers] == ["e_exposed_gathers_forward", "e_exposed_gathers_backward"]
    solution = solve_ilp(ilp, 120.0, "highs")
    fixed, _ = sharding._fixed_solution(ilp, solution.choice, solution)
    assert fixed.objective_s == pytest.approx(solution.objective_s, rel=1e-6)
    assert rounding.check(ilp, solution.choice) == pytest.approx(solution.objective_s, rel=1e-6)
    # the DDP layout's gathers: none, so no term changes its price
    specs = sharding.edge_specs(graph, solution.choice)
    assert graph.overlap.adjustment_s({}) == 0.0 and graph.overlap.adjustment_s(specs) != 0.0


def _small_gpt_graph(mesh, cluster, width: int = 128):
    with torch.device("meta"):
        model = GPT(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=width, bias=False)
        idx = torch.zeros(16, 64, dtype=torch.long)
    graph = build_choice_graph(trace(model, (idx, idx)), mesh, get_cluster(cluster))
    assert graph.gathered  # there are gathers to price
    return graph


@pytest.mark.parametrize("mesh, cluster", [((8,), "cpu"), ((2, 2, 2), "h100-80g")])
def test_gathers_stay_priced_whole_where_they_do_not_overlap_or_the_routes_would_differ(mesh, cluster):
    # gloo's CPUs move every byte themselves; on three axes an edge's hub prices a gather whole
    graph = _small_gpt_graph(mesh, cluster)
    assert graph.overlap is None
    assert ShardingILP(graph, None).exposed_gathers == []


def test_on_two_axes_only_a_gather_whose_use_is_cut_on_the_other_axis_is_fsdps_pattern():
    # a use replicated on the other axis may sum its gradient there too (hybrid sharding), which
    # the runtime gathers per use, whole: those pairs keep their price
    graph = _small_gpt_graph((2, 4), "h100-80g")
    assert graph.overlap is not None
    kept = whole = 0
    for item in graph.overlap.items:
        edge = graph.edges[item.edge]
        for src, dst in graph.gathered[next(n for n, g in graph.gathered.items() if g.edge == item.edge)].sizes:
            axis = next(a for a in range(2) if src[a] != dst[a])
            if (src, dst) in item.pairs:
                kept += 1
                assert isinstance(dst[1 - axis], Shard)
            else:
                whole += 1
                assert not isinstance(dst[1 - axis], Shard) and (src, dst) in edge.price
    assert kept and whole


def test_the_gradient_reductions_are_paid_where_backward_does_not_hide_them():
    # the objective pays E_b, which holds the z at their bucketed prices, in place of the z's own
    # price, but for the last bucket's; the ILP, a fixed plan and the rounding check still price a
    # plan alike on two axes
    graph = _small_gpt_graph((2, 4), "h100-80g", width=1024)  # 100 MB of weights: more than a bucket
    ilp = ShardingILP(graph, None)
    groups, _ = graph.param_sync_groups()
    backward = ilp.rows_by_name()["exposed_gathers__backward"]
    last = graph.overlap.last_bucket  # the first parameters of forward: reduced when backward is done
    hidden = paid = 0
    for key, z in ilp.z.items():
        if key == ("dtensor_params",):
            continue
        group = groups[key]
        whole = group.price_s * len(group.params & last)
        assert ilp.problem.objective.get(z, 0.0) == pytest.approx(whole, rel=1e-12)
        assert (backward.get(z, 0.0) < 0.0) == bool(group.params - last)
        hidden, paid = hidden + bool(group.params - last), paid + bool(whole)
    assert hidden and paid  # both kinds are weighed
    solution = solve_ilp(ilp, 120.0, "highs")
    fixed, _ = sharding._fixed_solution(ilp, solution.choice, solution)
    assert fixed.objective_s == pytest.approx(solution.objective_s, rel=1e-6)
    assert rounding.check(ilp, solution.choice) == pytest.approx(solution.objective_s, rel=1e-6)
