"""An optimizer over a compiled module's parameters that loads a whole state (Trainer's resume,
``torch.load`` of one process's ``optimizer.pt``) steps its shards: the step after the load cuts
each whole state tensor to the parameter's shard (DTensor parameters, a plan that shards them),
and equals the step of the optimizer it was saved from. Plain parameters (a plan that replicates
every one, as on one rank) keep the whole state as loaded."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.errors import CheckpointError
from autopar.ops.params import local_of

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt"))
from model import GPT, GPTConfig  # noqa: E402

pytest.importorskip("transformers")  # whole_optimizer_state's module imports it


def _compiled(world: int):
    torch.manual_seed(0)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    model = GPT(GPTConfig())
    plan = autopar.hand_plan("fsdp", model, (world,), example_inputs=batch, cluster="cpu")
    return autopar.compile(model, (world,), example_inputs=batch, plan=plan), batch


def _reloaded(optimizer: torch.optim.Optimizer) -> dict:
    from autopar.runtime.trainer_checkpoints import whole_optimizer_state

    file = io.BytesIO()
    torch.save(whole_optimizer_state(optimizer), file)  # whole plain tensors, as one process writes optimizer.pt
    file.seek(0)
    return torch.load(file)


def _load_then_step(rank: int, world: int) -> dict:
    """Both orders: a whole state loaded into a new optimizer before its first step (Trainer's
    resume), and into one that has stepped."""
    pm, batch = _compiled(world)
    kind = DTensor if world > 1 else torch.Tensor
    first = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for _ in range(2):  # state worth saving
        pm(*batch)[1].backward()
        first.step()
        first.zero_grad()
    saved = _reloaded(first)
    out = {"saved_plain": all(type(v) is torch.Tensor for s in saved["state"].values() for v in s.values())}
    second = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    second.load_state_dict(saved)
    pm(*batch)[1].backward()
    before = [local_of(p.detach()).clone() for p in pm.parameters()]
    first.step()
    after_first = [local_of(p.detach()).clone() for p in pm.parameters()]
    with torch.no_grad():
        for param, value in zip(pm.parameters(), before):
            local_of(param).copy_(value)
    second.step()  # cuts the loaded state first where the parameters are DTensors (runtime.loaded_state)
    out["same_step"] = all(torch.equal(local_of(p.detach()), want) for p, want in zip(pm.parameters(), after_first))
    out["kind_before_step"] = all(type(second.state[p]["exp_avg"]) is kind for p in pm.parameters())
    first.load_state_dict(_reloaded(first))  # after its first step: cut at the load
    out["kind_after_step"] = all(type(first.state[p]["exp_avg"]) is kind for p in pm.parameters())
    out["rank_0s_file"] = _rank_0s_file_everywhere(pm, batch, first)
    return out


def _rank_0s_file_everywhere(pm, batch, optimizer: torch.optim.Optimizer) -> str:
    """``torch.save(opt.state_dict())`` on rank 0 alone, as DDP scripts save, loaded on every rank:
    DTensor shards, rank 0's, which the other ranks would step without a word (0.15 off eager
    after one AdamW step) where the plan shards the parameters."""
    file = io.BytesIO()
    torch.save(optimizer.state_dict(), file)
    shared = [file.getvalue()]
    torch.distributed.broadcast_object_list(shared, src=0)
    loaded = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    loaded.load_state_dict(torch.load(io.BytesIO(shared[0]), weights_only=False))
    pm(*batch)[1].backward()
    try:
        loaded.step()
    except CheckpointError as error:
        return str(error)
    return "stepped"


def _check(result: dict, world: int = 1) -> None:
    refused = result.pop("rank_0s_file")
    assert result == {"saved_plain": True, "same_step": True, "kind_before_step": True, "kind_after_step": True}
    if world == 1:
        assert refused == "stepped"  # plain parameters, whole state: nothing to refuse
    else:  # rank 1's own refusal, and rank 0's word of it
        assert re.search(r"optimizer state '\w+' of parameter .* holding the shard of mesh coordinate \(0,\)", refused)
        assert "set_optimizer_state_dict" in refused, refused


def test_a_whole_state_loads_into_plain_parameters_as_it_is(world_of_one):
    _check(_load_then_step(0, 1))


@pytest.mark.multiproc
def test_a_whole_state_loaded_into_dtensor_parameters_is_cut_to_their_shards(rank_pool):
    for result in rank_pool(2).run(_load_then_step, timeout_s=240):
        _check(result, world=2)
