"""Faults and bad input as a careful user and an unlucky cluster meet them: each ends in a clear
error that names its fix, or in a correct result, and nothing saved is lost.

Single-process checks (a one-rank gloo group) cover checkpoint and plan validation; the checks
that need several ranks (a rank killed mid-step and mid-save, ranks with different weights) run
at the end, each on as few spawned ranks as it needs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar
from autopar.errors import CheckpointError
from autopar.runtime import checkpoint_files as files
from autopar.zoo.models import build_model, example_batch

GPT_BATCH = 4


@pytest.fixture(scope="module")
def one_rank_gloo():
    """A real gloo process group of one rank in this process, torn down afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            yield
        finally:
            dist.destroy_process_group()


def _gpt(n_layer: int = 2, seed: int = 0):
    model = build_model("gpt", seed=seed, n_layer=n_layer)
    batch = example_batch("gpt", GPT_BATCH)
    return autopar.compile(model, (1,), example_inputs=batch), batch


def _stepped(pm, batch, lr: float = 1e-2):
    optimizer = torch.optim.AdamW(pm.parameters(), lr=lr)
    pm(*batch).backward()
    optimizer.step()
    return optimizer


def _state(pm) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pm.full_state_dict().items()}


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def saved(one_rank_gloo, tmp_path_factory):
    """A 2-layer GPT after one AdamW step, saved with its optimizer; (path, state, pm, batch)."""
    pm, batch = _gpt()
    optimizer = _stepped(pm, batch)
    path = tmp_path_factory.mktemp("ckpt") / "gpt"
    autopar.checkpoint.save(path, pm, optimizer)
    return path, _state(pm), pm, batch


def _copy(path: Path, folder: Path) -> Path:
    target = folder / path.name
    shutil.copytree(path, target)
    return target


def test_a_save_commits_a_marked_directory_and_leaves_nothing_beside_it(saved):
    path, _, _, _ = saved
    assert (path / files.MARKER).is_file() and (path / ".metadata").is_file()
    assert not files.staging_dir(path).exists() and not files.replaced_dir(path).exists()


def test_a_checkpoint_missing_a_shard_is_refused_before_any_tensor_is_written(saved, tmp_path):
    path, state, pm, _ = saved
    broken = _copy(path, tmp_path)
    shard = next(broken.glob("*.distcp"))
    shard.unlink()
    before = _state(pm)
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing.*No tensor was loaded"):
        autopar.checkpoint.load(broken, pm)
    assert _same(_state(pm), before)


def test_a_truncated_shard_and_a_damaged_metadata_are_refused(saved, tmp_path):
    path, _, pm, _ = saved
    broken = _copy(path, tmp_path)
    shard = next(broken.glob("*.distcp"))
    whole = shard.read_bytes()
    shard.write_bytes(whole[:100])
    with pytest.raises(CheckpointError, match=f"{shard.name} holds 100 bytes"):
        autopar.checkpoint.load(broken, pm)
    shard.write_bytes(whole * 2)  # longer than .metadata reads, but not what was saved
    with pytest.raises(CheckpointError, match=f"{shard.name} holds .* bytes where .* were saved"):
        autopar.checkpoint.load(broken, pm)
    (broken / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read.*damaged"):
        autopar.checkpoint.load(broken, pm)


def _record(directory: Path, fqn: str):
    metadata = dcp.FileSystemReader(directory).read_metadata()
    return next(info for index, info in metadata.storage_data.items() if index.fqn == fqn)


def test_a_flipped_byte_in_a_saved_weight_is_refused_naming_file_and_tensor(saved, tmp_path):
    path, _, pm, _ = saved
    assert sorted(p.name for p in path.glob("*checksums.json")) == ["__0_checksums.json"]
    broken = _copy(path, tmp_path)
    fqn = "model.transformer.h.0.mlp.c_fc.weight"
    info = _record(broken, fqn)
    shard = broken / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    before = _state(pm)
    with pytest.raises(CheckpointError, match=rf"{info.relative_path}: {fqn} \(bytes .*differs.*No tensor was loaded"):
        autopar.checkpoint.load(broken, pm)
    assert _same(_state(pm), before)


def test_a_flipped_byte_in_the_metadata_or_a_checksum_file_is_refused(saved, tmp_path):
    path, _, pm, _ = saved
    before = _state(pm)
    for name, match in (
        (".metadata", r"\.metadata (differs from what was saved|cannot be read)"),
        ("__0_checksums.json", "checksum"),
    ):
        broken = _copy(path, tmp_path / name.strip("._"))
        target = broken / name
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match=match):
            autopar.checkpoint.load(broken, pm)
    assert _same(_state(pm), before)


