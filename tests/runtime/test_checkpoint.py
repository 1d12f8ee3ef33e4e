"""Checkpoints on real gloo ranks: DTensor views, a DCP round trip across mesh shapes and plans,
meta-device compiles, and ``full_state_dict`` loading into the original model.

One spawn of 4 ranks runs every check; the ranks return numbers and the parent asserts.
Reference: an eager AdamW run of the same model, uninterrupted, in float64.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar
from autopar.runtime.tools.launch import max_rel_diff
from autopar.zoo.models import GPT, build_model, example_batch

pytestmark = pytest.mark.multiproc

DTYPE = torch.float64
# No biases: a key-projection bias has an exactly-zero gradient, which AdamW turns into
# full-size steps of rounding noise (see test_parallel.py).
CONFIG = dict(bias=False)
BATCH = 8
STEPS_BEFORE = 2  # AdamW steps before the checkpoint
STEPS_AFTER = 2  # and after it, on each resumed module
LR = 1e-2
TOL = 1e-4


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model("gpt", seed=seed, **CONFIG).to(DTYPE)


def _batch(step: int) -> tuple:
    return example_batch("gpt", batch_size=BATCH, seed=100 + step)


def _train(module, optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = module(*_batch(step))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _resume(pm: autopar.ParallelModule, path: str) -> dict:
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR / 7)  # the checkpoint's lr must win
    autopar.checkpoint.load(path, pm, optimizer)
    lr = optimizer.param_groups[0]["lr"]
    losses = _train(pm, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    return {
        "losses": losses,
        "lr": lr,
        "state": pm.full_state_dict(),
        "mesh": pm.plan.mesh_shape,
        "params": {k: [str(p) for p in v] for k, v in pm.plan.params.items()},
    }


def _run(rank: int, world: int, path: str, plans: dict[str, str]) -> dict:
    out: dict = {}
    # The uninterrupted reference.
    eager = _model()
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=LR)
    out["eager_losses"] = _train(eager, eager_opt, range(STEPS_BEFORE + STEPS_AFTER))
    out["eager_state"] = eager.state_dict()

    # Save on mesh (2, 2) under torchtitan's layout (Megatron on axis 1, FSDP on axis 0).
    model = _model()
    pm = autopar.compile(model, (2, 2), example_inputs=_batch(0), plan=autopar.Plan.from_json(plans["2x2"]))
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    out["saved_losses"] = _train(pm, optimizer, range(STEPS_BEFORE))
    state = pm.state_dict()
    out["dtensor"] = {
        "keys": list(state) == list(eager.state_dict()),  # the model's names (model itself is behind pm now)
        "aliases": all(state[k].to_local().data_ptr() == pm._local(k).data_ptr() for k in state),
        "tied": state["lm_head.weight"] is state["transformer.wte.weight"],
        "placements": {k: [str(p) for p in v.placements] for k, v in state.items()},
        "mesh": tuple(state["lm_head.weight"].device_mesh.shape),
        "full_equal": all(torch.equal(v.full_tensor(), pm.full_state_dict()[k]) for k, v in state.items()),
    }
    full = pm.full_state_dict()
    original = _model(seed=9)
    result = original.load_state_dict(full, strict=True)
    out["full"] = {
        "keys": list(full) == list(eager.state_dict()),
        "tie_shared": full["lm_head.weight"].data_ptr() == full["transformer.wte.weight"].data_ptr(),
        "incompatible": (list(result.missing_keys), list(result.unexpected_keys)),
        "loaded_rel": max_rel_diff(original.state_dict(), full),
        "still_tied": original.lm_head.weight is original.transformer.wte.weight,
    }
    autopar.checkpoint.save(path, pm, optimizer)
    out["state_at_save"] = full

    # Load on mesh (4,) under FSDP, into a model built from another seed.
    other = autopar.compile(_model(seed=5), (4,), example_inputs=_batch(0), plan=autopar.Plan.from_json(plans["4"]))
    other.load_state_dict(full)  # whole tensors: each rank keeps its shard
    out["load_whole"] = max_rel_diff(other.full_state_dict(), full)
    try:
        other.load_state_dict({k: v for k, v in full.items() if k != "lm_head.weight"})
        out["load_missing"] = "no error"
    except RuntimeError as error:
        out["load_missing"] = str(error)
    out["fsdp"] = _resume(other, path)
    out["torch_save"] = _torch_save(pm, other, f"{path}_pt", rank)

    # Load on mesh (1, 4) under Megatron, into a meta-built model: shards straight from the checkpoint.
    with torch.device("meta"):
        meta = _model()
    megatron = autopar.compile(
        meta, (1, 4), example_inputs=_batch(0), plan=autopar.Plan.from_json(plans["1x4"]), init=autopar.FromCheckpoint(path)
    )
    out["megatron_compiled_state"] = max_rel_diff(megatron.full_state_dict(), full)
    out["megatron"] = _resume(megatron, path)

    # A meta-built GPT with seeded init against the same init applied to the CPU-built model.
    init = autopar.SeededInit(seed=4, fn=GPT._init_weights)
    with torch.device("meta"):
        meta = _model()
    seeded = autopar.compile(meta, (2, 2), example_inputs=_batch(0), plan=autopar.Plan.from_json(plans["2x2"]), init=init)
    reference = init.apply(_model())
    out["seeded"] = {
        "state_equal": {k: torch.equal(v, reference.state_dict()[k]) for k, v in seeded.full_state_dict().items()},
        "loss": (seeded(*_batch(0)).item(), reference(*_batch(0)).item()),
        "local_param_bytes": seeded.local_param_bytes(),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
    }
    # Buffers (BatchNorm's running statistics and its int64 step count) go through DCP too.
    cnn_batch = example_batch("cnn", batch_size=8)
    cnn = autopar.compile(build_model("cnn"), (4,), example_inputs=cnn_batch, plan=autopar.Plan.from_json(plans["cnn_4"]))
    cnn(*cnn_batch).backward()  # moves the running statistics
    autopar.checkpoint.save(f"{path}_cnn", cnn)
    cnn_other = autopar.compile(
        build_model("cnn", seed=3), (2, 2), example_inputs=cnn_batch, plan=autopar.Plan.from_json(plans["cnn_2x2"])
    )
    autopar.checkpoint.load(f"{path}_cnn", cnn_other)
    out["cnn"] = {
        "rel": max_rel_diff(cnn_other.full_state_dict(), cnn.full_state_dict()),
        "buffers": {
            k: [str(p) for p in v.placements] for k, v in cnn.state_dict().items() if "running" in k or "num_batches" in k
        },
    }
    try:
        autopar.compile(meta, (2, 2), example_inputs=_batch(0), plan=autopar.Plan.from_json(plans["2x2"]))
        out["meta_without_init"] = "no error"
    except ValueError as error:
        out["meta_without_init"] = str(error)
    return out


def _torch_save(pm: autopar.ParallelModule, other: autopar.ParallelModule, path: str, rank: int) -> dict:
    """Plain torch.save: each rank's own ``pm.state_dict()`` loads back; rank 0's sharded one
    loaded on every rank is refused on every rank (it holds rank 0's slices); rank 0's
    ``full_state_dict()`` loads anywhere."""
    out = {}
    torch.save(pm.state_dict(), f"{path}{rank}")
    torch.save(pm.full_state_dict(), f"{path}_full")  # every rank writes the same: a race-free stand-in for rank 0
    dist.barrier()
    want = pm.full_state_dict()
    pm.load_state_dict(torch.load(f"{path}{rank}", weights_only=False))
    out["own"] = max(max_rel_diff(pm.full_state_dict(), want).values())
    try:
        pm.load_state_dict(torch.load(f"{path}0", weights_only=False))
        out["rank0"] = "no error"
    except ValueError as error:  # autopar.CheckpointError on the ranks that hear of another's refusal
        out["rank0"] = str(error)
    other.load_state_dict(torch.load(f"{path}_full", weights_only=False))
    out["full"] = max(max_rel_diff(other.full_state_dict(), want).values())
    return out


def _plans() -> dict[str, str]:
    batch = _batch(0)
    cnn_batch = example_batch("cnn", batch_size=8)
    return {
        "2x2": autopar.hand_plan("tp_fsdp", _model(), (2, 2), example_inputs=batch, cluster="cpu").to_json(),
        "4": autopar.hand_plan("fsdp", _model(), (4,), example_inputs=batch, cluster="cpu").to_json(),
        "1x4": autopar.hand_plan("megatron", _model(), (1, 4), example_inputs=batch, cluster="cpu").to_json(),
        "cnn_4": autopar.hand_plan("fsdp", build_model("cnn"), (4,), example_inputs=cnn_batch, cluster="cpu").to_json(),
        "cnn_2x2": autopar.hand_plan("ddp", build_model("cnn"), (2, 2), example_inputs=cnn_batch, cluster="cpu").to_json(),
    }


def _sharded(params: dict[str, list[str]]) -> list[str]:
    return [fqn for fqn, spec in params.items() if any(p.startswith("S") for p in spec)]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist=True, on purpose
def test_checkpoint_round_trip_across_meshes(rank_pool, tmp_path) -> None:
    plans = _plans()
    results = rank_pool(4).run(_run, str(tmp_path / "ckpt"), plans, timeout_s=600)
    for rank, out in enumerate(results):
        where = f"rank {rank}"
        eager = out["eager_losses"]
        for step, got in enumerate(out["saved_losses"]):
            assert math.isclose(got, eager[step], rel_tol=TOL), f"{where}: step {step} loss {got} vs eager {eager[step]}"

        dt = out["dtensor"]
        assert dt["keys"] and dt["tied"] and dt["full_equal"], f"{where}: pm.state_dict() {dt}"
        assert dt["aliases"], f"{where}: pm.state_dict() must wrap the local shards without copying"
        assert dt["mesh"] == (2, 2)
        assert _sharded(dt["placements"]), f"{where}: the (2, 2) plan must shard: {dt['placements']}"

        full = out["full"]
        assert full["keys"] and full["tie_shared"] and full["still_tied"], f"{where}: full_state_dict {full}"
        assert full["incompatible"] == ([], []), f"{where}: {full['incompatible']}"
        assert max(full["loaded_rel"].values()) == 0.0

        assert max(out["megatron_compiled_state"].values()) == 0.0, f"{where}: FromCheckpoint shards differ"
        assert max(out["load_whole"].values()) == 0.0, f"{where}: pm.load_state_dict(whole tensors): {out['load_whole']}"
        assert "missing ['lm_head.weight']" in out["load_missing"], out["load_missing"]
        saved = out["torch_save"]
        assert saved["own"] == 0.0 and saved["full"] == 0.0, f"{where}: torch.save round trips {saved}"
        assert "saved by another rank" in saved["rank0"] and "full_state_dict" in saved["rank0"], saved["rank0"]
        for label in ("fsdp", "megatron"):
            resumed = out[label]
            assert resumed["lr"] == 1e-2, f"{where} {label}: lr {resumed['lr']} not restored from the checkpoint"
            assert _sharded(resumed["params"]), f"{where} {label}: the plan shards nothing"
            for step, got in enumerate(resumed["losses"], start=STEPS_BEFORE):
                assert math.isclose(got, eager[step], rel_tol=TOL), (
                    f"{where} {label} on mesh {resumed['mesh']}: step {step} loss {got} vs uninterrupted {eager[step]}"
                )
            rel = max_rel_diff(resumed["state"], out["eager_state"])
            worst = max(rel, key=rel.get)
            if rank == 0:  # shown with pytest -s
                loss_rel = max(abs(g - eager[s]) / abs(eager[s]) for s, g in enumerate(resumed["losses"], start=STEPS_BEFORE))
                print(
                    f"{label} on {resumed['mesh']}: worst loss rel diff {loss_rel:.1e}, worst parameter {worst} {rel[worst]:.1e}"
                )
            assert rel[worst] < TOL, f"{where} {label}: after resuming, {worst} off by {rel[worst]:.2e}"

        seeded = out["seeded"]
        differ = [k for k, same in seeded["state_equal"].items() if not same]
        assert not differ, f"{where}: meta-built shards differ from SeededInit on CPU: {differ}"
        got, want = seeded["loss"]
        assert math.isclose(got, want, rel_tol=TOL), f"{where}: meta-built loss {got} vs CPU {want}"
        assert seeded["local_param_bytes"] < seeded["full_param_bytes"]
        assert "init=autopar.SeededInit(seed)" in out["meta_without_init"], out["meta_without_init"]
        assert max(out["cnn"]["rel"].values()) == 0.0, f"{where}: CNN state after the round trip: {out['cnn']['rel']}"
        assert len(out["cnn"]["buffers"]) == 6 and _sharded(out["cnn"]["buffers"]), out["cnn"]["buffers"]

    # The model half of the checkpoint is a plain DCP checkpoint: it loads into an unsharded model.
    model = _model(seed=9)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    model.load_state_dict(state["model"])
    assert max(max_rel_diff(model.state_dict(), results[0]["state_at_save"]).values()) == 0.0
    assert model.lm_head.weight is model.transformer.wte.weight
