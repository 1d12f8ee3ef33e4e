"""The communication schedule pass: which collectives of a parameter it merges, and the buckets.

The passes run on the traced graph with made-up group names (no process group is needed to
rewrite); the runtime numbers are checked against eager in tests/ops/test_buckets.py and
tests/runtime/test_module.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.ir.options import CommOptions
from autopar.ops import collectives
from autopar.ops.buckets import GradBuckets, ParamGathers
from autopar.passes import default_passes, run_passes
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.conftest import bucket_reads

# Wide enough, and a batch large enough, that the cpu preset splits the batch: DDP's pattern.
CONFIG = dict(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128)
# bench_vs_torch's GPT, one layer: there the fsdp plan splits the batch too, so the gathered
# parameters' gradients are partial sums (reduce-scattered).
FSDP_CONFIG = dict(vocab_size=4096, block_size=128, n_layer=1, n_head=8, n_embd=256)


def _rewritten(kind: str, options: CommOptions | None = None, config: dict = CONFIG):
    model = build_model("gpt", seed=0, **config)
    batch = example_batch("gpt", 16, seed=1, **config)
    plan = autopar.hand_plan(kind, model, (2,), example_inputs=batch, cluster="cpu")
    traced = trace(model, batch)
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    gm = run_passes(copy.deepcopy(traced.gm), plan, default_passes(("g0",), None, fqns, options))
    return gm, plan, traced


def _param_collectives(gm, names) -> list[torch.fx.Node]:
    """Collective call_function nodes that read a parameter placeholder directly."""
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and getattr(n.target, "__module__", "") == "autopar.ops.collectives"
        and any(a.op == "placeholder" and a.name in names for a in n.all_input_nodes)
    ]


@pytest.fixture(scope="module")
def ddp():
    return _rewritten("ddp")


def test_ddp_gradients_go_to_buckets_in_reverse_order_of_use(ddp):
    gm, plan, traced = ddp
    params = {gi.name for gi in traced.inputs if gi.kind == "param"}
    assert not [n for n in _param_collectives(gm, params) if n.target is collectives.allreduce_grad]
    reads = bucket_reads(gm)
    assert reads, "the DDP plan splits the batch, so its parameter gradients are reduced"
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "grad_buckets"]
    assert all(arg.op == "placeholder" for n in calls for arg in n.args)
    buckets: GradBuckets = gm.get_submodule("grad_buckets")
    assert [n.kwargs["keys"] for n in calls] == [tuple(slot.key for slot in b.slots) for b in buckets.buckets], (
        "one node per bucket, taking its parameters in slot order"
    )
    assert all(n.args[i].name == key for n in calls for i, key in enumerate(n.kwargs["keys"]))
    keys = [slot.key for bucket in buckets.buckets for slot in bucket.slots]
    assert sorted(keys) == sorted(reads) and len(set(keys)) == len(keys), "one slot per parameter"
    first_use = {}
    read_key = {node: key for key, node in reads.items()}
    for position, node in enumerate(gm.graph.nodes):
        for arg in node.all_input_nodes:
            if arg in read_key:
                first_use.setdefault(read_key[arg], position)
    assert [first_use[k] for k in keys] == sorted((first_use[k] for k in keys), reverse=True), (
        "buckets fill in the reverse of forward order: the order backward produces gradients"
    )
    assert all(slot.kind == "all_reduce" and slot.groups == ("g0",) for b in buckets.buckets for slot in b.slots)


def test_ddp_layout_runs_no_collective_of_its_own_in_backward(ddp):
    """The tied token embedding looks up batch-split indices (the ILP prices the tied weight's
    reduction once: the lm_head already needs it), and the positional embedding's gradient,
    summed over the batch split, is reduced at its table in a bucket rather than on its own
    after backward. What is left outside the buckets are the forward's loss collectives."""
    gm, plan, traced = ddp
    assert plan.nodes["embedding"].ins[1] == (torch.distributed.tensor.Shard(0),), plan.summary()

    # collectives whose backward communicates: allreduce_grad, and chunk / reduce_scatter /
    # all_to_all of a tensor that carries a gradient (their duals all-gather or all-to-all)
    def floating(node):
        return node.args[0].meta["val"].is_floating_point()

    backward = [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and (
            n.target is collectives.allreduce_grad
            or (n.target in (collectives.chunk, collectives.reduce_scatter, collectives.all_to_all) and floating(n))
        )
    ]
    assert not backward, [n.format_node() for n in backward]
    assert {"p_transformer_wpe_weight", "p_lm_head_weight"} <= set(bucket_reads(gm))


