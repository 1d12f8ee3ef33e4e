"""Gradient buckets and parameter gathers on real gloo ranks, against sums written out by hand."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from autopar.ops import collectives
from autopar.ops.buckets import GradBuckets, ParamGathers, Slot, make_buckets


def test_make_buckets_caps_and_keeps_kinds_apart():
    f32 = torch.float32
    slots = [
        Slot("a", "all_reduce", (256,), f32, ("g",)),
        Slot("b", "all_reduce", (256,), f32, ("g",)),
        Slot("c", "all_reduce", (512,), f32, ("g",)),
        Slot("d", "reduce_scatter", (8, 4), f32, ("g",), 0),
        Slot("e", "reduce_scatter", (8, 4), f32, ("g",), 1),
        Slot("f", "all_reduce", (4096,), f32, ("g",)),
    ]
    buckets = make_buckets(slots, cap_bytes=3 * 1024, first_cap_bytes=1024)
    assert [[s.key for s in b.slots] for b in buckets] == [["a"], ["b", "c"], ["d"], ["e"], ["f"]]
    assert buckets[-1].nbytes == 4096 * 4, "a slot over the cap gets a bucket of its own"


def test_the_bucket_node_returns_views_of_its_parameters_and_leaves_frozen_ones_out():
    """One autograd node for the bucket's parameters (autograd's C++ ``apply``, no Python
    preamble): each output is a view of its parameter (activation offload keeps parameters and
    their views resident by ``_base``), and a frozen parameter's output needs no gradient."""
    f32 = torch.float32
    slots = [Slot(key, "all_reduce", (3,), f32, ("g",)) for key in ("p", "q", "frozen")]
    buckets = GradBuckets(make_buckets(slots, cap_bytes=1 << 20))
    params = {key: torch.nn.Parameter(torch.randn(3)) for key in ("p", "q", "frozen")}
    params["frozen"].requires_grad_(False)
    buckets.bind(params)
    outs = buckets(*params.values(), keys=tuple(params))
    assert all(out._base is param and torch.equal(out, param) for out, param in zip(outs, params.values()))
    assert [out.requires_grad for out in outs] == [True, True, False]
    assert outs[0].grad_fn is outs[1].grad_fn and type(outs[0].grad_fn).__name__ == "_SyncGradsBackward"
    single = buckets(params["p"], key="p")
    assert single._base is params["p"] and single.requires_grad


def _run(rank: int, world: int) -> dict:
    # per-parameter gathers, then b and c gathered by one collective (FSDP2's flat copy-in)
    return {
        "single": _scenario(rank, world, None),
        "grouped": _scenario(rank, world, [("b", "c")]),
        "held": _held_back(rank, world),
    }


