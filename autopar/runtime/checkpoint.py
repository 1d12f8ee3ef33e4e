"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A ParallelModule's parameters are DTensors (``autopar.ops.params``); its buffers and a pipeline
stage's tensors are plain shards. For DCP all are shown as DTensors: each
local shard is wrapped, without a copy, in a DTensor with the plan's placements over a
``DeviceMesh`` built from autopar's own mesh-axis process groups (so they keep the default
group's timeout). DCP then writes every shard once, with its global offsets, and can read a
checkpoint back into any other mesh shape or plan: each rank reads exactly the slices its own
shards cover.

    autopar.checkpoint.save(path, pm, optimizer)     # every rank; a directory
    autopar.checkpoint.load(path, pm, optimizer)     # every rank; any mesh, any plan

The checkpoint layout is DCP's, with these keys:

- ``model.<fqn>``: every entry of the original model's ``state_dict()`` (tied names both present);
- ``optim.state.<fqn>.<name>``: optimizer state of the parameter ``<fqn>``. A state tensor shaped
  like the parameter's shard (AdamW's ``exp_avg``, ``exp_avg_sq``) is sharded like the
  parameter; any other tensor (AdamW's scalar ``step``) is the same on every rank and saved once;
- ``optim.param_groups``: the optimizer's param groups, with parameter FQNs instead of objects.

So the model part is a plain DCP model checkpoint: ``dcp.load({"model": model.state_dict()},
checkpoint_id=path, no_dist=True)`` fills an unsharded model in one process, and
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one file.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autopar.errors import CheckpointError
from autopar.ir.spec import Spec, piece_shape, shard_tensor
from autopar.ops.collectives import call_on_world
from autopar.runtime import checkpoint_files as files
from autopar.runtime.checksums import ChecksumWriter, checksum_problems
from autopar.runtime.offload import param_key

if TYPE_CHECKING:
    from autopar.runtime.module import ParallelModule

__all__ = [
    "device_mesh",
    "to_dtensor",
    "model_state_dict",
    "load_model_state_dict",
    "optimizer_state_dict",
    "load_optimizer_state_dict",
    "save",
    "load",
]

_MODEL = "model"
_OPTIM = "optim"


def device_mesh(mesh_shape: tuple[int, ...], groups: tuple[str, ...], ranks: list[int] | None = None) -> DeviceMesh:
    """A DeviceMesh over autopar's mesh-axis groups: the global ``ranks`` in row-major order
    (by default rank r at the row-major position of r; a pipeline stage's mesh holds its own).

    Built with ``DeviceMesh.from_group``, so no new process group is made: the mesh uses the
    groups autopar's collectives use, with the default group's timeout.
    """
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    ranks = torch.tensor(ranks) if ranks is not None else torch.arange(math.prod(mesh_shape))
    ranks = ranks.reshape(mesh_shape)
    process_groups = [_resolve_process_group(name) for name in groups]
    names = tuple(f"axis{axis}" for axis in range(len(mesh_shape)))
    if len(process_groups) == 1:
        return DeviceMesh.from_group(process_groups[0], device_type, mesh_dim_names=names)
    return DeviceMesh.from_group(process_groups, device_type, mesh=ranks, mesh_dim_names=names)


def to_dtensor(local: torch.Tensor, spec: Spec, full_shape: tuple[int, ...], mesh: DeviceMesh) -> DTensor:
    """``local`` (this rank's shard under ``spec``) as a DTensor that shares its storage, on the
    device it lies on. ``DTensor.from_local`` would move a tensor on another device than the
    mesh's: a host copy of an offloaded shard is wrapped as it is instead, as FSDP2 wraps its
    CPU-offloaded parameters (DCP saves and loads such shards where they lie)."""
    shape, stride = torch.Size(full_shape), torch.empty(full_shape, device="meta").stride()
    if local.device.type not in (mesh.device_type, "meta"):
        meta = TensorMeta(shape, stride, local.dtype)
        return DTensor(local.detach(), DTensorSpec(mesh, tuple(spec), tensor_meta=meta), requires_grad=False)
    return DTensor.from_local(local.detach(), mesh, spec, run_check=False, shape=shape, stride=stride)


def model_state_dict(pm: ParallelModule) -> dict[str, DTensor]:
    """The original model's ``state_dict()`` names, each a DTensor view of this rank's shard:
    every name, or in a pipeline those of this rank's stages (``pm.local_state_keys()``: DCP
    puts the ranks' parts together into the whole model)."""
    mesh = pm.device_mesh
    out: dict[str, DTensor] = {}
    made: dict[int, DTensor] = {}
    offloader = pm.offloader
    if offloader is not None:
        offloader.store.take_back()
    copies: dict[str, torch.Tensor] = {}  # offloaded parameter → its copy, one for tied names
    for fqn in pm.local_state_keys():
        canonical = pm.ties.get(fqn, fqn)
        offloaded = offloader is not None and canonical in offloader.params
        local = copies.get(canonical) if offloaded else None
        if local is None:  # an offloaded shard's copy is read to the host: the device has no room for them all
            local = offloader.store.get_on_host(param_key(canonical)) if offloaded else pm.local_shard(fqn)
        if id(local) not in made:  # tied names share one DTensor, as they share one tensor
            made[id(local)] = to_dtensor(local, pm.plan.params[fqn], pm.full_shape(fqn), mesh)
            if offloaded:  # a copy read from the store: what dcp.load writes into it goes back
                copies[canonical] = local
                offloader.store.hand_out(param_key(canonical), made[id(local)])
        out[fqn] = made[id(local)]
    return out


@torch.no_grad()
def load_model_state_dict(pm: ParallelModule, state_dict: Mapping[str, Any], strict: bool = True) -> tuple[list[str], list[str]]:
    """Copy ``state_dict`` into this rank's shards; return (missing, unexpected) names.

    Values may be whole tensors (as ``model.state_dict()`` or ``pm.full_state_dict()`` give),
    which each rank cuts to its shard, or DTensors on this module's mesh (as
    ``pm.state_dict()`` gives, filled by ``dcp.load``), which are redistributed to its placements.
    Every rank calls it; a state dict that one rank refuses is refused on every rank, before any
    copy or redistribution.
    """
    if pm.offloader is not None:
        pm.offloader.store.take_back()  # copies handed out by state_dict(), before they are overwritten
    keys = pm.state_dict_keys()
    missing = [k for k in keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(keys)]
    held = set(pm.local_state_keys())  # in a pipeline, this rank's stages' names
    loaded = [fqn for fqn in keys if fqn in state_dict and fqn in held]
    agreed("load_state_dict", lambda: _check_state_dict(pm, state_dict, loaded, missing, unexpected, strict))
    for fqn in loaded:
        copy_into_shard(pm, fqn, state_dict[fqn])
    return missing, unexpected


def copy_into_shard(pm: ParallelModule, fqn: str, value: torch.Tensor) -> None:
    """Copy ``value`` (the whole tensor ``fqn``, or a DTensor on the mesh) into this rank's shard
    of it; no check, and no communication but a DTensor's redistribution."""
    target = pm.local_shard(fqn)
    spec = pm.plan.params[fqn]
    if isinstance(value, DTensor):
        local = value.redistribute(pm.device_mesh, spec).to_local()
    else:
        local = shard_tensor(value, spec, pm.coordinate, pm.shard_mesh_shape)
    if local.data_ptr() != target.data_ptr():
        target.copy_(local)
    _store_back(pm, fqn, target)


def _store_back(pm: ParallelModule, fqn: str, value: torch.Tensor) -> None:
    """An offloaded parameter's ``local_shard`` is a copy read from the offload store: what was
    loaded into it goes back there (and, through the store, into its compute-dtype copy)."""
    offloader = pm.offloader
    canonical = pm.ties.get(fqn, fqn)
    if offloader is not None and canonical in offloader.params:
        offloader.store.put(param_key(canonical), value.to_local() if isinstance(value, DTensor) else value)


def _check_state_dict(
    pm: ParallelModule,
    state_dict: Mapping[str, Any],
    loaded: list[str],
    missing: list[str],
    unexpected: list[str],
    strict: bool,
) -> None:
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"state dict does not match the model: missing {missing or 'none'}, unexpected "
            f"{unexpected or 'none'}; pass a state dict of this model, or strict=False to load the common names"
        )
    for fqn in loaded:
        value, full_shape = state_dict[fqn], pm.full_shape(fqn)
        if tuple(value.shape) != full_shape:
            raise CheckpointError(
                f"{fqn}: the state dict holds shape {tuple(value.shape)}, the model {full_shape}; "
                "load a checkpoint of the same model configuration"
            )
        if isinstance(value, DTensor):
            if value.device_mesh != pm.device_mesh:
                raise CheckpointError(
                    f"{fqn} is a DTensor on another device mesh ({value.device_mesh}); load through "
                    "autopar.checkpoint.load, or pass whole tensors (value.full_tensor())"
                )
            check_own_shard(fqn, value, pm.device_mesh)


