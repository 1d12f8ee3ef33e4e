"""The compiled mode in one process (a world of one over gloo): numbers, inductor's cache, refusals.
The multi-rank checks are tests/zoo/test_zoo_compiled.py (one shared spawn)."""

from __future__ import annotations

import copy

import pytest
import torch

import autopar
from autopar.runtime.launch import max_rel_diff
from autopar.zoo.models import build_model, example_batch
from tests.conftest import eager_grads


def _compiled_step(config: dict):
    model = build_model("mlp", seed=0, **config)
    eager = copy.deepcopy(model)
    batch = example_batch("mlp", batch_size=4, seed=1, **config)
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler="inductor")
    loss = pm(*batch)
    loss.backward()
    want = eager(*batch)
    want.backward()
    return pm, loss, want, max_rel_diff(pm.full_grads(), eager_grads(eager))


def test_compiled_mode_equals_eager_and_hits_inductors_cache_when_compiled_again(world_of_one):
    from torch._dynamo.utils import counters

    config = dict(d_in=8, d_hidden=16, d_out=4)
    pm, loss, want, grads = _compiled_step(config)
    assert pm._compiled_graph.first_call_s is not None, "the first call compiled (and timed) the graph"
    assert pm.plan.predicted.executor == "inductor"
    assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    assert max(grads.values()) <= 1e-4, grads
    torch._dynamo.reset()  # forget the compiled code, keep inductor's on-disk cache
    counters.clear()
    _compiled_step(config)
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1, dict(counters["inductor"])


def test_compiler_is_checked_and_offload_refused(world_of_one):
    model = build_model("mlp", seed=0, d_in=8, d_hidden=16, d_out=4)
    batch = example_batch("mlp", batch_size=4, seed=1, d_in=8, d_hidden=16, d_out=4)
    with pytest.raises(ValueError, match="compiler must be None"):
        autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler="tvm")
    with pytest.raises(ValueError, match="offloading"):
        autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", compiler="inductor", offload="cpu")


def _hand_plans_compiled(rank: int, world: int) -> dict:
    """On each rank: the small GPT under the ddp and fsdp hand plans, compiled with inductor
    (buckets small enough that backward has several), against eager; and which gloo
    collectives the compiled step ran (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from autopar.zoo.models import GPT

    out = {}
    for kind in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)  # big enough to split the batch
        eager = copy.deepcopy(model)
        idx = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(1))
        batch = (idx, idx.roll(1, 1))
        plan = autopar.hand_plan(kind, model, (world,), example_inputs=batch, cluster="cpu")
        comm = autopar.CommOptions(bucket_cap_bytes=256 * 2**10, first_bucket_cap_bytes=16 * 2**10)
        pm = autopar.compile(model, (world,), example_inputs=batch, plan=plan, comm=comm, compiler="inductor")
        loss = pm(*batch)
        loss.backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:  # a compiled step (the first compiles)
            pm(*batch).backward()
        want = eager(*batch)
        want.backward()
        want_grads = eager_grads(eager)
        scale = max(grad.abs().max().item() for grad in want_grads.values())
        # an attention key bias's gradient is zero in exact arithmetic: rounding noise, left out
        got = {name: grad / 2 for name, grad in pm.full_grads().items()}  # two steps' gradients
        grads = {
            name: rel
            for name, rel in max_rel_diff(got, want_grads).items()
            if want_grads[name].abs().max().item() >= 1e-6 * scale
        }
        ran = {event.key: event.count for event in prof.key_averages() if "c10d" in event.key}
        out[kind] = (loss.item(), want.item(), max(grads.values()), ran)
    return out


@pytest.mark.multiproc
def test_hand_plans_compiled_on_two_ranks_equal_eager_with_buckets_and_gloo_exchanges(rank_pool):
    """The ddp plan's gradient all-reduces go in buckets (not one per parameter), and the fsdp
    plan's reduce-scatters run as all-to-alls on gloo (``passes.inductor_comm``), with eager's
    numbers."""
    results = rank_pool(2).run(_hand_plans_compiled, timeout_s=900)
    for rank, by_kind in enumerate(results):
        for kind, (loss, want, grad_rel, ran) in by_kind.items():
            assert abs(loss - want) <= 1e-5 * abs(want), (rank, kind, loss, want)
            assert grad_rel <= 1e-4, (rank, kind, grad_rel)
        ddp, fsdp = by_kind["ddp"][3], by_kind["fsdp"][3]
        # 28 gradients (2 x 12 + 4 parameters, 463 KiB) in 256 KiB buckets, and the loss's in forward
        assert 3 <= ddp.get("c10d::allreduce_", 0) <= 6, ddp
        assert fsdp.get("c10d::alltoall_base_", 0) >= 1 and not any("reduce_scatter" in key for key in fsdp), fsdp