def _held_back(rank: int, world: int) -> dict:
    """``sync`` off (``pm.no_sync()``): the all-reduce bucket of ``x`` and ``y`` (gradients from
    the bucket alone) launches nothing and shows this rank's unreduced sum in ``.grad``; the next
    synced backward reduces every micro-step at once. ``a`` (a use outside the bucket) and the
    reduce-scatter of ``b`` reduce at every backward. ``zero_grad()`` in between, to None or in
    place, drops what was held. ``u``, in x's bucket, is reached by micro-step 2 only: its
    ``.grad`` stays None until then, and then gets that micro-step's sum."""
    group = dist.group.WORLD.group_name
    f32 = torch.float32
    slots = [
        Slot("x", "all_reduce", (3,), f32, (group,), alone=True),
        Slot("y", "all_reduce", (2,), f32, (group,), alone=True),
        Slot("u", "all_reduce", (2,), f32, (group,), alone=True),
        Slot("a", "all_reduce", (4,), torch.float64, (group,)),  # a bucket of its own: another dtype
        Slot("b", "reduce_scatter", (2 * world,), f32, (group,), 0),
    ]
    buckets = GradBuckets(make_buckets(slots, cap_bytes=1 << 20))
    params = {k: torch.nn.Parameter(torch.zeros(n)) for k, n in (("x", 3), ("y", 2), ("u", 2), ("a", 4), ("b", 2))}
    buckets.bind(params)

    def weights(step: int, r: int) -> dict[str, torch.Tensor]:  # rank r's gradients at micro-step ``step``
        g = torch.Generator().manual_seed(10 * step + r)
        return {k: torch.randn(n, generator=g) for k, n in (("x", 3), ("y", 2), ("u", 2), ("a", 4), ("b", 2 * world))}

    def backward(step: int) -> None:
        w = weights(step, rank)
        b = torch.cat([params["b"]] * world)  # stands for the gathered parameter
        reached = "xyua" if step == 2 else "xya"
        # x, y and u's bucket as the graph calls it (one node for the bucket); a alone, by key
        read = dict(zip("xyu", buckets(params["x"], params["y"], params["u"], keys=("x", "y", "u")), strict=True))
        read["a"] = buckets(params["a"], key="a")
        loss = sum((read[k] * w[k]).sum() for k in reached) + (buckets(b, key="b") * w["b"]).sum()
        (loss + params["a"].sum()).backward()

    def summed(steps: list[int]) -> dict[str, torch.Tensor]:
        total = {k: sum(weights(s, r)[k] for s in steps for r in range(world)) for k in "xyuab"}
        total["a"] = total["a"] + len(steps)  # the use outside the bucket: one per backward, per rank
        total["b"] = total["b"].chunk(world)[rank]
        return total

    out = {}
    buckets.sync = False
    before = buckets.launches
    backward(0)
    out["held_launches"] = buckets.launches - before  # a and b only
    out["unreduced"] = max((params[k].grad - weights(0, rank)[k]).abs().max().item() for k in "xy")
    out["held_numel"] = buckets.held_numel
    out["unreached"] = [params["u"].grad is None]
    try:  # a step on held gradients would move the ranks apart
        torch.optim.SGD(params.values(), lr=0.1).step()
        out["step_inside"] = "stepped"
    except RuntimeError as error:
        out["step_inside"] = str(error)
    buckets.sync = True
    backward(1)
    want = summed([0, 1])
    out["reduced"] = max((params[k].grad - want[k]).abs().max().item() for k in "xyab")
    out["after"] = buckets.held_numel
    out["unreached"].append(params["u"].grad is None)
    for p in params.values():
        p.grad = None
    # zero_grad after a held micro-step: x's to None, y's in place; both drop what was held
    buckets.sync = False
    backward(2)
    params["x"].grad = None
    params["y"].grad.zero_()
    buckets.sync = True
    backward(3)
    want = summed([3])
    out["dropped"] = max((params[k].grad - want[k]).abs().max().item() for k in "xy")
    out["reached_held"] = (params["u"].grad - summed([2])["u"]).abs().max().item()
    return out


