"""Where gradients are reduced under a precision policy, and in which dtype (``passes.precision``).

The passes run on the traced graph with made-up group names, as in tests/passes/test_schedule.py;
the numbers are checked against eager on gloo in tests/runtime/test_precision.py.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.ir.gathers import gather_groups, param_layer
from autopar.ir.options import CommOptions, precision_policy
from autopar.ops import collectives
from autopar.ops.buckets import GradBuckets, ParamGathers
from autopar.passes import default_passes, run_passes
from autopar.passes.precision import is_param_cast
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.conftest import bucket_reads

# The configurations under which the cpu preset splits the batch (tests/passes/test_schedule.py).
CONFIG = dict(vocab_size=1024, block_size=64, n_layer=2, n_head=4, n_embd=128)
FSDP_CONFIG = dict(vocab_size=4096, block_size=128, n_layer=1, n_head=8, n_embd=256)


def _rewritten(kind: str, precision: str, options: CommOptions | None = None, config: dict = CONFIG):
    model = build_model("gpt", seed=0, **config)
    batch = example_batch("gpt", 16, seed=1, vocab_size=config["vocab_size"], block_size=config["block_size"])
    plan = autopar.hand_plan(kind, model, (2,), example_inputs=batch, cluster="cpu", precision=precision)
    traced = trace(model, batch, None, plan.precision)
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    gm = run_passes(copy.deepcopy(traced.gm), plan, default_passes(("g0",), None, fqns, options))
    return gm, plan, traced


@pytest.fixture(scope="module")
def one_rank_world():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialized")
    torch.distributed.init_process_group(
        "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30)
    )
    yield
    torch.distributed.destroy_process_group()


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _param_path_reductions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """allreduce_grad nodes whose gradient flows on to a parameter (through casts and
    collectives only): the parameter gradient reductions the graph still runs itself."""
    found = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is collectives.allreduce_grad:
            source = node.args[0]
            while source.op == "call_function" and (
                is_param_cast(source) or getattr(source.target, "__module__", "") == collectives.__name__
            ):
                source = source.args[0]
            if source.op == "placeholder" and source.name.startswith("p_"):
                found.append(node)
    return found


def _reads_bf16(node: torch.fx.Node) -> bool:
    """Whether ``node`` reads its first argument after a parameter cast (so in bf16)."""
    source = node.args[0]
    while source.op == "call_function" and getattr(source.target, "__module__", "") == collectives.__name__:
        source = source.args[0]
    return is_param_cast(source)


def test_ddp_buckets_reduce_fp32_masters_and_casts_follow():
    gm, plan, traced = _rewritten("ddp", "bf16-mixed")
    buckets: GradBuckets = gm.get_submodule("grad_buckets")
    slots = [slot for bucket in buckets.buckets for slot in bucket.slots]
    assert slots, "the DDP plan splits the batch, so its parameter gradients are reduced"
    assert {slot.dtype for slot in slots} == {torch.float32}, "gradient buckets reduce in reduce_dtype (fp32)"
    reads = bucket_reads(gm)
    assert sorted(reads) == sorted(slot.key for slot in slots)
    for call in reads.values():
        param = call.args[0].args[call.args[1]]
        assert param.op == "placeholder" and _dtype(param) == torch.float32
        assert all(is_param_cast(user) and user.kwargs["dtype"] == torch.bfloat16 for user in call.users), (
            f"{call.name} must feed its parameter's cast to bf16, got {list(call.users)}"
        )
    assert not _param_path_reductions(gm), "every parameter gradient reduction went to the buckets"


def test_fsdp_gathers_bf16_and_reduce_scatters_fp32():
    gm, plan, traced = _rewritten("fsdp", "bf16-mixed", config=FSDP_CONFIG)
    gathers: ParamGathers = gm.get_submodule("param_gathers")
    buckets: GradBuckets = gm.get_submodule("grad_buckets")
    gathered = {key for key, *_ in gathers.order}
    assert gathered and {gathers._dtypes[key] for key in gathered} == {torch.bfloat16}, "FSDP2 gathers in param_dtype"
    slots = [slot for bucket in buckets.buckets for slot in bucket.slots if slot.kind == "reduce_scatter"]
    assert slots and {slot.dtype for slot in slots} == {torch.float32}, "and reduce-scatters in reduce_dtype"
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "param_gathers"]
    assert not any(is_param_cast(user) for call in calls for user in call.users), "the gather casts; no cast after it"


@pytest.mark.parametrize("kind, config", [("ddp", CONFIG), ("fsdp", FSDP_CONFIG)])
def test_the_traced_casts_keep_their_names(kind, config):
    """Checkpoint segments are named by their first and last node, often a parameter's cast."""
    gm, plan, traced = _rewritten(kind, "bf16-mixed", config=config)
    casts = {n.name for n in traced.gm.graph.nodes if is_param_cast(n)}
    assert casts and casts <= {n.name for n in gm.graph.nodes}