def test_every_record_has_a_checksum_and_one_without_side_files_still_loads(saved, tmp_path):
    path, state, _, _ = saved
    metadata = dcp.FileSystemReader(path).read_metadata()
    sums = json.loads((path / "__0_checksums.json").read_text())["records"]
    summed = {(name, offset, length) for name, entries in sums.items() for offset, length, _ in entries}
    assert {(i.relative_path, i.offset, i.length) for i in metadata.storage_data.values()} <= summed
    old = _copy(path, tmp_path)  # as saved before checksums: no side file, a marker without it
    (old / "__0_checksums.json").unlink()
    marker = json.loads((old / files.MARKER).read_text())
    del marker["files"]["__0_checksums.json"]
    (old / files.MARKER).write_text(json.dumps(marker))
    pm, _ = _gpt(seed=3)
    autopar.checkpoint.load(old, pm)
    assert _same(_state(pm), state)


def test_a_checkpoint_without_its_commit_marker_is_refused_unless_verify_is_off(saved, tmp_path):
    path, state, _, _ = saved
    unmarked = _copy(path, tmp_path)
    (unmarked / files.MARKER).unlink()
    pm, _ = _gpt(seed=3)
    with pytest.raises(CheckpointError, match="no commit marker.*verify=False"):
        autopar.checkpoint.load(unmarked, pm)
    autopar.checkpoint.load(unmarked, pm, verify=False)
    assert _same(_state(pm), state)
    with pytest.raises(CheckpointError, match="does not exist"):
        autopar.checkpoint.load(tmp_path / "nowhere", pm)


def test_another_models_checkpoint_is_refused_listing_the_names_and_nothing_is_overwritten(saved, tmp_path):
    path, state, _, _ = saved
    three, batch = _gpt(n_layer=3, seed=1)
    optimizer = _stepped(three, batch)
    bigger = tmp_path / "gpt3"
    autopar.checkpoint.save(bigger, three, optimizer)

    two, batch = _gpt(seed=2)
    before = _state(two)
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model: transformer\.h\.2\..*strict=False"):
        autopar.checkpoint.load(bigger, two)
    own = _stepped(two, batch, lr=1e-3)
    before, own_state = _state(two), {p: dict(s) for p, s in own.state.items()}
    with pytest.raises(CheckpointError, match=r"in the checkpoint but not in the model: transformer\.h\.2\."):
        autopar.checkpoint.load(bigger, two, own)
    assert _same(_state(two), before), "a refused load wrote weights"
    assert own.param_groups[0]["lr"] == 1e-3 and all(
        torch.equal(own.state[p][k], own_state[p][k]) for p in own_state for k in own_state[p]
    )

    # strict=False loads the names both hold; an optimizer's groups must still match.
    with pytest.raises(CheckpointError, match="another optimizer's param groups.*saved only: transformer.h.2"):
        autopar.checkpoint.load(bigger, two, own, strict=False)
    assert _same(_state(two), before), "a refused load wrote weights"
    autopar.checkpoint.load(bigger, two, strict=False)
    three_state = _state(three)
    assert all(torch.equal(v, three_state[k]) for k, v in _state(two).items())


def test_shapes_that_differ_are_refused_even_with_strict_off(saved):
    path, _, _, _ = saved
    wide = autopar.compile(build_model("gpt", n_embd=32), (1,), example_inputs=example_batch("gpt", GPT_BATCH))
    with pytest.raises(
        CheckpointError, match=r"shapes differ: transformer\.wte\.weight: checkpoint \(256, 64\), model \(256, 32\)"
    ):
        autopar.checkpoint.load(path, wide, strict=False)


def test_an_optimizer_checkpoint_loads_exactly_and_a_model_only_one_refuses_an_optimizer(saved, tmp_path):
    path, state, pm, batch = saved
    other, _ = _gpt(seed=7)
    optimizer = torch.optim.AdamW(other.parameters(), lr=0.5)
    autopar.checkpoint.load(path, other, optimizer)
    assert _same(_state(other), state) and optimizer.param_groups[0]["lr"] == 1e-2
    model_only = tmp_path / "model_only"
    autopar.checkpoint.save(model_only, other)
    with pytest.raises(CheckpointError, match="saved without an optimizer"):
        autopar.checkpoint.load(model_only, other, optimizer)