def _scenario(rank: int, world: int, gather_groups) -> dict:
    group = dist.group.WORLD.group_name
    torch.manual_seed(0)  # the same parameters everywhere; per-rank weights stand for a split batch
    full_b, full_c = torch.randn(8, 6), torch.randn(2, 8)
    weights = [(torch.randn(3, 4), torch.randn(8, 6), torch.randn(2, 8)) for _ in range(world)]
    slots = [
        Slot("c", "reduce_scatter", (2, 8), torch.float32, (group,), 1),
        Slot("b", "reduce_scatter", (8, 6), torch.float32, (group,), 0),
        Slot("a", "all_reduce", (3, 4), torch.float32, (group,)),
        Slot("d", "all_reduce", (2,), torch.float32, (group,)),  # in a's bucket; the loss never reaches it
    ]
    buckets = GradBuckets(make_buckets(slots, cap_bytes=1 << 20, first_cap_bytes=64))
    a = torch.nn.Parameter(torch.randn(3, 4))
    b = torch.nn.Parameter(full_b.chunk(world, 0)[rank].clone())
    c = torch.nn.Parameter(full_c.chunk(world, 1)[rank].clone())
    gathers = ParamGathers(
        [("b", group, 0, 8 * 6 * 4), ("c", group, 1, 2 * 8 * 4)], prefetch_bytes=1 << 20, grads=buckets, groups=gather_groups
    )
    d = torch.nn.Parameter(torch.randn(2))
    buckets.bind({"a": a, "b": b, "c": c, "d": d})
    gathers.bind({"a": a, "b": b, "c": c})
    w_a, w_b, w_c = weights[rank]

    def forward() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        got_b, got_c = gathers(b, key="b"), gathers(c, key="c")
        # ``a`` has a synced use and a use whose gradient is already whole (left to autograd).
        loss = (buckets(a, key="a") * w_a).sum() + (a * 2).sum() + (got_b * w_b).sum() + (got_c * w_c).sum()
        return loss, got_b.detach(), got_c.detach()

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        loss, got_b, got_c = forward()
        loss.backward()
        return got_b, got_c

    launched = []
    start_all_gather = collectives.start_all_gather
    collectives.start_all_gather = lambda out, x, name: launched.append(x.numel()) or start_all_gather(out, x, name)
    try:
        got_b, got_c = step()
    finally:
        collectives.start_all_gather = start_all_gather
    first = {"a": a.grad.clone(), "b": b.grad.clone(), "c": c.grad.clone()}
    step()  # accumulates into .grad
    total = [sum(w[i] for w in weights) for i in range(3)]
    want = {"a": total[0] + 2, "b": total[1].chunk(world, 0)[rank], "c": total[2].chunk(world, 1)[rank]}
    accumulated = {k: (g.grad - 2 * want[k]).abs().max().item() for k, g in (("a", a), ("b", b), ("c", c))}
    # zero_grad (set to None) frees the .grad views: the next backward reuses the bucket buffers
    spare = {t.untyped_storage().data_ptr() for pair in buckets._spare.values() for t in pair if t is not None}
    for p in (a, b, c):
        p.grad = None
    step()
    reused = b.grad.untyped_storage().data_ptr() in spare  # (a.grad is autograd's: a has an unreduced use)
    after_reuse = {k: (g.grad - want[k]).abs().max().item() for k, g in (("a", a), ("b", b), ("c", c))}
    # a gradient the caller still holds is never overwritten by the next backward
    kept, kept_value = b.grad, b.grad.clone()
    for p in (a, b, c):
        p.grad = None
    step()
    # two forwards, one backward (``pm(x) + pm(y)``): each bucket's slots arrive twice, the second
    # time after the bucket was launched
    for p in (a, b, c):
        p.grad = None
    (forward()[0] + forward()[0]).backward()
    twice = {k: (g.grad - 2 * want[k]).abs().max().item() for k, g in (("a", a), ("b", b), ("c", c))}
    return {
        "unreached_grad": d.grad,  # None, as eager leaves a parameter the loss does not reach
        "twice": twice,
        "reused": reused,
        "after_reuse": after_reuse,
        "kept": (kept - kept_value).abs().max().item(),
        "gathered": (torch.equal(got_b, full_b), torch.equal(got_c, full_c)),
        "first": {k: (first[k] - want[k]).abs().max().item() for k in want},
        "accumulated": accumulated,
        "shapes": (tuple(b.grad.shape), tuple(c.grad.shape)),
        "buckets": len(buckets.buckets),
        "all_gathers": launched,
    }


