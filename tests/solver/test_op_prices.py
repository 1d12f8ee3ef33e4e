"""The loss's all-reduce that rides the data check (``op_prices.rides_data_check``)."""

from __future__ import annotations

import torch

import autopar
from autopar.solver.problem.op_prices import kernel_collectives, pricing_without_rides
from autopar.zoo.models import GPT


def _loss_strategy(plan: autopar.Plan):
    from autopar.rules.registry import Strategy

    node = plan.nodes["cross_entropy_loss"]
    return Strategy(node.ins, node.outs, node.kernel, node.kernel_axes, node.source, node.whole_grad)


def _small_gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """bench_param_path.py's host-bound GPT: its 4-rank logits gather (192 KiB) once cost less
    than a 16-byte all-reduce on the "cpu" preset."""
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=32, n_layer=4, n_head=4, n_embd=64)
    generator = torch.Generator().manual_seed(1)
    idx, targets = (torch.randint(0, 256, (8, 32), generator=generator) for _ in range(2))
    return model, (idx, targets)


def test_a_data_parallel_loss_rides_the_data_check_and_keeps_its_logits_split():
    """On a 1-D mesh the batch-split loss's all-reduce is carried by the data check's all-gather
    (``runtime.data``), so it is priced at nothing: the 4-rank ddp plan splits the loss by rows
    instead of gathering the logits to every rank, and is predicted faster for it. Priced as a
    collective of its own (as pipelined plans price it), the gather wins, as it did before."""
    model, batch = _small_gpt()
    riding = autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster="cpu")
    with pricing_without_rides():
        apart = autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster="cpu")
    assert riding.nodes["cross_entropy_loss"].kernel == "cross_entropy_mean", riding.summary()
    assert apart.nodes["cross_entropy_loss"].kernel is None, apart.summary()  # the logits gathered whole
    assert riding.predicted.step_time_s < apart.predicted.step_time_s
    strategy = _loss_strategy(riding)
    assert kernel_collectives(None, strategy, (4,), True) == []
    with pricing_without_rides():
        assert kernel_collectives(None, strategy, (4,), True) == [("all_reduce", 16, 0)]


def test_only_the_first_all_reduce_on_the_only_split_axis_rides():
    """The check settles at the forward's first collective, so a second axis's all-reduce runs
    as it is; on a mesh of two split axes the loss meets a collective first (the other axis's),
    and nothing rides."""
    model, batch = _small_gpt()
    strategy = _loss_strategy(autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster="cpu"))
    for mesh in ((1, 4), (4, 1)):
        axis = mesh.index(4)
        shifted = type(strategy)(strategy.ins, strategy.outs, strategy.kernel, (axis,), strategy.source, strategy.whole_grad)
        assert kernel_collectives(None, shifted, mesh, True) == [], mesh
    both = type(strategy)(strategy.ins, strategy.outs, strategy.kernel, (0, 1), strategy.source, strategy.whole_grad)
    assert kernel_collectives(None, both, (2, 2), True) == [("all_reduce", 16, 0), ("all_reduce", 16, 1)]


def test_nothing_rides_where_inductor_runs_the_graph():
    """A compiled graph's collectives are inductor's own, after the data check settles
    (``runtime.module``): planned for ``compiler="inductor"``, the plan is the one priced without
    the ride, to the byte."""
    model, batch = _small_gpt()
    compiled = autopar.plan(model, (4,), example_inputs=batch, cluster="cpu", compiler="inductor")
    with pricing_without_rides():
        apart = autopar.plan(model, (4,), example_inputs=batch, cluster="cpu", compiler="inductor")
    assert compiled.hash == apart.hash
    eager = autopar.plan(model, (4,), example_inputs=batch, cluster="cpu")
    assert eager.nodes["cross_entropy_loss"].kernel == "cross_entropy_mean", eager.summary()


def test_every_planner_and_the_symbolic_costs_price_an_inductor_plan_alike():
    """Whether the loss rides is decided where every planner passes (``sharding.solve_unexplained``)
    and for ``Plan.predict``'s symbolic costs too: a hand plan on an inductor cluster, and a plan
    with ``symbolic_batch=True``, are the ones priced without the ride, to the byte."""
    import dataclasses

    from autopar.cost.cluster import get_cluster

    model, batch = _small_gpt()
    inductor = dataclasses.replace(get_cluster("cpu"), executor="inductor")
    hand = autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster=inductor)
    symbolic = autopar.plan(model, (4,), example_inputs=batch, cluster="cpu", compiler="inductor", symbolic_batch=True)
    with pricing_without_rides():
        assert hand.hash == autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster=inductor).hash
        apart = autopar.plan(model, (4,), example_inputs=batch, cluster="cpu", compiler="inductor", symbolic_batch=True)
    assert symbolic.hash == apart.hash
    assert hand.hash != autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster="cpu").hash  # the ride counts