def test_a_save_killed_at_each_point_leaves_a_complete_checkpoint(saved, tmp_path, monkeypatch):
    """A save's steps, each interrupted (as a kill there would leave the directories): the
    checkpoint it replaces stays loadable, and the next save and load find a whole one."""
    path, state, _, _ = saved
    pm, _ = _gpt(seed=5)
    loaded, _ = _gpt(seed=9)
    new_state = _state(pm)
    real_move = files._move

    for renames_before in (0, 1):  # before the swap; between its two renames
        renames = []

        def move_then_die(src, dst):
            if len(renames) == renames_before:
                raise KeyboardInterrupt("killed")
            renames.append(src)
            real_move(src, dst)

        old = _copy(path, tmp_path / f"round{renames_before}")
        monkeypatch.setattr(files, "_move", move_then_die)
        with pytest.raises(KeyboardInterrupt):
            autopar.checkpoint.save(old, pm)
        monkeypatch.setattr(files, "_move", real_move)
        autopar.checkpoint.load(old, loaded)
        want = state if renames_before == 0 else new_state  # between the renames, the new one is complete
        assert _same(_state(loaded), want), f"after a kill with {renames_before} renames done"
        autopar.checkpoint.save(old, pm)  # the next save puts the directories right
        assert sorted(p.name for p in old.parent.iterdir()) == [old.name]
        autopar.checkpoint.load(old, loaded)
        assert _same(_state(loaded), new_state)

    # Killed while DCP writes (no marker in the staging directory): the old checkpoint is untouched.
    old = _copy(path, tmp_path / "writing")
    files.staging_dir(old).mkdir()
    (files.staging_dir(old) / "__0_0.distcp").write_bytes(b"half")
    autopar.checkpoint.load(old, loaded)
    assert _same(_state(loaded), state)
    autopar.checkpoint.save(old, pm)
    assert sorted(p.name for p in old.parent.iterdir()) == [old.name]


def test_compile_refuses_a_hand_edited_plan_naming_the_parameter(one_rank_gloo, tmp_path):
    import json

    model, batch = build_model("gpt", seed=0), example_batch("gpt", GPT_BATCH)
    data = json.loads(autopar.plan(model, (1,), example_inputs=batch, cluster="cpu").to_json())
    data["params"]["transformer.h.0.attn.q_proj.weight"] = ["S(5)"]
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(
        autopar.PlanError,
        match="parameter 'transformer.h.0.attn.q_proj.weight' has placements "
        r"\(S\(5\)\), which shards dim 5 of a 2-dim tensor",
    ):
        autopar.compile(model, (1,), example_inputs=batch, plan=str(path))
    path.write_text(json.dumps(data)[:1000])
    with pytest.raises(autopar.PlanError, match=f"plan file '{path}' is not valid JSON"):
        autopar.compile(model, (1,), example_inputs=batch, plan=str(path))


def test_inputs_on_the_meta_device_are_refused_at_the_call(saved):
    _, _, pm, batch = saved
    with pytest.raises(ValueError, match="input 'idx' is on the meta device.*pass real tensors"):
        pm(*(t.to("meta") for t in batch))


def test_the_rank_that_died_first_is_named_not_the_ones_that_failed_after_it(one_rank_gloo, monkeypatch):
    """A world of 4 seen from rank 0: rank 3 failed after rank 2 died and exited too (it left its
    diagnosis in the store); rank 2 left none. On another host, the record is what is left to read."""
    import socket
    import subprocess
    import sys

    from autopar.ops import collectives

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    store = dist.distributed_c10d._get_default_store()
    here = socket.gethostname()
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 4)
    peers = {0: f"{here}:{os.getpid()}", 1: f"{here}:{os.getpid()}", 2: f"{here}:{gone.pid}", 3: f"{here}:{gone.pid}"}
    try:
        for rank, value in peers.items():
            store.set(collectives._PEER_KEY.format(rank), value)
        store.set(collectives._FAILED_KEY.format(3), "rank 2 is no longer running")
        assert collectives._diagnose([0, 1]) == "rank 2 is no longer running"
        store.set(collectives._PEER_KEY.format(2), f"elsewhere:{gone.pid}")
        assert collectives._diagnose([0, 1]) == "rank 2 is no longer running (as rank 3 found)"
    finally:
        for rank in range(1, 4):
            for key in (collectives._PEER_KEY, collectives._FAILED_KEY):
                if store.check([key.format(rank)]):
                    store.delete_key(key.format(rank))


def test_weight_fingerprints_change_with_any_bit_and_any_swap(monkeypatch):
    from autopar.runtime import weights

    tensor = torch.randn(1000)
    swapped, flipped = tensor.clone(), tensor.clone()
    swapped[3], swapped[4] = tensor[4], tensor[3]
    flipped.view(torch.int32)[7] ^= 1
    for fingerprint in (weights.fingerprint, weights._word_sums):  # host memory; an accelerator's way, here on CPU
        same = fingerprint(tensor.clone())
        assert fingerprint(tensor) == same and fingerprint(tensor[::2].clone()) == fingerprint(tensor[::2])
        assert fingerprint(swapped) != same and fingerprint(flipped) != same
    whole = weights._word_sums(tensor)
    monkeypatch.setattr(weights, "_CHUNK", 64)  # chunks add up to the whole
    assert weights._word_sums(tensor) == whole