def test_per_use_collectives_reduce_before_the_cast():
    """Without the schedule, each use keeps its own all-reduce: on the fp32 side of the cast."""
    gm, plan, traced = _rewritten("ddp", "bf16-mixed", CommOptions(enabled=False))
    reductions = _param_path_reductions(gm)
    assert reductions, "the DDP plan reduces parameter gradients"
    assert not [n for n in reductions if _reads_bf16(n)], "no parameter gradient is reduced in bf16"
    assert all(_dtype(n.args[0]) == torch.float32 or n.args[0].op == "placeholder" for n in reductions)


def test_32_true_graphs_are_untouched_by_the_precision_passes():
    model = build_model("gpt", seed=0, **CONFIG)
    batch = example_batch("gpt", 16, seed=1, vocab_size=CONFIG["vocab_size"], block_size=CONFIG["block_size"])
    plan = autopar.hand_plan("ddp", model, (2,), example_inputs=batch, cluster="cpu")
    traced = trace(model, batch)
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    passes = default_passes(("g0",), None, fqns)
    without = [p for p in passes if getattr(p, "__module__", "") != "autopar.passes.precision"]
    assert len(without) == len(passes) - 2
    full = run_passes(copy.deepcopy(traced.gm), plan, passes)
    plain = run_passes(copy.deepcopy(traced.gm), plan, without)
    assert full.code == plain.code
    assert not [n for n in full.graph.nodes if n.target is torch.ops.aten._to_copy.default]


def test_floating_inputs_are_cast_to_param_dtype():
    model = build_model("mlp", seed=0)
    batch = example_batch("mlp", 8, seed=1)
    traced = trace(model, batch, None, precision_policy("bf16-mixed"))
    users = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("p_")}
    assert {str(_dtype(n)) for n in users.values()} == {"torch.bfloat16"}
    policy = precision_policy("bf16-mixed")
    cast = policy.cast_inputs((torch.ones(2), torch.ones(2, dtype=torch.long), {"k": torch.ones(1, dtype=torch.float64)}))
    assert [cast[0].dtype, cast[1].dtype, cast[2]["k"].dtype] == [torch.bfloat16, torch.long, torch.bfloat16]
    assert precision_policy("32-true").cast_inputs(batch) is batch


# FSDP2's default policy: bf16 compute and gradient reductions, fp32 master weights.
FSDP2 = autopar.MixedPrecision("bfloat16", "bfloat16", "float32", name="fsdp2")


@pytest.mark.parametrize("kind, config", [("ddp", CONFIG), ("fsdp", FSDP_CONFIG)])
def test_a_bf16_reduce_dtype_reduces_bf16_and_lands_in_the_fp32_masters(kind, config):
    gm, plan, traced = _rewritten(kind, FSDP2, config=config)
    buckets: GradBuckets = gm.get_submodule("grad_buckets")
    slots = [slot for bucket in buckets.buckets for slot in bucket.slots]
    kinds = {"ddp": {"all_reduce"}, "fsdp": {"reduce_scatter"}}[kind]
    assert kinds <= {slot.kind for slot in slots}, slots
    assert {slot.dtype for slot in slots} == {torch.bfloat16}, "every bucket reduces in reduce_dtype"
    stored = {n.name: _dtype(n) for n in gm.graph.nodes if n.op == "placeholder" and n.name.startswith("p_")}
    assert {stored[slot.key] for slot in slots} == {torch.float32}, "the gradients land in the fp32 masters"
    assert not _param_path_reductions(gm), "every parameter gradient reduction went to the buckets"
    # bf16-mixed keeps its fp32 buckets (test_ddp_buckets_reduce_fp32_masters_and_casts_follow)


def test_per_use_reductions_of_a_bf16_reduce_dtype_cast_down_and_back():
    """Without the schedule each use keeps its all-reduce on the fp32 side of the cast, told to
    sum in reduce_dtype; under bf16-mixed it is told nothing (it sums fp32)."""
    gm, plan, traced = _rewritten("ddp", FSDP2, CommOptions(enabled=False))
    reductions = _param_path_reductions(gm)
    assert reductions and not [n for n in reductions if _reads_bf16(n)]
    assert {n.kwargs.get("reduce_dtype") for n in reductions} == {torch.bfloat16}
    mixed, _, _ = _rewritten("ddp", "bf16-mixed", CommOptions(enabled=False))
    assert {n.kwargs.get("reduce_dtype") for n in _param_path_reductions(mixed)} == {None}