def test_bucket_caps():
    gm, _, _ = _rewritten("ddp", CommOptions(bucket_cap_bytes=2**18, first_bucket_cap_bytes=2**16))
    buckets = gm.get_submodule("grad_buckets").buckets
    assert len(buckets) > 2
    for index, bucket in enumerate(buckets):
        cap = 2**16 if index == 0 else 2**18
        assert bucket.nbytes <= cap or len(bucket.slots) == 1, f"bucket {index} holds {bucket.nbytes} > {cap}"
    whole, _, _ = _rewritten("ddp", CommOptions(first_bucket_cap_bytes=None))
    assert len(whole.get_submodule("grad_buckets").buckets) == 1, "a model under 25 MiB fits one bucket"


def test_disabled_schedule_keeps_one_collective_per_use():
    gm, _, traced = _rewritten("ddp", CommOptions(enabled=False))
    params = {gi.name for gi in traced.inputs if gi.kind == "param"}
    assert not [n for n in gm.graph.nodes if n.op == "call_module"]
    assert _param_collectives(gm, params)


def test_fsdp_gathers_once_and_reduce_scatters():
    gm, plan, traced = _rewritten("fsdp", config=FSDP_CONFIG)
    params = {gi.name for gi in traced.inputs if gi.kind == "param"}
    gathered = [n for n in _param_collectives(gm, params) if n.target is collectives.all_gather]
    assert not gathered, f"every 1-axis parameter gather is scheduled: {[n.format_node() for n in gathered]}"
    gathers: ParamGathers = gm.get_submodule("param_gathers")
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "param_gathers"]
    assert [n.args[0].name for n in calls] == [key for key, *_ in gathers.order], "gathered in forward order"
    buckets: GradBuckets = gm.get_submodule("grad_buckets")
    slots = [slot for bucket in buckets.buckets for slot in bucket.slots]
    assert slots and all(slot.kind == "reduce_scatter" for slot in slots)
    for slot in slots:  # the slot takes the whole gradient; the parameter keeps its shard
        fqn = next(gi.fqn for gi in traced.inputs if gi.name == slot.key)
        shard_dim = plan.params[fqn][0].dim
        assert slot.dim == shard_dim
        full = dict(build_model("gpt", seed=0, **FSDP_CONFIG).named_parameters(remove_duplicate=False))[fqn]
        assert slot.shape == tuple(full.shape)


def test_hybrid_sharding_reduce_scatters_on_the_shard_axis_then_sums_the_shard_on_the_other():
    """FSDP on the inner axis of (2, 2), replicated on the outer, the batch split on both: each
    gathered use sums its gradient on both axes. The schedule gathers such a parameter once and
    reduce-scatters on the inner axis, then all-reduces the shard on the outer (FSDP2's HSDP);
    before, every use kept its own gather and whole all-reduces. (The numbers, over a training
    loop: tests/runtime/test_conformance.py, ``hsdp``.)"""
    from autopar.cost.cluster import get_cluster
    from autopar.ir.options import PlanOptions
    from autopar.solver.planners.hand_plans import hybrid_specs
    from autopar.solver.planners.sharding import solve

    model = build_model("gpt", seed=0, **FSDP_CONFIG)
    batch = example_batch("gpt", 16, seed=1, **FSDP_CONFIG)
    traced = trace(model, batch)
    plan = solve(traced, (2, 2), get_cluster("cpu"), PlanOptions(), forced=hybrid_specs(traced, (2, 2)))
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    gm = run_passes(copy.deepcopy(traced.gm), plan, default_passes(("g0", "g1"), None, fqns, None))
    buckets: GradBuckets = gm.get_submodule("grad_buckets")
    hybrid = [slot for bucket in buckets.buckets for slot in bucket.slots if slot.groups == ("g1", "g0")]
    assert hybrid and all(slot.kind == "reduce_scatter" for slot in hybrid), [b.groups for b in buckets.buckets]
    gathers: ParamGathers = gm.get_submodule("param_gathers")
    scheduled = {key for key, *_ in gathers.order}
    assert {slot.key for slot in hybrid} <= scheduled, "each is gathered by the schedule, once"
    left = [n for n in _param_collectives(gm, {slot.key for slot in hybrid})]
    assert not left, f"no per-use collective of theirs is left: {[n.format_node() for n in left]}"


