"""Explanations: each decision's runner-ups, priced as the ILP prices them, and what decided."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.errors import PlanError
from autopar.report.explain import explain_json, explain_text, find_decision
from autopar.solver import ShardingILP, build_choice_graph
from autopar.solver.pricing import runner_ups
from autopar.solver.pricing.runner_ups import explain_decisions
from autopar.solver.problem.choices import optimizer_objective_s, param_sync_adjustment_s
from autopar.solver.problem.edges import EdgePrices
from autopar.solver.search.solving import peak_memory, solve_ilp
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


def _objective(graph, assignment) -> tuple[float, float]:
    """Seconds and memory of a full assignment, summed from scratch over every node and edge."""
    seconds = sum(graph.choices[n].priced[assignment[n]].compute_s for n in graph.order)
    seconds += optimizer_objective_s(graph, assignment)  # each parameter's optimizer step at its placement
    # each parameter's gradient reduction once, bucketed, in place of one all-reduce per use
    seconds += param_sync_adjustment_s(graph, assignment)
    memory = sum(graph.choices[n].priced[assignment[n]].memory_bytes for n in graph.order)
    for edge in graph.edges:
        src = graph.choices[edge.producer].strategies[assignment[edge.producer]].outs[edge.out_index]
        dst = graph.choices[edge.consumer].strategies[assignment[edge.consumer]].ins[edge.in_index]
        if src != dst:
            seconds += edge.price[(src, dst)][0]
    return seconds, memory


def _with_candidate(graph, solution, record, strategy: int) -> dict[str, int]:
    """The solution with this decision's members switched to ``strategy`` (followers follow)."""
    assignment = dict(solution.choice)
    members = set(record["members"])
    for name in graph.order:
        if name not in members:
            continue
        choice = graph.choices[name]
        if choice.follower_of is None:
            assignment[name] = strategy
            continue
        producer, out_index = choice.inputs[0]
        spec = graph.choices[producer].strategies[assignment[producer]].outs[out_index]
        assignment[name] = [s.ins[0] for s in choice.strategies].index(spec)
    return assignment


@pytest.fixture(scope="module")
def gpt_traced():
    return trace(build_model("gpt", seed=0), example_batch("gpt", 8, seed=1))


@pytest.fixture(scope="module")
def solved(gpt_traced):
    cluster = get_cluster("cpu")
    graph = build_choice_graph(gpt_traced, (2,), cluster)
    solution = solve_ilp(ShardingILP(graph))
    return graph, solution, explain_decisions(graph, solution, cluster, None)


def test_objective_helper_matches_the_solver(solved):
    graph, solution, _ = solved
    assert _objective(graph, solution.choice)[0] == pytest.approx(solution.objective_s, rel=1e-9)


def test_runner_up_costs_are_exact_counterfactuals(solved):
    graph, solution, decisions = solved
    base_s, base_mem = _objective(graph, solution.choice)
    checked = 0
    for record in decisions.values():
        chosen = record["candidates"][0]
        assert chosen.get("chosen") and chosen["strategy"] == solution.choice[next(iter(record["members"]))]
        for cand in record["candidates"]:
            parts = (
                cand["compute_s"]
                + cand["grad_sync_s"]
                + cand.get("kernel_comm_s", 0.0)
                + cand["reshard_in_s"]
                + cand["reshard_out_s"]
                + cand.get("optimizer_s", 0.0)
            )
            assert parts == pytest.approx(cand["total_s"], rel=1e-9, abs=1e-15)
            if cand is chosen:
                continue
            seconds, memory = _objective(graph, _with_candidate(graph, solution, record, cand["strategy"]))
            assert seconds - base_s == pytest.approx(cand["total_s"] - chosen["total_s"], rel=1e-6, abs=1e-12)
            assert memory - base_mem == pytest.approx(cand["memory_bytes"] - chosen["memory_bytes"], abs=2)
            checked += 1
        totals = [c["total_s"] for c in record["candidates"][1:]]
        assert totals == sorted(totals)
    assert checked > 20