@pytest.fixture(scope="module")
def one_rank_world():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
def test_a_bf16_slot_reduces_in_bf16_and_the_fp32_grad_gets_the_sum(one_rank_world, kind):
    """A precision policy's reduce_dtype (FSDP2's bf16 reduction with fp32 masters): the
    gradient is cast into the bf16 slot and the reduced one back to fp32. On one rank the sum is
    the gradient itself, so each .grad gets the bf16 rounding of 1 + 2**-12 or 1 + 2**-10 (both 1)."""
    bf16 = torch.bfloat16
    slots = [Slot("w", kind, (2, 3), bf16, (one_rank_world,)), Slot("v", kind, (2, 3), bf16, (one_rank_world,))]
    buckets = GradBuckets(make_buckets(slots, cap_bytes=1 << 20))
    w, v = torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3, requires_grad=True)
    v.grad = torch.full((2, 3), 2.0)  # an earlier use's gradient, which the reduced one adds to
    buckets.bind({"w": w, "v": v})
    ((buckets(w, key="w") * (1 + 2**-12)).sum() + (buckets(v, key="v") * (1 + 2**-10)).sum()).backward()
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, torch.ones(2, 3))
    assert torch.equal(v.grad, torch.full((2, 3), 3.0)), "the bf16 sum (1) added to the fp32 .grad (2)"


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
def test_a_bucket_is_summed_over_its_second_group_as_the_next_one_launches(one_rank_world, kind, monkeypatch):
    """A gradient reduced over two mesh axes (data parallel on both; hybrid sharding's shard over
    the replicas): its bucket's sum over the second group starts as the next bucket launches,
    behind the rest of backward, not at its end. Buckets of one slot each (their sizes name
    them); on one rank every sum is the gradient itself."""
    f32 = torch.float32
    started: list[tuple[int, str]] = []  # (numel, collective) in launch order
    real_reduce, real_scatter = collectives.start_all_reduce, collectives.start_reduce_scatter

    def reduce(x, group):
        started.append((x.numel(), "all_reduce"))
        return real_reduce(x, group)

    def scatter(out, x, group):
        started.append((x.numel(), "reduce_scatter"))
        return real_scatter(out, x, group)

    monkeypatch.setattr(collectives, "start_all_reduce", reduce)
    monkeypatch.setattr(collectives, "start_reduce_scatter", scatter)
    sizes = {"a": 1, "b": 2, "c": 3}
    slots = [Slot(k, kind, (n,), f32, (one_rank_world, one_rank_world)) for k, n in sizes.items()]
    buckets = GradBuckets(make_buckets(slots, cap_bytes=1))
    params = {k: torch.nn.Parameter(torch.zeros(n)) for k, n in sizes.items()}
    buckets.bind(params)
    a, b, c = buckets(*params.values(), keys=tuple(params))
    (a.sum() + 2 * b.sum() + 3 * c.sum()).backward()
    launches = [i for i, (n, what) in enumerate(started) if what == kind and all(m != n for m, _ in started[:i])]
    assert len(launches) == 3 and len(started) == 6, started
    first, last = started[launches[0]][0], launches[-1]
    second_sum = next(i for i, (n, what) in enumerate(started) if i > launches[0] and n == first and what == "all_reduce")
    assert second_sum < last, f"the first bucket's second sum waited for the end of backward: {started}"
    for k, n in sizes.items():
        assert torch.equal(params[k].grad, torch.full((n,), float(list(sizes).index(k) + 1))), k
    # two forwards before one backward: each bucket reduced twice, in two rounds, and both added
    for p in params.values():
        p.grad = None
    first_call, second_call = (buckets(*params.values(), keys=tuple(params)) for _ in range(2))
    (sum(t.sum() for t in first_call) + sum(10 * t.sum() for t in second_call)).backward()
    for k, n in sizes.items():
        assert torch.equal(params[k].grad, torch.full((n,), 11.0)), k