def test_fsdp_gathers_each_layer_with_one_collective():
    """FSDP2's grouping: the parameters of one layer (``fully_shard(block)``) are gathered by one
    collective; the root's parameters consecutive in forward order by another; a cap of 0
    gathers each parameter on its own. (The numbers: tests/ops/test_buckets.py, test_module.)"""
    config = dict(FSDP_CONFIG, n_layer=2)
    gm, _, traced = _rewritten("fsdp", config=config)
    fqn = {gi.name: gi.fqn for gi in traced.inputs}
    gathers: ParamGathers = gm.get_submodule("param_gathers")
    layers = [{fqn[key].split(".")[2] if ".h." in fqn[key] else "root" for key in group} for group in gathers.groups]
    assert all(len(layer) == 1 for layer in layers), f"a group never spans layers: {layers}"
    blocks = [layer for layer in layers if layer != {"root"}]
    assert blocks == [{"0"}, {"1"}], f"each block is one group: {layers}"
    per_block = sum(1 for key, *_ in gathers.order if ".h.0." in fqn[key])
    assert per_block > 4, "the block has many gathered parameters, one collective"
    gm, _, _ = _rewritten("fsdp", CommOptions(gather_group_bytes=0), config=config)
    single: ParamGathers = gm.get_submodule("param_gathers")
    assert single.groups == [(key,) for key, *_ in single.order]
    with pytest.raises(ValueError, match="gather_group_bytes"):
        CommOptions(gather_group_bytes=-1)


# -- the compiled mode's schedule: in the graph, for inductor ------------------------------------


def _in_graph(kind: str, config: dict = FSDP_CONFIG, options: CommOptions | None = None, precision: str = "32-true"):
    model = build_model("gpt", seed=0, **config)
    batch = example_batch("gpt", 16, seed=1, **config)
    plan = autopar.hand_plan(kind, model, (2,), example_inputs=batch, cluster="cpu", precision=precision)
    traced = trace(model, batch, precision=plan.precision)
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    gm = run_passes(copy.deepcopy(traced.gm), plan, default_passes(("g0",), None, fqns, options, compiler="inductor"))
    return gm, traced


def test_in_graph_schedule_pairs_fsdp_gathers_with_reduce_scatters_and_leaves_no_hooks():
    gm, traced = _in_graph("fsdp")
    params = {gi.name for gi in traced.inputs if gi.kind == "param"}
    assert not any(n.op == "call_module" for n in gm.graph.nodes), "no GradBuckets/ParamGathers modules"
    direct = _param_collectives(gm, params)
    pairs = [n for n in direct if n.target in (collectives.gather_param, collectives.gather_param_resharded)]
    assert pairs, "the fsdp plan splits the batch: its gathered parameters' gradients are partial sums"
    # FSDP2's default: the layer's parameters are gathered again in backward, the root's kept
    fqn = {gi.name: gi.fqn for gi in traced.inputs}
    for node in pairs:
        layer = "transformer.h.0" if fqn[node.args[0].name].startswith("transformer.h.0.") else ""
        assert node.kwargs["layer"] == layer, node.format_node()
        assert (node.target is collectives.gather_param_resharded) == (layer != ""), node.format_node()
    assert {n.kwargs["layer"] for n in pairs} == {"", "transformer.h.0"}
    # no gather of a parameter is left whose gradient is all-reduced whole then chunked
    for node in direct:
        if node.target is collectives.all_gather:
            (user,) = node.users
            assert not (
                user.op == "call_function" and user.target is collectives.allreduce_grad and user.args[1] == node.args[2]
            ), node.format_node()