def test_optimal_unconstrained_plan_is_decided_by_cost(solved):
    graph, solution, decisions = solved
    assert solution.status == "Optimal"
    assert decisions and all(r["binding"] == "cost" for r in decisions.values())
    for record in decisions.values():
        chosen = record["candidates"][0]["total_s"]
        assert all(c["total_s"] >= chosen - 1e-12 for c in record["candidates"])
    # Data parallel on 2 devices: some replicated weight's gradient is all-reduced.
    assert any(r["candidates"][0]["grad_sync_s"] > 0 for r in decisions.values())
    # Repeated layers and tied weights share one decision.
    tied = next(r for r in decisions.values() if "transformer.wte.weight" in r["fqns"])
    assert "lm_head.weight" in tied["fqns"]
    q_proj = next(r for r in decisions.values() if "transformer.h.0.attn.q_proj.weight" in r["fqns"])
    assert "transformer.h.1.attn.q_proj.weight" in q_proj["fqns"]


def test_memory_budget_binding(gpt_traced):
    cluster = get_cluster("cpu")
    graph = build_choice_graph(gpt_traced, (2,), cluster)
    free = solve_ilp(ShardingILP(graph))
    lean = ShardingILP(graph)
    lean.minimize_peak_memory(graph.timeline.checkpoints([graph.bytes_bound(largest=False)]))
    leanest = peak_memory(graph, solve_ilp(lean)).bytes
    peak = peak_memory(graph, free).bytes
    assert leanest < peak
    # Close to the floor, single decisions must trade time for memory. (Halfway up, the budget can
    # be met by moves that are each cost-optimal given their neighbours, so nothing "binds" alone.)
    budget = leanest + 0.05 * (peak - leanest)
    solution = solve_ilp(ShardingILP(graph, budget))
    decisions = explain_decisions(graph, solution, cluster, budget)
    bound = [r for r in decisions.values() if r["binding"] == "memory_budget"]
    assert bound, "a budget between the leanest and the free plan must bind somewhere"
    for record in bound:
        chosen = record["candidates"][0]
        cheaper = [c for c in record["candidates"][1:] if c["total_s"] < chosen["total_s"]]
        assert cheaper and all(c["memory_bytes"] > chosen["memory_bytes"] for c in cheaper)


@pytest.fixture(scope="module")
def gpt_plan(gpt_plan_2):
    return gpt_plan_2


def test_plan_carries_decisions_and_round_trips(gpt_plan):
    assert gpt_plan.decisions
    again = autopar.Plan.from_json(gpt_plan.to_json())
    assert again.decisions == gpt_plan.decisions and again.to_json() == gpt_plan.to_json()
    covered = {m for r in gpt_plan.decisions.values() for m in r["members"]}
    assert covered <= set(gpt_plan.nodes)
    from autopar.ir.spec import format_spec

    for rep, record in gpt_plan.decisions.items():
        chosen = record["candidates"][0]
        assert chosen["out"] == [format_spec(s) for s in gpt_plan.nodes[rep].outs]


def test_find_by_node_param_and_unknown(gpt_plan):
    rep, record = find_decision(gpt_plan, "transformer.h.1.attn.q_proj.weight")
    assert "transformer.h.0.attn.q_proj.weight" in record["fqns"]
    member = record["members"][-1]
    assert find_decision(gpt_plan, member)[0] == rep
    with pytest.raises(PlanError, match="did you mean"):
        find_decision(gpt_plan, "transformer.h.1.attn.q_proj.weigth")
    with pytest.raises(PlanError, match="neither a node nor a parameter"):
        find_decision(gpt_plan, "zzz")


def test_explain_text_and_json(gpt_plan):
    linear = next(
        n
        for n, p in gpt_plan.nodes.items()
        if p.op == "aten.linear.default" and any(n in r["members"] for r in gpt_plan.decisions.values())
    )
    text = explain_text(gpt_plan, linear)
    assert text.startswith(f"explain {linear} (aten.linear.default)")
    for part in ("chosen: out", "compute", "gradient sync", "resharding in", "resharding out", "memory", "decided by cost"):
        assert part in text
    data = explain_json(gpt_plan, linear)
    assert data["binding"] == "cost" and data["candidates"][0]["chosen"]
    single = next(n for n, p in gpt_plan.nodes.items() if p.source == "output")
    assert "nothing to decide" in explain_text(gpt_plan, single)