def test_one_node_per_bucket_adds_what_arrived_and_computes_nothing_for_a_frozen_parameter(one_rank_world):
    """The graph's one call per bucket (``passes.schedule``): each parameter whose gradient
    arrived gets it reduced; one that no gradient reached keeps ``.grad`` None; a frozen one's
    read needs no gradient, so nothing computes one for it, and its ``.grad`` stays None too."""
    f32 = torch.float32
    slots = [Slot(k, "all_reduce", (3,), f32, (one_rank_world,), alone=True) for k in "wuf"]
    buckets = GradBuckets(make_buckets(slots, cap_bytes=1 << 20))
    params = {k: torch.nn.Parameter(torch.full((3,), 1.0 + i)) for i, k in enumerate("wuf")}
    params["f"].requires_grad_(False)
    buckets.bind(params)
    w, u, f = buckets(*params.values(), keys=tuple(params))
    assert w.requires_grad and u.requires_grad and not f.requires_grad
    ((w * torch.arange(3.0)).sum() + (f * w).sum()).backward()  # u unused
    assert torch.equal(params["w"].grad, torch.arange(3.0) + 3.0), "d/dw of w·arange + f·w, f = 3"
    assert params["u"].grad is None and params["f"].grad is None
    assert buckets.launches == 1
    # every parameter reached: one copy into the flat bucket; two forwards before one backward
    # fill two rounds, each reduced, and both are added
    params["f"].requires_grad_(True)
    for p in params.values():
        p.grad = None
    first = buckets(*params.values(), keys=tuple(params))
    second = buckets(*params.values(), keys=tuple(params))
    (sum((t * (i + 1)).sum() for i, t in enumerate(first)) + sum((t * 10).sum() for t in second)).backward()
    for i, k in enumerate(params):
        assert torch.equal(params[k].grad, torch.full((3,), i + 11.0)), k
    assert buckets.launches == 3


def test_gathers_start_when_forward_starts_and_a_forward_cut_short_leaves_none(one_rank_world, monkeypatch):
    """Entering the forward's context launches the first group's gather and the next one
    (FSDP2 unshards its root as forward starts); the first use then launches nothing. A forward
    that stopped before using them does not hand its values to the next forward."""
    a, b = torch.nn.Parameter(torch.randn(2, 3)), torch.nn.Parameter(torch.randn(4))
    gathers = ParamGathers([("a", one_rank_world, 0, 24), ("b", one_rank_world, 0, 16)], prefetch_bytes=1, grads=None)
    gathers.bind({"a": a, "b": b})
    launched = []
    start = collectives.start_all_gather
    monkeypatch.setattr(collectives, "start_all_gather", lambda out, x, name: launched.append(x.numel()) or start(out, x, name))
    with gathers.saved_tensors_hooks():
        assert launched == [6, 4], "both groups in flight before the first use"
        got_a, got_b = gathers(a, key="a"), gathers(b, key="b")
    assert launched == [6, 4] and torch.equal(got_a, a) and torch.equal(got_b, b)
    with gathers.saved_tensors_hooks():
        pass  # a forward that stopped before its first gathered use
    with torch.no_grad():
        a.add_(1.0)  # an optimizer step in between
    assert torch.equal(gathers(a, key="a"), a), "the next forward gathers the new values"


