"""The stage planner (autopar.solver.planners.stages): layer clustering, the DP, solution sharing, errors.

Single process, no process group; small models, so each test takes seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.distributed.tensor import Replicate

import autopar
from autopar.cost.cluster import LinkSpec, get_cluster
from autopar.errors import InfeasibleError, MeshError
from autopar.ir.plan import Plan
from autopar.solver.planners.stage_costs import cluster_layers
from autopar.solver.planners.stages import StageSettings, search_stages
from autopar.trace import trace
from autopar.zoo.models import MLP, build_model, example_batch

H100 = get_cluster("h100-80g")
# A network so fast that splitting the batch over more devices always beats a pipeline.
FAST = dataclasses.replace(H100, name="fast", intra_node=LinkSpec(1e-12, 1e18), inter_node=LinkSpec(1e-12, 1e18))


def _mlp(depth: int, width: int = 64, batch: int = 16):
    model = MLP(d_in=width, d_hidden=width, d_out=width, depth=depth)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return model, (x, y)


def _op_nodes(traced) -> list[str]:
    return [n.name for n in traced.gm.graph.nodes if n.op not in ("placeholder", "output")]


def test_cluster_layers_finds_the_blocks_with_embedding_and_head_around_them():
    model = build_model("gpt", n_layer=3)
    traced = trace(model, example_batch("gpt", 4))
    layers = cluster_layers(traced)
    assert layers.num_blocks == 3 and layers.repeated and layers.list_path == "transformer.h"
    assert all(layers.names[1:-1])  # every block has ops; pre holds the embeddings
    assert sorted(n for names in layers.names for n in names) == sorted(_op_nodes(traced))
    assert any("embedding" in n for n in layers.names[0])
    assert any("cross_entropy" in n for n in layers.names[-1])


def test_forced_stages_are_balanced_and_cover_every_node_once():
    # 7 equal layers and a head of about one layer's cost, on a network too fast to matter:
    # the only balanced cut into 4 stages is 2, 2, 2 and 1 + the head.
    model, inputs = _mlp(depth=7, width=512, batch=64)
    plan = autopar.plan(model, (4,), example_inputs=inputs, cluster=FAST, pipeline=4, num_microbatches=4)
    pipeline = plan.pipeline
    assert pipeline.num_stages == 4 and pipeline.stage_mesh == (1,) and plan.mesh_shape == (4,)
    assert [s.ranks for s in pipeline.stages] == [(0,), (1,), (2,), (3,)]
    assert [s.layers for s in pipeline.stages] == [(0, 2), (2, 4), (4, 6), (6, 7)]
    times = [s.time_s for s in pipeline.stages]
    assert max(times) <= 1.05 * min(times)
    traced = trace(model, tuple(t[:16] for t in inputs))
    listed = [n for s in pipeline.stages for n in s.nodes]
    assert sorted(listed) == sorted(_op_nodes(traced)) and len(listed) == len(set(listed))
    order = {n: i for i, n in enumerate(_op_nodes(traced))}
    assert all(list(s.nodes) == sorted(s.nodes, key=order.get) for s in pipeline.stages)
    assert plan.graph_hash == traced.graph_hash  # planned on one microbatch


def _cum(values):
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


def test_step_time_is_the_1f1b_formula_over_the_stages():
    model, inputs = _mlp(depth=4)
    plan = autopar.plan(model, (2,), example_inputs=inputs, cluster="h100-80g", pipeline=2, num_microbatches=8)
    times = [s.time_s for s in plan.pipeline.stages]
    exposed = plan.predicted.exposed_grad_sync_s  # the syncs that neither the drain nor a backward hides
    assert 0 <= exposed <= plan.predicted.grad_sync_s
    assert plan.pipeline.step_time_s == pytest.approx(sum(times) + 7 * max(times) + exposed)
    # the plan's step is the schedule's and then the slowest stage's AdamW step (cost.optimizer)
    assert plan.predicted.optimizer_s > 0
    assert plan.predicted.step_time_s == pytest.approx(plan.pipeline.step_time_s + plan.predicted.optimizer_s)
    assert plan.predicted.recompute == (False, False) and plan.memory is None  # memory is ample
    assert 0 <= plan.pipeline.bubble_fraction < 1


def test_auto_with_ample_memory_and_a_fast_network_keeps_one_stage():
    model = build_model("gpt", n_layer=4)
    plan = autopar.plan(model, (4,), example_inputs=example_batch("gpt", 8), cluster=FAST, pipeline="auto", num_microbatches=2)
    assert plan.pipeline.num_stages == 1 and plan.pipeline.stage_mesh == (4,)
    rows = plan.stats["stage_search"]
    assert [r["stages"] for r in rows if r["status"] == "ok"][0] == 1 and {r["stages"] for r in rows} == {1, 2, 4}


def test_a_budget_one_stage_cannot_hold_forces_a_split():
    # Odd widths and an odd microbatch: nothing can be sharded over 2 devices, so one stage
    # holds every layer whole, and two stages hold half each.
    model, inputs = _mlp(depth=4, width=63, batch=15)
    unbounded = autopar.plan(model, (2,), example_inputs=inputs, cluster=FAST, pipeline=1, num_microbatches=3)
    whole = unbounded.pipeline.stages[0].memory_bytes
    plan = autopar.plan(
        model, (2,), example_inputs=inputs, cluster=FAST, pipeline="auto", num_microbatches=3, memory_budget=0.8 * whole
    )
    assert plan.pipeline.num_stages == 2
    assert all(s.memory_bytes <= 0.8 * whole for s in plan.pipeline.stages)
    assert [r["status"] for r in plan.stats["stage_search"] if r["stages"] == 1] == ["infeasible"]
    with pytest.raises(InfeasibleError, match="raise the budget"):
        autopar.plan(
            model, (2,), example_inputs=inputs, cluster=FAST, pipeline="auto", num_microbatches=3, memory_budget=0.2 * whole
        )


def test_plan_json_round_trip():
    model = build_model("gpt", n_layer=2)
    plan = autopar.plan(model, (2, 2), example_inputs=example_batch("gpt", 4), cluster="h100-80g", pipeline=2, num_microbatches=2)
    again = Plan.from_json(plan.to_json())
    assert again.pipeline == plan.pipeline and again.nodes == plan.nodes and again.params == plan.params
    assert again.spec_mesh == (1, 2) and again.mesh_shape == (2, 2)
    assert all(len(spec) == 2 for spec in plan.params.values())
    assert again.to_json() == plan.to_json()


def test_identical_layer_ranges_share_one_ilp_solve():
    solves = []
    for depth in (4, 8):
        model, inputs = _mlp(depth=depth)
        traced = trace(model, tuple(t[:4] for t in inputs))
        search, _ = search_stages(traced, (2,), H100, StageSettings(num_stages=2, num_microbatches=4))
        solves.append(search.ilp_solves)
    assert solves == [1, 1]  # one stage mesh, no memory budget: one ILP, whatever the depth
    model, inputs = _mlp(depth=8)
    traced = trace(model, tuple(t[:4] for t in inputs))
    search, costs = search_stages(traced, (4,), H100, StageSettings(num_stages="auto", num_microbatches=4))
    assert len(search.rows) == 3 and search.ilp_solves == len(costs) == 3  # meshes (4,), (2,), (1,)


def test_a_shallow_trace_prices_a_deep_model_exactly():
    deep_model, inputs = _mlp(depth=6)
    deep = search_stages(trace(deep_model, inputs), (2,), H100, StageSettings(num_stages=2, num_microbatches=4))[0]
    torch.manual_seed(0)
    shallow_model, _ = _mlp(depth=3)
    shallow = search_stages(
        trace(shallow_model, inputs), (2,), H100, StageSettings(num_stages=2, num_microbatches=4, num_layers=6)
    )[0]
    assert shallow.step_time_s == pytest.approx(deep.step_time_s, rel=1e-9)
    assert [s.layers for s in shallow.stages] == [s.layers for s in deep.stages]
    assert [s.memory_bytes for s in shallow.stages] == pytest.approx([s.memory_bytes for s in deep.stages])


def test_errors_name_the_cause_and_the_fix():
    model, inputs = _mlp(depth=2)
    with pytest.raises(MeshError, match=r"pipeline=3 stages must divide mesh axis 0 \(4\).*\[1, 2, 4\]"):
        autopar.plan(model, (4,), example_inputs=inputs, pipeline=3, num_microbatches=2)
    with pytest.raises(ValueError, match="only 2 layers.*at most 2 stages"):
        autopar.plan(model, (4,), example_inputs=inputs, pipeline=4, num_microbatches=2)
    with pytest.raises(ValueError, match="num_microbatches=3 does not divide the batch of 16"):
        autopar.plan(model, (2,), example_inputs=inputs, pipeline=2, num_microbatches=3)
    with pytest.raises(ValueError, match="or pipeline='auto' as well"):
        autopar.plan(model, (2,), example_inputs=inputs, num_microbatches=2)
    with pytest.raises(ValueError, match="pipeline must be 'off', 'auto' or a positive number"):
        autopar.plan(model, (2,), example_inputs=inputs, pipeline="yes", num_microbatches=2)


def test_device_count_lets_the_planner_pick_the_stage_mesh():
    model = build_model("gpt", n_layer=2)
    plan = autopar.plan(
        model, "auto", devices=4, example_inputs=example_batch("gpt", 8), cluster="h100-80g", pipeline="auto", num_microbatches=2
    )
    stage_mesh = plan.pipeline.stage_mesh
    assert plan.mesh_shape == (plan.pipeline.num_stages * stage_mesh[0], *stage_mesh[1:])
    # 2 layers: 1 or 2 stages, on any mesh of 4 or 2 devices
    assert {tuple(r["stage_mesh"]) for r in plan.stats["stage_search"]} == {(4,), (2, 2), (2,)}


@pytest.mark.parametrize("candidates", ["lagrangian", "budget", "both"])
def test_leaner_candidates_let_a_tight_budget_fit(candidates):
    # On (2,) a 4-layer stage fits only with its parameters sharded: the leaner candidates do that.
    model = build_model("gpt", n_layer=4, n_embd=128, vocab_size=512)
    traced = trace(model, example_batch("gpt", 2, n_layer=4, n_embd=128, vocab_size=512))
    fastest = search_stages(traced, (2,), H100, StageSettings(num_stages=1, num_microbatches=1, ladder=()))[0]
    # 0.65: the sharded stages are priced with the parameters the runtime gathers whole (FSDP's
    # gathered groups and reduce-scatter buckets), so the leanest candidate needs ~0.63 of the
    # fastest's memory (~0.5 when gathered parameters were free)
    budget = 0.65 * fastest.stages[0].memory_bytes
    with pytest.raises(InfeasibleError):
        search_stages(traced, (2,), H100, StageSettings(num_stages=1, num_microbatches=1, memory_budget=budget, ladder=()))
    lean, costs = search_stages(
        traced, (2,), H100, StageSettings(num_stages=1, num_microbatches=1, memory_budget=budget, candidates=candidates)
    )
    assert lean.stages[0].memory_bytes <= budget and lean.stages[0].candidate > 0
    assert len(costs[(2,)].candidates) > 1 and lean.step_time_s >= fastest.step_time_s


@pytest.mark.parametrize("seed", range(5))
def test_the_dp_finds_the_best_partition_that_brute_force_finds(seed):
    import itertools

    import numpy as np

    from autopar.solver.planners.stages import _search_partition

    rng = np.random.default_rng(seed)
    num_layers, num_stages, num_microbatches = 8, 3, int(rng.integers(1, 9))
    tables = []
    for _ in range(num_stages):
        table = np.full((num_layers, num_layers + 1), np.inf)
        for a in range(num_layers):
            for b in range(a + 1, num_layers + 1):
                if rng.uniform() > 0.15:  # some ranges do not fit memory
                    table[a, b] = (b - a) * rng.uniform(1.0, 2.0) + rng.uniform(0.0, 1.0)
        tables.append(table)

    def score(bounds):
        times = [tables[i][bounds[i], bounds[i + 1]] for i in range(num_stages)]
        return sum(times) + (num_microbatches - 1) * max(times)

    found = _search_partition(tables, num_microbatches, score)
    every = [score([0, *cuts, num_layers]) for cuts in itertools.combinations(range(1, num_layers), num_stages - 1)]
    best = min(every)
    if not np.isfinite(best):
        assert found is None
    else:
        assert found[0] == pytest.approx(best) and score(found[1]) == pytest.approx(best)


def test_a_pipelined_mistral_on_2x2_asks_only_for_transitions_the_rewrite_makes():
    # Issue 15: the stage mesh (1, 2) offered S and P on its size-1 axis, stages stitched from
    # different candidate plans met as S(0) -> P, and compile failed in insert_collectives.
    from autopar.ir.spec import transition_steps
    from tests.zoo.hf_models import loss_only, mistral

    model, kwargs = mistral(batch_size=8)
    plan = autopar.plan(loss_only(model), (2, 2), example_kwargs=kwargs, cluster="cpu", pipeline=2, num_microbatches=2)
    assert plan.pipeline.stage_mesh == (1, 2)
    for name, node in plan.nodes.items():
        assert all(isinstance(spec[0], Replicate) for spec in node.ins + node.outs), f"{name}: {node}"
        for (producer, index), dst in zip(node.inputs, node.ins):
            src = plan.nodes[producer].outs[index]
            assert transition_steps(src, dst) is not None, f"{producer} -> {name}: {src} -> {dst}"


def test_pipelined_plans_record_their_precision():
    model = build_model("gpt", n_layer=2)
    plan = autopar.plan(
        model,
        (2,),
        example_inputs=example_batch("gpt", 4),
        cluster="h100-80g",
        pipeline=2,
        num_microbatches=2,
        precision="bf16-mixed",
    )
    assert plan.pipeline is not None and plan.precision.name == "bf16-mixed"
    assert Plan.from_json(plan.to_json()).precision == plan.precision


def test_the_stage_dp_prices_each_parameter_reduction_once_at_its_bucketed_price():
    # GPT ties its embedding to its head: two uses of one parameter. The runtime reduces each
    # parameter's gradient once, in a bucket (passes.schedule), and the sharding ILP prices that
    # (choices.param_sync_groups); the stage DP's per-step sync must be the same sum, not one
    # latency-bound all-reduce per use.
    from autopar.solver.planners.stage_costs import CandidateSolver, build_stage_graph, split_op_costs, unit_costs

    cpu = get_cluster("cpu")  # slow compute: splitting the batch wins, so parameters are reduced
    model = build_model("gpt", n_layer=2)
    traced = trace(model, example_batch("gpt", 16))
    graph = build_stage_graph(traced, (4,), cpu)
    split = split_op_costs(graph, cpu)
    choice = CandidateSolver(graph, split, 2, 30.0, "highs").fastest()[0].solution.choice
    units = unit_costs(graph, cluster_layers(traced), split, choice, cpu)
    groups, per_use = graph.param_sync_groups()
    bucketed = sum(group.total_s for group in groups.values() if group.needed(choice))
    assert bucketed > 0
    # the tied table (exported once, as the head's weight): two uses, each reducing
    assert any(g.needed(choice) and len(g.uses) == 2 for g in groups.values())
    per_use_total = sum(per_use[name][choice[name]] for name in per_use)
    assert per_use_total > bucketed  # one latency per use costs more than one bucket slot per parameter
    assert float(units.sync.sum()) == pytest.approx(bucketed, rel=1e-9)


def _stage_costs(mesh, precision=None, model="gpt"):
    """A 2-layer zoo ``model``'s stage graph on ``mesh`` (cpu preset, 16 sequences) with its op
    split, layers and fastest plan."""
    from autopar.ir.options import precision_policy
    from autopar.solver.planners.stage_costs import CandidateSolver, build_stage_graph, split_op_costs

    cpu = get_cluster("cpu")
    policy = precision_policy(precision) if precision else None
    traced = trace(build_model(model, n_layer=2), example_batch(model, 16), None, policy)
    graph = build_stage_graph(traced, mesh, cpu, optimizer_dtype=torch.float32 if precision else None)
    split = split_op_costs(graph, cpu)
    choice = CandidateSolver(graph, split, 4, 30.0, "highs").fastest()[0].solution.choice
    return graph, split, cluster_layers(traced), choice, cpu


def test_a_cast_parameters_gradient_sync_is_priced_once_a_step():
    # Under bf16-mixed every weight is read through its cast: the gradient all-reduce of that cast
    # is the parameter's, which the pipeline runs once a step (passes.held); priced per
    # microbatch, it made DP inside a stage look M times dearer than it runs. (A Llama's casts
    # are ops of their own, not followers of their parameters, as a GPT's are.)
    from autopar.solver.planners.stage_costs import unit_costs
    from autopar.solver.problem.gathered import cast_of_param

    graph, split, layers, choice, cpu = _stage_costs((4,), "bf16-mixed", "llama")
    casts = [n for n in graph.order if graph.choices[n].kind == "op" and cast_of_param(graph.choices, n)]
    assert casts and all(graph.choices[n].follower_of is None for n in casts)
    synced = [n for n in split.sync if split.sync[n][choice[n]] > 0]
    assert synced and any(p in casts for n in synced for p, _ in graph.choices[n].inputs)
    assert float(unit_costs(graph, layers, split, choice, cpu).sync.sum()) > 0


def test_fsdp_laid_over_a_plan_and_held_moves_its_gathers_to_the_step():
    # FSDP over the data-parallel plan of a stage mesh (stage_costs.fsdp_overlay): every matrix
    # sharded, its uses as they were. Held (StagePlan.hold_gathered), its gathers and
    # reduce-scatters are paid once a step (sync), not per microbatch (own), and its whole bytes
    # are held all step (static).
    from autopar.solver.planners.stage_costs import fsdp_overlay, unit_costs

    graph, split, layers, choice, cpu = _stage_costs((4,))
    overlaid = fsdp_overlay(graph, choice, 0)
    tied = {n for names in graph.ties for n in names}  # the embedding and the head: left alone
    assert tied
    matrices = [n for n in graph.order if graph.choices[n].kind == "param" and len(graph.choices[n].out_shapes[0]) == 2]
    params = [n for n in matrices if n not in tied]
    spec = lambda c, n: graph.choices[n].strategies[c[n]].outs[0]  # noqa: E731
    assert all(spec(choice, n)[0].is_replicate() for n in matrices), "the fastest plan on the cpu preset replicates"
    assert overlaid is not None and all(spec(overlaid, n)[0].is_shard() for n in params)
    assert all(overlaid[n] == choice[n] for n in tied)
    for n in graph.order:  # the uses take what they took
        if graph.choices[n].kind not in ("param",) and graph.choices[n].follower_of is None:
            assert overlaid[n] == choice[n], n
    plain = unit_costs(graph, layers, split, overlaid, cpu)
    held = unit_costs(graph, layers, split, overlaid, cpu, hold=True)
    moved = float(plain.own.sum() - held.own.sum())
    assert moved > 0 and float(held.sync.sum() - plain.sync.sum()) == pytest.approx(moved, rel=1e-9)
    assert float(held.static.sum()) > float(plain.static.sum())
    assert float(held.saved.sum() + held.transient.sum()) <= float(plain.saved.sum() + plain.transient.sum())
    # Not held, autograd keeps each gathered matrix for its microbatch's backward (the pipeline's
    # graph gathers where a use needs it, and frees nothing after forward): one copy a microbatch
    # in flight, what ``saved`` counts.
    from autopar.solver.problem.gathered import PREFIX

    bytes_of = graph.bytes_of(overlaid)
    gathered = sum(bytes_of(PREFIX + n) for n in params)
    assert gathered > 0 and float(plain.saved.sum() - held.saved.sum()) >= 0.99 * gathered
    assert fsdp_overlay(graph, overlaid, 0) is None  # nothing left to shard on that axis


def test_hold_gathered_round_trips_and_is_refused_under_zbv():
    from autopar.errors import PlanError
    from autopar.ir.pipeline import StagePlan

    plan = autopar.plan(
        build_model("gpt", n_layer=2), (2,), example_inputs=example_batch("gpt", 4), cluster="cpu", pipeline=2, num_microbatches=2
    )
    held = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, hold_gathered=True))
    assert Plan.from_json(held.to_json()).pipeline.hold_gathered
    assert "hold_gathered" not in plan.to_json()  # plans that do not hold read as before
    with pytest.raises(PlanError, match="hold_gathered=True under schedule 'ZBV'"):
        StagePlan.from_json({**held.pipeline.to_json(), "schedule": "ZBV", "virtual_stages": 1})


def test_the_search_steps_each_groups_parameters_and_a_tied_one_in_both():
    # The stage DP prices the optimizer step of each stage's parameters per layer range
    # (stage_costs._steps); the reference walks the whole graph's liveness intervals of the
    # parameters each stage's ops read. GPT ties its embedding to its head, which two stages
    # read here: both groups step it (runtime.pipeline holds it in each), so each group's step
    # is more than its own layers'.
    from autopar.cost import optimizer as step_cost

    cpu = get_cluster("cpu")
    traced = trace(build_model("gpt", n_layer=4), example_batch("gpt", 8))
    layers = cluster_layers(traced)
    search, costs = search_stages(traced, (2,), cpu, StageSettings(num_microbatches=2, num_stages=2), layers)
    graph = costs[search.stage_mesh].graph
    implementation = step_cost.implementation(cpu, graph.optimizer)
    leader = {member: names[0] for names in graph.ties for member in names}  # the timeline's name of a tied one
    per_group, read = [], []
    for stage in search.stages:
        a, b = stage.layers
        nodes = layers.nodes_of(-1 if a == 0 else a, layers.num_blocks + 1 if b == layers.num_blocks else b)
        params = {leader.get(p, p) for n in nodes for p, _ in graph.choices[n].inputs if graph.choices[p].kind == "param"}
        choice = costs[search.stage_mesh].candidates[stage.candidate].solution.choice
        stepped = step_cost.stepped_tensors([iv for iv in graph.timeline.intervals if iv.node in params], graph.bytes_of(choice))
        per_group.append(step_cost.adamw_step_s(stepped, cpu, implementation, search.stage_mesh))
        read.append(params)
    assert read[0] & read[1], "the tied table is read by both stages"
    assert [s.optimizer_s for s in search.stages] == pytest.approx(per_group, rel=1e-9)
    assert search.optimizer_s == pytest.approx(max(per_group), rel=1e-9)


def test_each_microbatch_but_the_first_adds_its_gradients_into_the_steps_sum():
    # A pipelined step sums every microbatch's gradients into one (passes.held): each microbatch
    # after the first reads the sum and its own gradient and writes the sum, memory-bound. The
    # tied table is summed in both stages that hold it.
    from autopar.cost import comm
    from autopar.cost import optimizer as step_cost
    from autopar.solver.planners.stages import _option_matrices

    cpu = get_cluster("cpu")
    traced = trace(build_model("gpt", n_layer=2), example_batch("gpt", 8))
    _, costs = search_stages(traced, (2,), cpu, StageSettings(num_microbatches=4, num_stages=2))
    mesh_costs = costs[(1,)]
    graph, candidate = mesh_costs.graph, mesh_costs.candidates[0]
    units = candidate.units
    grads = step_cost.stepped_params(graph.timeline.intervals, graph.bytes_of(candidate.solution.choice))
    expected = sum(comm.copy_s(3 * grad, cpu) for _, grad in grads.values())
    shared = [added for _, added, us in units.shared_steps]
    assert len(shared) == 1, "the tied table, read by the first unit and the last"
    assert float(units.accumulate.sum()) + shared[0] == pytest.approx(expected, rel=1e-9)
    L = mesh_costs.num_layers
    times = {m: _option_matrices(units, mesh_costs.rep, L, False, m)["time"] for m in (1, 4)}
    assert times[4][0, L] - times[1][0, L] == pytest.approx(3 / 4 * expected, rel=1e-9)  # one stage: the table once
    first, last = (times[4][a, b] - times[1][a, b] for a, b in ((0, 1), (1, L)))  # two stages: each sums it
    assert first + last == pytest.approx(3 / 4 * (expected + shared[0]), rel=1e-9)


def test_a_stage_shares_the_hosts_slots_with_the_other_stages():
    # CPU ranks beyond the host's cores share them (ClusterSpec.compute_share): a stage mesh of 2
    # ranks in a pipeline of 2 stages computes at the share of 4 ranks, as the whole mesh would.
    two = dataclasses.replace(get_cluster("cpu-gloo"), compute_slots_per_node=2)
    traced = trace(build_model("gpt", n_layer=2), example_batch("gpt", 8))
    _, costs = search_stages(traced, (2, 2), two, StageSettings(num_microbatches=2, num_stages=2))
    (stage_mesh,) = costs
    assert stage_mesh == (1, 2) and costs[stage_mesh].cluster.compute_share(stage_mesh) == two.compute_share((2, 2)) == 0.5


def test_all_but_a_stages_last_bucket_may_sync_during_its_backward():
    # runtime.held_sync all-reduces a stage's summed gradients in buckets of HELD_BUCKET_BYTES as
    # its last backward makes them final: the last bucket waits for the backward's end.
    import numpy as np

    from autopar.cost.comm import HELD_BUCKET_BYTES
    from autopar.solver.planners.stage_costs import UnitCosts
    from autopar.solver.planners.stages import _option_matrices

    zeros = np.zeros(4)  # pre, two blocks, post
    mib = HELD_BUCKET_BYTES / 32
    units = UnitCosts(
        *(zeros,) * 4,
        sync=np.array([0.0, 1.0, 1.0, 0.0]),
        static=zeros,
        saved=zeros,
        transient=zeros,
        stash=zeros,
        prev_bytes=np.zeros((4, 2)),
        pre_bytes=np.zeros((4, 2)),
        shared=[],
        optimizer=zeros,
        optimizer_tensors=zeros,
        accumulate=zeros,
        synced_bytes=np.array([0.0, 48 * mib, 16 * mib, 0.0]),
        shared_steps=[],
    )
    early = _option_matrices(units, np.arange(4), 2, False, 4)["early"]
    # both blocks: 2 s over 64 MiB, the last 32 MiB of it (1 s) after the backward
    assert early[0, 2] == pytest.approx(1.0)
    assert early[0, 1] == pytest.approx(1 - 32 / 48)  # block 0 alone: 48 MiB, a bucket and a half
    assert early[1, 2] == pytest.approx(0.0)  # block 1 alone: 16 MiB, one bucket, all of it after