class _Forgetful(dict):
    """A cache that keeps nothing: every lookup misses and is priced afresh."""

    def __setitem__(self, key, value) -> None:
        pass


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_layer_classes_price_as_every_node_alone(gpt_traced, mesh, monkeypatch):
    """The counterfactuals price each (layer class, strategy) once (``runner_ups._Memo``): the
    same records, to the last bit, as pricing every member of every decision afresh."""
    cluster = get_cluster("cpu")
    graph = build_choice_graph(gpt_traced, mesh, cluster)
    assert graph.layer_template  # the layers are tied, so classes are shared
    solution = solve_ilp(ShardingILP(graph))
    decisions = explain_decisions(graph, solution, cluster, None)
    init = runner_ups._Memo.__init__

    def forgetful(self, *args):
        init(self, *args)
        self.follow, self.edge, self.grad_sync, self.kernel_comm = _Forgetful(), _Forgetful(), _Forgetful(), _Forgetful()

    monkeypatch.setattr(runner_ups._Memo, "__init__", forgetful)
    assert explain_decisions(graph, solution, cluster, None) == decisions


def _member_by_member(graph, solution, ordered, assignment) -> dict[str, float] | None:
    """The counterfactual as its definition reads: each member's terms added one by one, in
    graph order, and every edge that touches a member priced on its own."""
    members = set(ordered)
    compute_s = memory_bytes = reshard_in_s = reshard_out_s = 0.0
    optimizer_s = 0.0 if any(name in graph.optimizer_s for name in ordered) else None
    for name in ordered:
        compute_s += graph.choices[name].priced[assignment[name]].compute_s
        memory_bytes += graph.choices[name].priced[assignment[name]].memory_bytes
        if name in graph.optimizer_s:
            optimizer_s += graph.optimizer_s[name][assignment[name]]
    groups, refunds = graph.param_sync_groups()
    merged_s = -sum(refunds[name][assignment[name]] for name in ordered if name in refunds)
    for group in groups.values():
        if any(consumer in members for consumer, _ in group.uses) and group.needed(assignment):
            merged_s += group.total_s
    for edge in graph.edges:
        if edge.producer not in members and edge.consumer not in members:
            continue
        src = graph.choices[edge.producer].strategies[assignment[edge.producer]].outs[edge.out_index]
        dst = graph.choices[edge.consumer].strategies[assignment[edge.consumer]].ins[edge.in_index]
        if src == dst:
            continue
        if (src, dst) not in edge.price:
            return None
        if edge.consumer in members:
            reshard_in_s += edge.price[(src, dst)][0]
        else:
            reshard_out_s += edge.price[(src, dst)][0]
    return {
        "compute_s": compute_s,
        "param_sync_merge_s": merged_s,
        "reshard_in_s": reshard_in_s,
        "reshard_out_s": reshard_out_s,
        "memory_bytes": memory_bytes,
        **({"optimizer_s": optimizer_s} if optimizer_s is not None else {}),
        "total_s": compute_s + merged_s + reshard_in_s + reshard_out_s + (optimizer_s or 0.0),
    }


def test_slots_price_as_every_member_alone():
    """A decision prices one member per slot of alike members (``runner_ups._Decision``): the
    same numbers, to the last bit, as adding up every member's terms on its own, on four
    repeated layers."""
    cluster = get_cluster("cpu")
    traced = trace(build_model("gpt", seed=0, n_layer=4), example_batch("gpt", 8, seed=1))
    graph = build_choice_graph(traced, (2, 2), cluster)
    solution = solve_ilp(ShardingILP(graph))
    decisions = explain_decisions(graph, solution, cluster, None)
    edges_of: dict[str, list[int]] = {}
    for e, edge in enumerate(graph.edges):
        edges_of.setdefault(edge.producer, []).append(e)
        edges_of.setdefault(edge.consumer, []).append(e)
    groups, _ = graph.param_sync_groups()
    shared = 0
    for rep, record in decisions.items():
        ordered = record["members"]
        base = {name for name in ordered if graph.choices[name].follower_of is None}
        memo = runner_ups._Memo(graph, cluster)
        decision = runner_ups._Decision(graph, solution, base, ordered, edges_of, groups, memo)
        shared += len(ordered) - len(decision.reps)
        costs = decision.price(record["num_strategies"])
        alone = runner_ups._Memo(graph, cluster)
        alone.grad_sync, alone.kernel_comm = _Forgetful(), _Forgetful()
        for s, cost in enumerate(costs):
            assignment = _with_candidate(graph, solution, record, s)
            assert cost == _member_by_member(graph, solution, ordered, assignment), (rep, s)
            if cost is None:
                continue
            for term in (runner_ups._grad_sync_s, runner_ups._kernel_comm_s):
                assert decision.member_sum(term, s) == sum(term(alone, name, assignment[name]) for name in ordered)
    assert shared > 100  # most members share a slot