@pytest.mark.multiproc
def test_buckets_and_gathers_sum_like_the_collectives_they_replace(rank_pool):
    for rank, results in enumerate(rank_pool(2).run(_run, timeout_s=120)):
        held = results.pop("held")
        assert held["held_launches"] == 2, f"rank {rank}: under no_sync only a's and b's buckets reduce: {held}"
        assert held["unreduced"] == 0.0 and held["held_numel"] == 7, f"rank {rank}: .grad is the rank's own sum: {held}"
        assert held["reduced"] < 1e-5 and held["after"] == 0, f"rank {rank}: one reduction for both micro-steps: {held}"
        assert held["dropped"] < 1e-5, f"rank {rank}: zero_grad() after a held micro-step must drop it: {held}"
        assert held["unreached"] == [True, True], f"rank {rank}: a slot no backward reached keeps .grad None: {held}"
        assert held["reached_held"] < 1e-5, f"rank {rank}: a slot only a held micro-step reached: {held}"
        assert "holds back" in held["step_inside"] and "outside no_sync()" in held["step_inside"], held
        for how, result in results.items():
            where = f"rank {rank}, {how} gathers"
            assert result["gathered"] == (True, True), f"{where}: a gathered parameter is the whole tensor"
            assert result["buckets"] == 3
            assert result["shapes"] == ((4, 6), (2, 4)), f"{where}: the reduce-scattered gradient stays sharded"
            for what in ("first", "accumulated", "after_reuse", "twice"):
                worst = max(result[what].values())
                assert worst < 1e-5, f"{where}: {what} gradients off by {result[what]}"
            assert result["reused"], f"{where}: bucket buffers no .grad views are reused"
            assert result["unreached_grad"] is None, f"{where}: a parameter no gradient reached got {result['unreached_grad']}"
            assert result["kept"] == 0.0, f"{where}: a held gradient was overwritten by the next backward"
        # shards of b (8x6 split on dim 0) and c (2x8 split on dim 1) on 2 ranks: 24 and 8 elements
        assert sorted(results["single"]["all_gathers"]) == [8, 24], "one all-gather per parameter"
        assert results["grouped"]["all_gathers"] == [24 + 8], "a group: ONE all-gather of both shards, flat"


def _exchanges(rank: int, world: int) -> dict[str, float]:
    """Reduce-scatters (gloo: an all-to-all and a local sum) and all-to-alls (one exchange)
    against the whole tensors every rank can compute."""
    group = dist.group.WORLD.group_name

    def full(r: int, *shape: int) -> torch.Tensor:  # rank r's tensor, different on every rank
        return torch.arange(float(torch.Size(shape).numel())).view(shape) * (r + 1) + 100 * r

    errors: dict[str, float] = {}
    for dim in range(3):
        total = sum(full(r, 4, 6, 8) for r in range(world))
        got = collectives.no_grad_reduce_scatter(full(rank, 4, 6, 8), dim, group)
        errors[f"reduce_scatter dim {dim}"] = (got - total.chunk(world, dim)[rank]).abs().max().item()
    flat = full(rank, world * 12)
    out = torch.empty(12)
    collectives.wait(collectives.start_reduce_scatter(out, flat, group), group)
    errors["bucket reduce_scatter"] = (out - sum(full(r, world * 12) for r in range(world)).chunk(world)[rank]).abs().max().item()
    for src, dst, shape in ((0, 1, (4, 6, 8)), (1, 2, (4, 6, 8)), (2, 0, (4, 6, 8)), (2, 1, (4, 6, 8))):
        whole = full(7, *shape)  # the same whole tensor on every rank
        local = whole.chunk(world, src)[rank].clone().requires_grad_()
        got = collectives.all_to_all(local, src, dst, group)
        name = f"all_to_all {src}->{dst}"
        errors[name] = (got - whole.chunk(world, dst)[rank]).abs().max().item()
        upstream = full(3, *shape)  # the whole output gradient; this rank holds its dst chunk
        got.backward(upstream.chunk(world, dst)[rank])
        errors[name + " backward"] = (local.grad - upstream.chunk(world, src)[rank]).abs().max().item()
    return errors


@pytest.mark.multiproc
def test_reduce_scatters_and_all_to_alls_match_the_whole_tensors(rank_pool):
    """On gloo, reduce-scatters run as one all-to-all and a sum, and all-to-alls as one
    exchange: each rank must still get exactly its chunk of the sum (or of the moved tensor)."""
    for rank, errors in enumerate(rank_pool(2).run(_exchanges, timeout_s=120)):
        assert len(errors) == 12
        bad = {name: error for name, error in errors.items() if error != 0.0}
        assert not bad, f"rank {rank}: {bad}"