# -- several ranks -------------------------------------------------------------------------------


def _different_weights(rank: int, world: int) -> str:
    model = build_model("mlp", seed=0 if rank == 0 else 1)
    try:
        autopar.compile(model, (world,), example_inputs=example_batch("mlp", 8), weights="check")
    except ValueError as error:
        return str(error)
    return "compiled"


@pytest.mark.multiproc
def test_ranks_with_different_weights_are_refused_naming_the_rank(rank_pool):
    for rank, message in enumerate(rank_pool(2).run(_different_weights, timeout_s=300)):
        assert "rank 1 differs from rank 0 in 6 tensors (layers.0.weight" in message, f"rank {rank}: {message}"
        assert "torch.manual_seed" in message and "SeededInit" in message


def _gpt_on(world: int, plan: str):
    model = build_model("gpt", seed=0)
    batch = example_batch("gpt", GPT_BATCH)
    return autopar.compile(
        model,
        (world,) if plan == "fsdp" else (2, 2),
        example_inputs=batch,
        plan=autopar.hand_plan(plan, model, (world,) if plan == "fsdp" else (2, 2), example_inputs=batch, cluster="cpu"),
    ), batch


def _told(folder: str, rank: int, fn):
    """Run ``fn``; on a CollectiveError, leave its message in ``folder`` for the parent, and raise it."""
    try:
        return fn()
    except autopar.errors.CollectiveError as error:
        Path(folder, f"rank{rank}.txt").write_text(str(error))
        raise


def _dies_mid_step(rank: int, world: int, folder: str) -> str:
    import signal

    pm, batch = _gpt_on(world, "tp_fsdp")
    dist.barrier()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1)  # let the kill land before the survivors' next collective

    def step():
        for _ in range(3):  # survivors fail in groups without rank 2 too, once rank 0 or 3 is gone
            pm(*batch).backward()

    _told(folder, rank, step)
    return "finished steps without rank 2"


@pytest.mark.multiproc
def test_a_rank_killed_mid_step_is_named_by_every_survivor(tmp_path):
    """Mesh (2, 2): rank 1 shares no group with rank 2, and fails only once rank 0 or 3 has
    failed and exited; it must still name rank 2, not the rank it lost."""
    from autopar.runtime.tools.launch import DistributedRankError, run_distributed

    start = time.monotonic()
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_dies_mid_step, 4, str(tmp_path), timeout_s=240, pg_timeout_s=60, grace_s=60)
    assert "rank 2 exited" in str(info.value)
    assert time.monotonic() - start < 150, "the survivors waited for a timeout instead of failing"
    told = {path.name: path.read_text() for path in tmp_path.glob("rank*.txt")}
    assert sorted(told) == ["rank0.txt", "rank1.txt", "rank3.txt"], told
    for name, message in told.items():
        assert "rank 2 is no longer running" in message, f"{name}: {message}"


def _dies_mid_save(rank: int, world: int, folder: str) -> str:
    import signal

    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    pm, batch = _gpt_on(world, "fsdp")
    optimizer = _stepped(pm, batch)
    path = Path(folder, "ckpt")
    autopar.checkpoint.save(path, pm, optimizer)
    state = pm.full_state_dict()
    if rank == 0:
        torch.save(state, Path(folder, "saved.pt"))
    pm(*batch).backward()
    optimizer.step()
    if rank == 1:  # dies once its shards of the new checkpoint are written, before the metadata
        write = _FileSystemWriter.write_data

        def write_then_die(self, *args, **kwargs):
            write(self, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        _FileSystemWriter.write_data = write_then_die
    _told(folder, rank, lambda: autopar.checkpoint.save(path, pm, optimizer))
    return "saved without rank 1"


@pytest.mark.multiproc
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # no_dist=True, on purpose
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    from autopar.runtime.tools.launch import DistributedRankError, run_distributed

    with pytest.raises(DistributedRankError) as info:
        run_distributed(_dies_mid_save, 2, str(tmp_path), timeout_s=240, pg_timeout_s=60, grace_s=60)
    assert "rank 1 exited" in str(info.value)
    told = (tmp_path / "rank0.txt").read_text()
    assert "checkpoint save" in told and "rank 1 is no longer running" in told, told
    path = tmp_path / "ckpt"
    assert files.staging_dir(path).exists() and not files.is_committed(files.staging_dir(path))
    files.verify(path)
    model = build_model("gpt", seed=3)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    saved_state = torch.load(tmp_path / "saved.pt")
    assert _same({k: v for k, v in state["model"].items()}, saved_state)