def test_in_graph_schedule_sums_a_hybrid_shard_on_the_other_axis_before_its_gather():
    """Under ``compiler="inductor"`` the hybrid layout (``hand_plans.hybrid_specs`` on (2, 2)):
    each parameter's gather becomes ``gather_param`` (reduce-scatter in backward on the inner
    axis), and the all-reduce on the outer axis reads the shard, before the gather, not the whole
    gradient after it. (The numbers: tests/zoo/test_zoo_compiled.py.)"""
    from autopar.cost.cluster import get_cluster
    from autopar.ir.options import PlanOptions
    from autopar.solver.planners.hand_plans import hybrid_specs
    from autopar.solver.planners.sharding import solve

    model = build_model("gpt", seed=0, **FSDP_CONFIG)
    batch = example_batch("gpt", 16, seed=1, **FSDP_CONFIG)
    traced = trace(model, batch)
    plan = solve(traced, (2, 2), get_cluster("cpu"), PlanOptions(), forced=hybrid_specs(traced, (2, 2)))
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    gm = run_passes(copy.deepcopy(traced.gm), plan, default_passes(("g0", "g1"), None, fqns, None, compiler="inductor"))
    gathers = [n for n in gm.graph.nodes if n.target in (collectives.gather_param, collectives.gather_param_resharded)]
    hybrid = [n for n in gathers if _is_allreduce_on(n.args[0], "g0")]
    assert hybrid, [n.format_node() for n in gathers]
    for node in hybrid:
        assert node.args[2] == "g1" and node.args[0].args[0].op == "placeholder", node.format_node()
    for node in gathers:  # no gathered parameter's whole gradient is all-reduced after its gather
        assert not any(_is_allreduce_on(user, "g0") or _is_allreduce_on(user, "g1") for user in node.users), node.format_node()


def _is_allreduce_on(node: torch.fx.Node, group: str) -> bool:
    return node.op == "call_function" and node.target is collectives.allreduce_grad and node.args[1] == group


def test_in_graph_schedule_reshards_as_comm_options_say_and_recomputes_the_cast_with_the_gather():
    gm, traced = _in_graph("fsdp", options=CommOptions(reshard_after_forward=False))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert collectives.gather_param in targets and collectives.gather_param_resharded not in targets
    gm, traced = _in_graph("fsdp", options=CommOptions(reshard_after_forward=True), precision="bf16-mixed")
    resharded = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is collectives.gather_param_resharded]
    assert resharded and collectives.gather_param not in {n.target for n in gm.graph.nodes}
    # bf16-mixed: each parameter is gathered in fp32 and cast inside the recomputed gather
    for node in resharded:
        assert node.kwargs["param_dtype"] == torch.bfloat16, node.format_node()
        assert node.meta["val"].dtype == torch.bfloat16
        assert not any(user.target is torch.ops.aten._to_copy.default for user in node.users), node.format_node()


def test_in_graph_schedule_keeps_ddp_gradient_all_reduces_for_inductor_to_bucket():
    gm, traced = _in_graph("ddp", CONFIG)
    params = {gi.name for gi in traced.inputs if gi.kind == "param"}
    synced = [n for n in _param_collectives(gm, params) if n.target is collectives.allreduce_grad]
    assert synced and not any(n.op == "call_module" for n in gm.graph.nodes)
    # one all-reduce per parameter: the tied embedding and head share one (their gradients summed
    # first, as the eager schedule's one bucket slot does), not one of the whole table per use
    per_param = [n.args[0].name for n in synced]
    assert len(per_param) == len(set(per_param)) and "p_lm_head_weight" in per_param, sorted(per_param)