def test_allreduce_grad_sums_in_its_reduce_dtype(one_rank_world):
    """On one rank the sum is the gradient itself: cast down to bf16 and back up (an fp32
    gradient of 1 + 2**-12 is not a bf16 value)."""
    group = torch.distributed.group.WORLD.group_name
    x = torch.zeros(3, requires_grad=True)
    (collectives.allreduce_grad(x, group, reduce_dtype=torch.bfloat16) * (1 + 2**-12)).sum().backward()
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, torch.ones(3))
    y = torch.zeros(3, requires_grad=True)
    (collectives.allreduce_grad(y, group) * (1 + 2**-12)).sum().backward()
    assert torch.equal(y.grad, torch.full((3,), 1 + 2**-12)), "without reduce_dtype it sums its own dtype"


def test_gathers_prefetch_by_the_bytes_they_move():
    """A parameter gathered in bf16 counts bf16 bytes against the prefetch window."""
    gm, plan, traced = _rewritten("fsdp", "bf16-mixed", config=FSDP_CONFIG)
    gathers: ParamGathers = gm.get_submodule("param_gathers")
    placeholders = {n.name: n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"}
    for key, _group, _dim, nbytes in gathers.order:
        assert gathers._dtypes[key] == torch.bfloat16
        assert nbytes == placeholders[key].numel() * 2, "the whole tensor (the placeholder holds it whole), in bf16"
    assert gathers._group_bytes == [sum(gathers.order[gathers._index[k]][3] for k in g) for g in gathers.groups]


def test_gathers_are_grouped_by_the_bytes_they_move():
    """Under bf16-mixed a layer's gathers fill one collective by their bf16 bytes, as the cost
    model groups them (``solver.pricing.comm_schedule``), not by their fp32 masters' bytes."""
    cap = 256 * 2**10  # two 256 x 256 weights in bf16, one in fp32
    gm, plan, traced = _rewritten("fsdp", "bf16-mixed", CommOptions(gather_group_bytes=cap), config=FSDP_CONFIG)
    gathers: ParamGathers = gm.get_submodule("param_gathers")
    fqns = {gi.name: gi.fqn for gi in traced.inputs if gi.kind == "param"}
    moved = {key: nbytes for key, _group, _dim, nbytes in gathers.order}  # bf16 bytes (the last test)
    want = gather_groups([(key, param_layer(fqns[key]), None, nbytes) for key, nbytes in moved.items()], cap)
    assert gathers.groups == [tuple(group) for group in want]
    assert any(len(group) > 1 and 2 * sum(moved[key] for key in group) > cap for group in gathers.groups), gathers.groups


@pytest.mark.parametrize(
    "precision, needle",
    [
        (autopar.MixedPrecision("bfloat16", "float32"), "master_dtype='float32'"),
        (autopar.MixedPrecision("float16", master_dtype="float32"), "reduce_dtype='bfloat16'"),
    ],
)
def test_what_the_runtime_does_not_carry_out_is_refused(precision, needle):
    from autopar.runtime.compile_checks import check_precision_runs

    with pytest.raises(PlanError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check_precision_runs(precision_policy(precision))


def test_what_the_runtime_carries_out_is_accepted():
    from autopar.runtime.compile_checks import check_precision_runs

    for precision in (
        "32-true",
        "bf16-mixed",
        "bf16-true",
        autopar.MixedPrecision("bfloat16"),
        autopar.MixedPrecision("float16", "float32", "float32"),
        FSDP2,
        autopar.MixedPrecision("bfloat16", master_dtype="float32"),
    ):
        check_precision_runs(precision_policy(precision))


def test_a_precision_that_contradicts_the_plan_is_refused():
    from autopar.ir.given_plan import precision_of

    model = build_model("mlp", seed=0)
    plan = autopar.plan(model, (2,), example_inputs=example_batch("mlp", 8, seed=1), cluster="cpu", precision="bf16-mixed")
    assert precision_of(plan, None).name == "bf16-mixed"
    assert precision_of(plan, "bf16-mixed").name == "bf16-mixed"
    assert precision_of(plan, autopar.MixedPrecision("bfloat16", "float32", "float32")).name == "bf16-mixed"
    with pytest.raises(PlanError, match="contradicts the plan"):
        precision_of(plan, "32-true")
