"""Trainer's checkpoints of a compiled module (``autopar.runtime.trainer_checkpoints``): what it
refuses at once, on every rank (best-model tracking: tests/test_errors.py). The save and resume
themselves, on 2 ranks against one eager process, are in tests/runtime/test_hf_trainer.py."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("transformers")


def _args(**overrides):
    base = {"load_best_model_at_end": False, "save_strategy": "steps"}
    return types.SimpleNamespace(**{**base, **overrides})


def test_a_model_that_is_not_compiled_is_refused_with_the_fix() -> None:
    import autopar

    callback = autopar.checkpoint.trainer_callback()
    with pytest.raises(autopar.checkpoint.CheckpointError, match=r"Trainer\(model=pm\).*given Linear"):
        callback.on_init_end(_args(), None, None, model=torch.nn.Linear(2, 2))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_whole_optimizer_state_loads_back_and_a_wrong_shape_is_refused(one_rank_group) -> None:
    """On one rank the plan replicates every parameter, so they and their optimizer state are
    plain tensors: the whole state loads back as it is (nothing to cut). Cutting whole state into
    DTensor shards is tested on two ranks (``test_hf_trainer``, whose plan shards parameters)."""
    from torch.distributed.tensor import DTensor

    import autopar
    from autopar.runtime.trainer_checkpoints import shard_whole_state, whole_optimizer_state
    from autopar.zoo.models import build_model, example_batch

    batch = example_batch("mlp", 8)
    pm = autopar.compile(build_model("mlp"), mesh=(1,), example_inputs=batch)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm(*batch).backward()  # the model returns its loss
    optimizer.step()
    whole = whole_optimizer_state(optimizer)
    assert all(not isinstance(v, DTensor) for entry in whole["state"].values() for v in entry.values())
    assert not any(isinstance(p, DTensor) for p in pm.parameters())

    resumed = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    resumed.load_state_dict(whole)  # as Trainer's resume loads optimizer.pt: whole plain tensors
    assert shard_whole_state(pm, resumed) == 0
    for param in pm.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(resumed.state[param][key], optimizer.state[param][key], rtol=0, atol=0)

    param = next(iter(pm.parameters()))
    resumed.state[param]["exp_avg"] = torch.zeros(param.numel() + 1)
    with pytest.raises(autopar.checkpoint.CheckpointError, match="'exp_avg' of parameter .* another model"):
        shard_whole_state(pm, resumed)