_WHOLE_MODEL = "torch.save pm.full_state_dict() (whole tensors) and load that"


def check_own_shard(what: str, value: DTensor, mesh: Any, whole: str = _WHOLE_MODEL) -> None:
    """A DTensor unpickled from another rank's ``torch.save`` keeps that rank's mesh coordinate and
    its shard: loading it would put that rank's slice here. ``whole`` names the other fix."""
    saved, mine = value.device_mesh.get_coordinate(), mesh.get_coordinate()
    if saved != mine and not all(p.is_replicate() for p in value.placements):
        raise CheckpointError(
            f"{what} is a DTensor holding the shard of mesh coordinate {saved}, saved by another rank (this rank "
            f"sits at {mine}): loading it would put that rank's slice here. Save and load with "
            f"autopar.checkpoint.save / autopar.checkpoint.load (torch.distributed.checkpoint), or {whole}"
        )


def _param_fqns(pm: ParallelModule, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(parameter) → the canonical FQN of every parameter ``optimizer`` steps."""
    names: dict[int, str] = {}
    for fqn in pm.local_state_keys():
        held = pm.held_tensor(fqn)
        if isinstance(held, torch.nn.Parameter):
            names.setdefault(id(held), fqn)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise CheckpointError(
                    "the optimizer steps a tensor that is not a parameter of this ParallelModule; build it from pm.parameters()"
                )
    return names


def optimizer_state_dict(pm: ParallelModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state keyed by parameter FQN, shard-shaped state tensors as DTensors."""
    names = _param_fqns(pm, optimizer)
    with getattr(optimizer, "state_in_hand", contextlib.nullcontext)():  # autopar.optim.AdamW's offloaded moments
        return _optimizer_state_dict(pm, optimizer, names)


def _optimizer_state_dict(pm: ParallelModule, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    mesh = pm.device_mesh
    state: dict[str, dict[str, Any]] = {}
    for param, entries in optimizer.state.items():
        fqn = names[id(param)]
        spec = pm.plan.params[fqn]
        shard = _shard_shape(pm, fqn, param)
        state[fqn] = {}
        for key, value in entries.items():
            if isinstance(value, DTensor):  # the state of a DTensor parameter: already global
                if value.device_mesh != mesh or tuple(value.shape) != pm.full_shape(fqn):
                    raise CheckpointError(
                        f"optimizer state {key!r} of {fqn} is a DTensor of shape {tuple(value.shape)} on "
                        f"{value.device_mesh}, not one shaped like the parameter on pm.device_mesh; autopar "
                        "checkpoints optimizers whose state is per element or scalar (SGD, Adam, AdamW, ...)"
                    )
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                if tuple(value.shape) != shard:
                    raise CheckpointError(
                        f"optimizer state {key!r} of {fqn} has shape {tuple(value.shape)}, neither a scalar "
                        f"nor the shard's shape {shard}, so its sharding is unknown; "
                        "autopar checkpoints optimizers whose state is per element or scalar (SGD, Adam, AdamW, ...)"
                    )
                value = to_dtensor(value, spec, pm.full_shape(fqn), mesh)
            state[fqn][key] = value
    groups = []
    whole = pm.whole_param_names([[names[id(p)] for p in group["params"]] for group in optimizer.param_groups])
    for group, params in zip(optimizer.param_groups, whole, strict=True):
        saved = {k: v for k, v in group.items() if k != "params"}
        saved["params"] = params  # the whole model's: a pipeline stage's optimizer steps a part
        groups.append(saved)
    return {"state": state, "param_groups": groups}


def _shard_shape(pm: ParallelModule, fqn: str, param: torch.Tensor) -> tuple[int, ...]:
    """This rank's shard shape of parameter ``fqn``: ``param``'s, or, where the plan offloads the
    parameter (``param`` is an empty stub), the stored value's."""
    offloader = pm.offloader
    canonical = pm.ties.get(fqn, fqn)
    if offloader is not None and canonical in offloader.params:
        return tuple(offloader.store.meta[param_key(canonical)][0])
    return tuple(param.shape)


def save(path: str | os.PathLike, pm: ParallelModule, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write a sharded checkpoint of ``pm`` (and ``optimizer``) to the directory ``path``.

    Every rank calls it; each writes its own shards (replicated tensors once, by one rank). The
    shards go to ``<path>.saving``, which replaces ``path`` only once every rank has written its
    part (``autopar.runtime.checkpoint_files``): a save killed at any point leaves the checkpoint
    it was replacing loadable and unchanged. Returns on every rank once the new one is committed.
    """
    state: dict[str, Any] = {_MODEL: pm.state_dict()}
    if optimizer is not None:
        state[_OPTIM] = optimizer_state_dict(pm, optimizer)
    _on_rank0("prepare the checkpoint directory", lambda: files.recover(path))
    staging = files.staging_dir(path)
    # Each record's checksum is summed as it is written (runtime.checksums), verified by load.
    _run_dcp("save", path, lambda: dcp.save(state, storage_writer=ChecksumWriter(staging)))
    _on_rank0("commit the checkpoint", lambda: files.commit(path, dist.get_world_size()))


def load(
    path: str | os.PathLike,
    pm: ParallelModule,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    verify: bool = True,
) -> None:
    """Read a checkpoint written by ``save`` into ``pm``'s shards (and ``optimizer``'s state).

    The checkpoint may come from any mesh shape and any plan of the same model: each rank reads
    the slices its shards cover. ``optimizer`` must step ``pm.parameters()`` with the same
    param groups as the one saved; its state is replaced and its hyperparameters (lr, ...) are
    set to the saved ones, as ``Optimizer.load_state_dict`` does.

    Before any tensor is written, every rank checks that the checkpoint is complete (its commit
    marker, and every file its ``.metadata`` points into) and that it fits: the model's names and
    shapes, and the optimizer's param groups. Any difference is a ``CheckpointError`` that lists
    it, on every rank. ``strict=False`` loads the names the model and the checkpoint share (shapes
    must still agree); ``verify=False`` reads a DCP checkpoint without autopar's commit marker.
    """
    mine = None
    if optimizer is not None:  # the whole model's groups (a pipeline gathers them): before any check
        names = agreed("check the optimizer", lambda: _param_fqns(pm, optimizer))
        mine = pm.whole_param_names([[names[id(p)] for p in group["params"]] for group in optimizer.param_groups])

    def check() -> tuple[Any, Any, list[str]]:
        directory, metadata = files.verify(path, marked=verify)
        if verify:  # every record's bytes, before anything is read into the module (runtime.checksums)
            _check_sums(directory, metadata)
        keys = _check_model_keys(pm, metadata.state_dict_metadata, directory, strict)
        if optimizer is not None:
            _check_param_groups(mine, metadata.state_dict_metadata, directory)
        return directory, metadata, keys

    directory, metadata, keys = agreed("check the checkpoint", check)
    reader = dcp.FileSystemReader(directory)
    model_state = pm.state_dict()  # in a pipeline, this rank's stages' part
    state: dict[str, Any] = {_MODEL: {k: model_state[k] for k in keys if k in model_state}}
    if optimizer is not None:
        state[_OPTIM] = _optimizer_target(pm, optimizer, metadata.state_dict_metadata, directory)
    _run_dcp("load", directory, lambda: dcp.load(state, storage_reader=reader))
    for fqn, value in state[_MODEL].items():
        _store_back(pm, fqn, value)
    if optimizer is not None:
        load_optimizer_state_dict(pm, optimizer, state[_OPTIM])


def _check_sums(directory, metadata) -> None:
    """A CheckpointError naming each file and tensor of this rank's share of the files whose
    bytes differ from those saved (``agreed`` tells every rank)."""
    problems = checksum_problems(directory, metadata, dist.get_rank(), dist.get_world_size())
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise files.CheckpointError(
            f"the checkpoint at {directory} is damaged: {shown} (checksum). No tensor was loaded; restore "
            "these files or load another checkpoint"
        )


def _check_model_keys(pm: ParallelModule, metadata: Mapping[str, Any], directory, strict: bool) -> list[str]:
    """The model names to load: a CheckpointError listing missing and unexpected names (unless
    not ``strict``) and every shape that differs."""
    prefix = f"{_MODEL}."
    saved = {key[len(prefix) :]: meta for key, meta in metadata.items() if key.startswith(prefix)}
    keys = pm.state_dict_keys()
    missing = [k for k in keys if k not in saved]
    unexpected = [k for k in saved if k not in set(keys)]
    shapes = [
        f"{k}: checkpoint {tuple(saved[k].size)}, model {pm.full_shape(k)}"
        for k in keys
        if k in saved and isinstance(saved[k], TensorStorageMetadata) and tuple(saved[k].size) != pm.full_shape(k)
    ]
    problems = []
    if strict and (missing or unexpected):
        problems.append(
            f"missing from the checkpoint: {_listed(missing)}; in the checkpoint but not in the model: {_listed(unexpected)}"
        )
    if shapes:
        problems.append(f"shapes differ: {_listed(shapes)}")
    if problems:
        fix = "load a checkpoint of this model's configuration"
        if not shapes:
            fix += ", or pass strict=False to load only the names both hold"
        raise files.CheckpointError(
            f"the checkpoint at {directory} does not fit this model: {'; '.join(problems)}. Nothing was loaded; {fix}"
        )
    return [k for k in keys if k in saved]


def _listed(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_param_groups(mine: list[list[str]], metadata: Mapping[str, Any], directory) -> None:
    """The checkpoint's optimizer param groups hold the same parameters as the optimizer's
    (``mine``: each group's FQNs over the whole model), in order."""
    prefix = f"{_OPTIM}.param_groups."
    saved_keys = [key for key in metadata if key.startswith(prefix) and key.endswith(".params")]
    if not saved_keys:
        raise files.CheckpointError(
            f"the checkpoint at {directory} has no optimizer state: it was saved without an "
            "optimizer; load without one (and build a fresh optimizer)"
        )
    saved = _read_objects(directory, saved_keys)
    groups = [saved[f"{prefix}{index}.params"] for index in range(len(saved_keys)) if f"{prefix}{index}.params" in saved]
    if [list(g) for g in groups] != mine:
        detail = []
        if len(groups) != len(mine):
            detail.append(f"{len(groups)} param groups saved, {len(mine)} in this optimizer")
        for index, (theirs, ours) in enumerate(zip(groups, mine)):
            if list(theirs) != ours:
                gone = [n for n in theirs if n not in ours]
                new = [n for n in ours if n not in theirs]
                what = f"saved only: {_listed(gone)}; this optimizer only: {_listed(new)}" if gone or new else "another order"
                detail.append(f"group {index}: {what}")
        raise files.CheckpointError(
            f"the checkpoint at {directory} holds another optimizer's param groups ({'; '.join(detail)}). Nothing was "
            "loaded; build the optimizer over the same parameters, in the same groups, as when saving"
        )


def _read_objects(directory, keys: list[str]) -> dict[str, Any]:
    """The pickled (non-tensor) entries ``keys`` of a checkpoint, read in this process alone."""
    state: dict[str, Any] = {key: None for key in keys}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, on purpose
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    return state


def _on_rank0(what: str, fn) -> None:
    """Run ``fn`` on rank 0 and its outcome everywhere: an error there is raised on every rank."""
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as error:  # noqa: BLE001 - every rank must hear of it
            outcome[0] = error
    call_on_world(f"checkpoint: {what}", dist.broadcast_object_list, outcome, src=0)
    if outcome[0] is not None:
        if dist.get_rank() == 0:
            raise outcome[0]
        raise files.CheckpointError(f"could not {what} (on rank 0): {type(outcome[0]).__name__}: {outcome[0]}")


def agreed(what: str, fn):
    """``fn()`` on every rank, raising on every rank if it raised on any (so that no rank waits
    in a collective that another one never enters)."""
    try:
        result, error = fn(), None
    except Exception as caught:  # noqa: BLE001 - the other ranks must hear of any failure
        result, error = None, caught
    errors: list[Any] = [None] * dist.get_world_size()
    call_on_world(f"checkpoint: {what}", dist.all_gather_object, errors, None if error is None else str(error))
    if error is not None:
        raise error
    failed = [rank for rank, text in enumerate(errors) if text is not None]
    if failed:
        raise files.CheckpointError(f"rank {failed[0]} refused the checkpoint: {errors[failed[0]]}")
    return result


def _run_dcp(what: str, path, fn) -> None:
    """A DCP save or load, its failure told in a few lines: DCP's own exception prints every
    rank's traceback (a hundred lines or more), and a dead peer's error names no rank."""
    try:
        call_on_world(f"checkpoint {what}", fn)
    except CheckpointException as error:
        lines = [
            f"rank {rank}: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            for rank, (exc, _trace) in sorted(error.failures.items())
        ]
        kept = "the checkpoint it was replacing is unchanged" if what == "save" else "the module may be partly loaded"
        raise files.CheckpointError(
            f"checkpoint {what} at {path} failed: " + "; ".join(lines) + f". {kept}; fix the cause and {what} again"
        ) from None


def _optimizer_target(pm: ParallelModule, optimizer: torch.optim.Optimizer, metadata: Mapping[str, Any], path) -> dict[str, Any]:
    """Empty buffers, shaped as this rank's shards, for every optimizer entry in the checkpoint."""
    names = _param_fqns(pm, optimizer)
    mesh = pm.device_mesh
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = names[id(param)]
            prefix = f"{_OPTIM}.state.{fqn}."
            entries = {}
            # state the plan offloads is read to the host, where the optimizer's step moves it to its store
            offloaded = pm.offloader is not None and pm.ties.get(fqn, fqn) in pm.offloader.states
            device = torch.device("cpu") if offloaded else param.device
            for key, meta in metadata.items():
                name = key[len(prefix) :]
                if not key.startswith(prefix) or "." in name:
                    continue
                if not isinstance(meta, TensorStorageMetadata):
                    entries[name] = None  # a pickled value; DCP puts it in place
                elif tuple(meta.size) == pm.full_shape(fqn) and len(meta.size) > 0:
                    spec = pm.plan.params[fqn]
                    local = torch.empty(
                        piece_shape(meta.size, spec, pm.coordinate, pm.shard_mesh_shape),
                        dtype=meta.properties.dtype,
                        device=device,
                    )
                    entries[name] = to_dtensor(local, spec, pm.full_shape(fqn), mesh)
                else:
                    entries[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype, device=device)
            if entries:
                state[fqn] = entries
    groups = []
    for group in optimizer.param_groups:
        target = {k: v for k, v in group.items() if k != "params"}
        target["params"] = [names[id(p)] for p in group["params"]]
        groups.append(target)
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_optimizer_state_dict(pm: ParallelModule, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Install ``state_dict`` (as ``optimizer_state_dict`` gives, filled by ``dcp.load``) in ``optimizer``."""
    names = _param_fqns(pm, optimizer)
    groups = state_dict["param_groups"]
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        mine = [names[id(p)] for p in group["params"]]
        if pm.local_params_of(list(saved["params"])) != mine:
            raise CheckpointError(
                f"the saved param group holds {list(saved['params'])}, this optimizer's {mine}: "
                "build the optimizer with the same groups as when saving"
            )
        group.update({k: v for k, v in saved.items() if k != "params"})
    by_name = {names[id(p)]: p for group in optimizer.param_groups for p in group["params"]}
    optimizer.state.clear()
    for fqn, entries in state_dict["state"].items():
        param = by_name[fqn]
        spec = pm.plan.params[fqn]
        local: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, DTensor):  # a DTensor parameter keeps DTensor state, as torch.optim makes it
                value = value.redistribute(pm.device_mesh, spec)
                if not isinstance(param, DTensor):
                    value = value.to_local()
            local[key] = value
        optimizer.state[param] = local
