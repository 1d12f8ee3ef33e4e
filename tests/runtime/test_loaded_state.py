"""An optimizer over a compiled module's parameters that loads a whole state (Trainer's resume,
``torch.load`` of one process's ``optimizer.pt``) steps its shards: the step after the load cuts
each whole state tensor to the parameter's shard, and equals the step of the optimizer it was saved from."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from autopar.runtime.trainer_checkpoints import whole_optimizer_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt"))
from model import GPT, GPTConfig  # noqa: E402

pytest.importorskip("transformers")  # whole_optimizer_state's module imports it


def test_a_whole_optimizer_state_loaded_into_a_torch_optimizer_steps_the_shards(world_of_one):
    torch.manual_seed(0)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    pm = autopar.compile(GPT(GPTConfig()), (1,), example_inputs=batch, cluster="cpu")
    first = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for _ in range(2):  # state worth saving
        pm(*batch)[1].backward()
        first.step()
        first.zero_grad()
    file = io.BytesIO()
    torch.save(whole_optimizer_state(first), file)  # whole plain tensors, as one process writes optimizer.pt
    file.seek(0)
    saved = torch.load(file)
    assert all(type(v) is torch.Tensor for s in saved["state"].values() for v in s.values())
    second = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    second.load_state_dict(saved)
    assert not any(isinstance(v, DTensor) for s in second.state.values() for v in s.values())
    pm(*batch)[1].backward()
    before = [p.detach().to_local().clone() for p in pm.parameters()]
    first.step()
    after_first = [p.detach().to_local().clone() for p in pm.parameters()]
    with torch.no_grad():
        for param, value in zip(pm.parameters(), before):
            param.to_local().copy_(value)
    second.step()  # cuts the loaded state first (runtime.loaded_state)
    for param, want in zip(pm.parameters(), after_first):
        assert torch.equal(param.detach().to_local(), want)
    assert all(isinstance(second.state[p]["exp_avg"], DTensor) for p in pm.parameters())


def test_a_state_loaded_after_the_first_step_is_cut_at_the_load(world_of_one):
    torch.manual_seed(0)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    pm = autopar.compile(GPT(GPTConfig()), (1,), example_inputs=batch, cluster="cpu")
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(*batch)[1].backward()
    optimizer.step()
    file = io.BytesIO()
    torch.save(whole_optimizer_state(optimizer), file)
    file.seek(0)
    optimizer.load_state_dict(torch.load(file))
    assert all(isinstance(optimizer.state[p]["exp_avg"], DTensor) for p in pm.parameters())
