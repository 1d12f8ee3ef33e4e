"""A plan priced for a declared optimizer holds the training loop to it (``runtime.optim_guard``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.optim_guard import running
from autopar.zoo.models import MLP, example_batch


@pytest.fixture
def one_rank():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step(optimizer: torch.optim.Optimizer, pm, batch) -> None:
    pm(*batch).backward()
    optimizer.step()
    optimizer.zero_grad()


def test_an_optimizer_holding_more_than_declared_is_refused_at_its_first_step(one_rank):
    torch.manual_seed(0)
    model = MLP(d_in=8, d_hidden=16, d_out=4)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", optimizer="adamw:fused")
    assert pm.plan.optimizer == "adamw:fused"
    for fits in (torch.optim.AdamW(pm.parameters(), fused=True), torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)):
        _step(fits, pm, batch)
        _step(fits, pm, batch)  # checked once, then stepped freely
    before = [p.detach().clone() for p in pm.parameters()]
    foreach = torch.optim.AdamW(pm.parameters(), foreach=True)
    with pytest.raises(autopar.errors.ConfigError, match="adamw:foreach.*optimizer='adamw:fused'.*Plan and compile"):
        _step(foreach, pm, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, pm.parameters()))  # refused before it moved anything
    # the plan's own declaration travels with it; another one beside it is refused
    again = autopar.compile(model, (1,), example_inputs=batch, plan=pm.plan)
    assert again.plan.optimizer == "adamw:fused"
    with pytest.raises(autopar.PlanError, match="optimizer='sgd' contradicts the plan.*'adamw:fused'"):
        autopar.compile(model, (1,), example_inputs=batch, plan=pm.plan, optimizer="sgd")


def test_a_plan_priced_for_sgd_refuses_adams_state(one_rank):
    torch.manual_seed(0)
    model = MLP(d_in=8, d_hidden=16, d_out=4)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", optimizer="sgd")
    _step(torch.optim.SGD(pm.parameters(), lr=0.1), pm, batch)
    with pytest.raises(autopar.errors.ConfigError, match="more state per parameter.*optimizer='sgd'"):
        _step(torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9), pm, batch)


def test_running_names_torchs_optimizers_as_plans_do():
    param = torch.nn.Parameter(torch.zeros(2))
    cases = [
        (torch.optim.AdamW([param], fused=True), ("adamw", "fused")),
        (torch.optim.AdamW([param], foreach=True), ("adamw", "foreach")),
        (torch.optim.AdamW([param]), ("adamw", "for-loop")),  # torch's default off CUDA
        (torch.optim.Adam([param], foreach=False), ("adam", "for-loop")),
        (torch.optim.SGD([param], lr=0.1), ("sgd", "for-loop")),
        (torch.optim.SGD([param], lr=0.1, momentum=0.9, foreach=True), ("sgd-momentum", "foreach")),
        (torch.optim.Adam([param], amsgrad=True, fused=True), ("adam-amsgrad", "fused")),
        (torch.optim.Adagrad([param]), (None, None)),
    ]
    for optimizer, named in cases:
        assert running(optimizer, optimizer.param_groups[0], param) == named, optimizer


def test_a_budget_holds_whatever_optimizer_the_loop_builds(one_rank):
    # Planned for torch's default AdamW under a budget with 2% of room: an optimizer that keeps
    # more state (amsgrad's third moment; RMSprop centered with momentum, a class autopar does
    # not price, measured after its first step) would hold more than the budget, without a word.
    torch.manual_seed(0)
    model = autopar.zoo.models.GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)
    batch = example_batch("gpt", 4)
    free = autopar.plan(model, (1,), example_inputs=batch, cluster="cpu")
    budget = 1.02 * free.predicted.peak_memory_bytes
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", memory_budget=budget)
    assert pm.plan.predicted.peak_memory_bytes <= budget
    for fits in (
        torch.optim.AdamW(pm.parameters()),
        torch.optim.Adagrad(pm.parameters()),
        torch.optim.SGD(pm.parameters(), lr=0.1),
    ):
        _step(fits, pm, batch)
        _step(fits, pm, batch)
    before = [p.detach().clone() for p in pm.parameters()]
    amsgrad = torch.optim.AdamW(pm.parameters(), amsgrad=True)
    with pytest.raises(
        autopar.errors.ConfigError, match=r"AdamW holds .* MiB more optimizer state.*optimizer='adamw-amsgrad:for-loop'"
    ):
        _step(amsgrad, pm, batch)
    assert all(torch.equal(a, b) for a, b in zip(before, pm.parameters()))  # refused before it moved anything
    assert not amsgrad.state
    with pytest.raises(autopar.errors.ConfigError, match=r"adamw-amsgrad"):
        amsgrad.step()  # refused again, not waved through
    rmsprop = torch.optim.RMSprop(pm.parameters(), momentum=0.9, centered=True)  # three tensors a parameter
    with pytest.raises(
        autopar.errors.ConfigError, match=r"RMSprop holds .*measured after its first step.*optimizer='adamw-amsgrad'"
    ):
        _step(rmsprop, pm, batch)
    # declared, the plan makes room for amsgrad's state under the same budget, and it steps
    declared = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", memory_budget=budget, optimizer="adamw-amsgrad")
    assert declared.plan.predicted.peak_memory_bytes <= budget
    for optimizer in (
        torch.optim.AdamW(declared.parameters(), amsgrad=True),
        torch.optim.RMSprop(declared.parameters(), momentum=0.9, centered=True),
    ):
        _step(optimizer, declared, batch)
        _step(optimizer, declared, batch)


def test_a_declared_adam_keeps_no_amsgrad_moment(one_rank):
    torch.manual_seed(0)
    model = MLP(d_in=8, d_hidden=16, d_out=4)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", optimizer="adamw:fused")
    with pytest.raises(autopar.errors.ConfigError, match="adamw-amsgrad:fused, which holds more state per parameter"):
        _step(torch.optim.AdamW(pm.parameters(), fused=True, amsgrad=True), pm, batch)
    with pytest.raises(
        autopar.errors.ConfigError, match=r"RMSprop keeps .* more state.*optimizer='adamw:fused'.*'adamw-amsgrad'"
    ):
        _step(torch.optim.RMSprop(pm.parameters(), momentum=0.9, centered=True), pm, batch)


def test_a_declared_kind_runs_as_torch_runs_it_on_the_plans_cluster(one_rank):
    # "adam" on a GPU cluster is priced as torch's foreach there, its temporary included: torch's
    # Adam(foreach=True) is what was priced, not more.
    torch.manual_seed(0)
    model = MLP(d_in=8, d_hidden=16, d_out=4)
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    pm = autopar.compile(model, (1,), example_inputs=batch, cluster="h100-80g", optimizer="adam")
    _step(torch.optim.Adam(pm.parameters(), foreach=True), pm, batch)
    gloo = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", optimizer="adam")
    with pytest.raises(autopar.errors.ConfigError, match="adam:foreach, which holds half its state again"):
        _step(torch.optim.Adam(gloo.parameters(), foreach=True), gloo, batch)
