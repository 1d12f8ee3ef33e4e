"""Impossible and dominated strategies are cut before the ILP, and the optimum stays where it was."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial

from autopar.cost.cluster import get_cluster
from autopar.ir.spec import P, R, S
from autopar.solver.problem import choices, pruning
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search.solving import solve_ilp
from autopar.trace import trace_repeated
from autopar.zoo.models import build_model, example_batch


def test_partial_arrives_only_where_the_producer_leaves_it_partial():
    reach = pruning.Reachable.of([(R, R, R), (P, S(0), R), (S(0), P, P)], pinned=False)
    assert reach.admits((R, S(1), S(0)))  # no Partial: any producer spec reshards into it
    assert reach.admits((P, R, R)) and reach.admits((R, P, P)) and reach.admits((S(1), R, P))
    assert not reach.admits((P, P, R))  # no producer spec is Partial on axes 0 and 1 at once
    pinned = pruning.Reachable.of([(R, R), (S(0), R)], pinned=True)
    assert pinned.admits((S(0), R)) and not pinned.admits((R, S(0)))
    ins = [((R, R), (P, R)), ((P, R), (R, R)), ((S(0), R), (R, R))]
    producers = [pruning.Reachable.of([(R, R), (S(0), R)], pinned=False), None]
    assert pruning.feasible(ins, producers) == [0, 2]


def test_dominated_strategies_need_the_same_interface():
    interfaces = ["a", "a", "a", "b"]
    costs = [(2.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.5, 0.5)]
    assert pruning.undominated(interfaces, costs) == [1, 3]  # among equals the first stays
    # Cheaper in one amount and dearer in another: neither dominates.
    assert pruning.undominated(["a", "a"], [(1.0, 2.0), (2.0, 1.0)]) == [0, 1]


def _solve(graph):
    return solve_ilp(ShardingILP(graph, None), 60.0, "highs")


@pytest.mark.parametrize("model, mesh", [("llama", (2, 2)), ("mlp", (2, 2, 2))])
def test_cutting_leaves_the_optimum_where_it_was(monkeypatch, model, mesh):
    """The ILP without the cuts (every enumerated strategy kept) reaches the same optimum; the
    cuts remove strategies, and no kept one takes a Partial input its producer can never
    deliver. (A 3-axis LLaMA solves in minutes on a loaded machine: the MLP stands for it.)"""
    kwargs = {"n_layer": 2} if model == "llama" else {}
    traced = trace_repeated(build_model(model, seed=0, **kwargs), example_batch(model, 4, **kwargs))
    cluster = get_cluster("h100-80g")
    cut = choices.build_choice_graph(traced, mesh, cluster)
    with monkeypatch.context() as patched:
        patched.setattr(pruning, "feasible", lambda ins_of, reachable: list(range(len(ins_of))))
        patched.setattr(pruning, "undominated", lambda interfaces, costs: list(range(len(interfaces))))
        whole = choices.build_choice_graph(traced, mesh, cluster)
    assert whole.pruned.impossible == whole.pruned.dominated == 0
    assert cut.pruned.enumerated == whole.pruned.enumerated
    assert cut.pruned.impossible > 0
    kept = sum(len(c.strategies) for c in cut.choices.values())
    assert kept < sum(len(c.strategies) for c in whole.choices.values())
    for choice in cut.choices.values():
        for strategy in choice.strategies:
            for spec, (producer, out_index) in zip(strategy.ins, choice.inputs):
                partial = {a for a, p in enumerate(spec) if isinstance(p, Partial)}
                if partial:
                    outs = {s.outs[out_index] for s in cut.choices[producer].strategies}
                    assert any(all(isinstance(out[a], Partial) for a in partial) for out in outs), choice.name
    assert _solve(cut).objective_s == pytest.approx(_solve(whole).objective_s, rel=1e-9)
