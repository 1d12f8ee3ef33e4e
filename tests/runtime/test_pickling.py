"""``torch.save(pm)`` and pickling ``pm.module`` fail at once with the fix (its state, or a DCP
checkpoint), not with pickle's "attribute lookup DistributedGPT failed"; ``copy.deepcopy`` still works."""

from __future__ import annotations

import copy
import io
import pickle
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import CheckpointError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "nanogpt"))
from model import GPT, GPTConfig  # noqa: E402


def test_pickling_the_compiled_module_names_what_to_save(world_of_one):
    torch.manual_seed(0)
    batch = (torch.randint(0, 128, (4, 32)), torch.randint(0, 128, (4, 32)))
    pm = autopar.compile(GPT(GPTConfig()), (1,), example_inputs=batch, cluster="cpu")
    for save in (lambda: torch.save(pm, io.BytesIO()), lambda: pickle.dumps(pm.module)):
        with pytest.raises(CheckpointError) as info:
            save()
        message = str(info.value)
        assert message.startswith("a compiled module cannot be pickled")
        assert "pm.module.state_dict() on every rank" in message and "autopar.checkpoint.save(path, pm, optimizer)" in message
    state = io.BytesIO()
    torch.save(pm.module.state_dict(), state)  # what the message says works, and loads into a plain model
    state.seek(0)
    GPT(GPTConfig()).load_state_dict(torch.load(state))
    twin = copy.deepcopy(pm)  # a copy in this process stays possible (swa_utils.AveragedModel)
    assert type(twin.module).__name__ == "DistributedGPT"
    assert torch.equal(twin(*batch)[1], pm(*batch)[1])