def test_hub_tables_price_runner_ups_by_codes_as_by_specs(gpt_traced, monkeypatch):
    """On three axes an edge's table prices the pairs it leaves out on demand; the runner-ups
    ask for them by spec codes (``EdgePrices.get_coded``): the same prices as asking by the
    specs (``get``), so the same records to the last bit."""
    cluster = get_cluster("cpu")
    graph = build_choice_graph(gpt_traced, (2, 2, 2), cluster)
    hubs = [edge for edge in graph.edges if isinstance(edge.price, EdgePrices) and edge.price.coder() is not None]
    assert hubs
    solution = solve_ilp(ShardingILP(graph))
    decisions = explain_decisions(graph, solution, cluster, None)
    asked = 0
    for edge in hubs[:20]:
        code = edge.price.coder()
        srcs = list(dict.fromkeys(s.outs[edge.out_index] for s in graph.choices[edge.producer].strategies))
        dsts = list(dict.fromkeys(s.ins[edge.in_index] for s in graph.choices[edge.consumer].strategies))
        for src in srcs[:8]:
            for dst in dsts[:8]:
                asked += 1
                assert edge.price.get_coded(src, dst, code(src), code(dst)) == edge.price.get((src, dst))
    assert asked > 100
    monkeypatch.setattr(EdgePrices, "coder", lambda self: None)  # every pair by its specs
    by_specs = build_choice_graph(gpt_traced, (2, 2, 2), cluster)
    assert explain_decisions(by_specs, solution, cluster, None) == decisions


def test_runner_ups_price_the_communication_the_runtime_overlaps():
    """On an NCCL mesh the ILP prices FSDP's gathers and the gradient reductions as the runtime
    overlaps them (``gather_overlap``): a global term, which a decision's counterfactual changes
    too. Every runner-up's total then differs from the chosen one's by what the objective does."""
    from autopar.solver.planners import sharding
    from autopar.zoo.models import GPT

    with torch.device("meta"):
        model = GPT(vocab_size=131072, block_size=4096, n_layer=2, n_head=16, n_embd=2048, bias=True)
        idx = torch.zeros(48 * 4, 4096, dtype=torch.long)
    cluster = get_cluster("h100-80g")
    graph = build_choice_graph(trace(model, (idx, idx)), (48,), cluster)
    assert graph.overlap is not None and graph.overlap.items
    ilp = ShardingILP(graph, None)
    solution = solve_ilp(ilp, 120.0, "highs")
    base = sharding._fixed_solution(ilp, solution.choice, solution)[0].objective_s
    assert base == pytest.approx(solution.objective_s, rel=1e-6)
    decisions = explain_decisions(graph, solution, cluster, None)
    checked = moved = 0
    for record in decisions.values():
        chosen = record["candidates"][0]
        assert chosen.get("overlap_s", 0.0) == 0.0  # the chosen plan's is the reference
        for cand in record["candidates"][1:]:
            parts = ("compute_s", "grad_sync_s", "kernel_comm_s", "reshard_in_s", "reshard_out_s", "optimizer_s", "overlap_s")
            assert sum(cand.get(part, 0.0) for part in parts) == pytest.approx(cand["total_s"], rel=1e-9, abs=1e-15)
            fixed = sharding._fixed_solution(ilp, _with_candidate(graph, solution, record, cand["strategy"]), solution)
            assert fixed is not None
            assert fixed[0].objective_s - base == pytest.approx(cand["total_s"] - chosen["total_s"], rel=1e-6, abs=1e-9)
            checked += 1
            moved += cand.get("overlap_s", 0.0) != 0.0
    assert checked > 20 and moved, "some runner-up changes what the runtime overlaps"