def test_inductor_options_size_buckets_from_comm_options():
    from autopar.passes.schedule import inductor_options

    opts = inductor_options(CommOptions(bucket_cap_bytes=8 * 2**20, first_bucket_cap_bytes=2**20), exchange_sums=True)
    bucketing = opts["post_grad_custom_post_pass"]
    assert opts["reorder_for_compute_comm_overlap"] and bucketing.exchange_sums
    assert bucketing.caps == (2**20, 8 * 2**20) and bucketing.gather_cap == CommOptions().gather_group_bytes
    assert bucketing.uuid() != inductor_options(CommOptions())["post_grad_custom_post_pass"].uuid()
    assert inductor_options(CommOptions(enabled=False)) == {}


def test_buckets_take_each_buckets_cap_and_cut_at_dependences():
    """torch 2.13's own greedy bucketing caps every bucket at bucket 0's size; ours cuts the first
    at caps[0] and the rest at caps[1], and starts a new bucket where a collective depends on the
    one being filled (whose output it would have to wait for)."""
    from torch._inductor.fx_passes import bucketing

    from autopar.passes.inductor_comm import KINDS, buckets

    c10d = torch.ops._c10d_functional
    graph = torch.fx.Graph()
    grads = [graph.placeholder(f"g{i}") for i in range(5)]
    sizes = [2**18, 2**18, 2**20, 2**20, 2**18]  # elements of fp32: 1, 1, 4, 4, 1 MiB
    waited = []
    for i, (grad, numel) in enumerate(zip(grads, sizes)):
        grad.meta["val"] = torch.empty(numel, device="meta")
        source = grad if i != 4 else graph.call_function(torch.ops.aten.add.Tensor, (grad, waited[3]))
        source.meta["val"] = grad.meta["val"]
        reduce = graph.call_function(c10d.all_reduce.default, (source, "sum", "g"))
        reduce.meta["val"] = grad.meta["val"]
        wait = graph.call_function(c10d.wait_tensor.default, (reduce,))
        wait.meta["val"] = grad.meta["val"]
        waited.append(wait)
    graph.output(tuple(waited))
    is_kind, key, _ = KINDS["all_reduce"]
    got = buckets(graph, is_kind, key, (2 * 2**20, 8 * 2**20))
    names = [[node.args[0].name if node.args[0].op == "placeholder" else "g4" for node in bucket] for bucket in got]
    # 2 MiB: g0+g1; 8 MiB: g2+g3; g4 reads g3's reduced value: a bucket of its own (dropped: alone)
    assert names == [["g0", "g1"], ["g2", "g3"]], names
    assert all(bucketing.is_all_reduce_tensor(node) for bucket in got for node in bucket)


def test_all_gathers_are_bucketed_one_layer_at_a_time():
    """The compiled mode's gathers of one layer share a bucket and no other layer's join it (its
    regather in backward then waits for its own backward, as ir.gathers groups the eager ones)."""
    from autopar.passes.inductor_comm import KINDS, buckets

    c10d = torch.ops._c10d_functional
    graph = torch.fx.Graph()
    for i, layer in enumerate(["h.0", "h.0", "h.1", "h.1", ""]):
        shard = graph.placeholder(f"w{i}")
        shard.meta["val"] = torch.empty(16, device="meta")
        gather = graph.call_function(c10d.all_gather_into_tensor.default, (shard, 2, "g"))
        gather.meta.update(val=torch.empty(32, device="meta"), custom={collectives.LAYER_ANNOTATION: layer})
        wait = graph.call_function(c10d.wait_tensor.default, (gather,))
        wait.meta["val"] = gather.meta["val"]
    is_kind, key, _ = KINDS["all_gather"]
    got = [[node.args[0].name for node in bucket] for bucket in buckets(graph, is_kind, key, (2**20, 2**20))]
    assert got == [["w0", "w1"], ["w2", "w3"]], got
