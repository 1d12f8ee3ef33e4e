"""A plan priced for a declared optimizer holds the training loop to it (``runtime.optim_guard``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.runtime.optim_guard import running
from autopar.zoo.models import MLP


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
        (torch.optim.Adagrad([param]), (None, None)),
    ]
    for optimizer, named in cases:
        assert running(optimizer, optimizer.param_groups[0], param) == named, optimizer
