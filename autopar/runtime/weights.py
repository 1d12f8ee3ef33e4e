"""The same weights on every rank: rank 0's broadcast where ranks differ, as DDP does, or a refusal.

Every rank cuts its shards from its own copy of the model, so ranks that built it differently
(a DDP script's ``seed + rank``, another checkpoint) would train a mix of models without a word.
``compile`` first compares a checksum of every parameter and buffer across ranks (it reads each
tensor once on its own device and sends a few bytes per tensor), then, by default
(``weights="broadcast"``), does what DDP does at construction: it broadcasts rank 0's tensors,
only those that differ, into every rank's model in place (said in the log). ``weights="check"``
refuses ranks that differ instead, naming them: for users who want the model left as they built
it, and a rank that disagrees treated as the bug it usually is (a missed seed, another file).

Models built on the meta device (``SeededInit``, ``FromCheckpoint``) are materialized from a
seed or a checkpoint that is the same on every rank by construction: they skip both.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import ConfigError, ModelError
from autopar.ops.collectives import call_on_world

log = logging.getLogger("autopar")

_CHUNK = 1 << 24  # elements per chunk on an accelerator: bounds the int64 temporary at 128 MiB


def fingerprint(tensor: torch.Tensor) -> tuple[str, str]:
    """(how, value): an exact fingerprint of ``tensor``'s bytes, as fast as reading them once.

    In host memory, the SHA-1 of the bytes themselves (hardware-accelerated: as fast as a copy).
    On an accelerator, where reading bytes into Python would cost a copy to the host, two integer
    sums over the words on the device: the plain sum and the position-weighted one (modulo
    2**64), which change with any bit and with any two words swapped. Ranks compare values only
    where they fingerprinted a tensor the same way.
    """
    flat = tensor.detach().contiguous().view(-1)
    if flat.numel() == 0:
        return "empty", ""
    if flat.device.type == "cpu" and type(flat) is torch.Tensor:  # a subclass's data_ptr may not be its bytes
        raw = (ctypes.c_char * (flat.numel() * flat.element_size())).from_address(flat.data_ptr())
        return "sha1", hashlib.sha1(memoryview(raw), usedforsecurity=False).hexdigest()
    return "sums", _word_sums(flat)


def _word_sums(flat: torch.Tensor) -> str:
    """The plain and the position-weighted sum of ``flat``'s words, modulo 2**64, on its device."""
    words = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size(), torch.uint8))
    total = weighted = 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device, dtype=torch.int64)
        total += int(chunk.sum())
        weighted += int((chunk * positions).sum())
    return f"{total % 2**64:x}:{weighted % 2**64:x}"


WEIGHTS_MODES = ("broadcast", "check")


def check_same_weights(model: torch.nn.Module, init: Any = None, weights: str = "broadcast") -> None:
    """Make every rank hold rank 0's parameters and buffers (``weights="broadcast"``, DDP's way),
    or refuse (ValueError on every rank) when ranks hold different ones (``"check"``).

    ``init`` is ``compile``'s: a model materialized by ``SeededInit`` or ``FromCheckpoint`` is
    the same on every rank by construction, and costs nothing here."""
    if weights not in WEIGHTS_MODES:
        raise ConfigError(f"weights must be one of {WEIGHTS_MODES}, got {weights!r}")
    if init is not None or dist.get_world_size() == 1:
        return
    named = list(model.named_parameters()) + list(model.named_buffers())
    mine = [fingerprint(tensor) for _, tensor in named]
    everyone: list[Any] = [None] * dist.get_world_size()
    call_on_world("weight checksum", dist.all_gather_object, everyone, mine)
    reference = everyone[0]
    differ = {
        rank: [name for (name, _), a, b in zip(named, theirs, reference) if a[0] == b[0] and a[1] != b[1]]
        for rank, theirs in enumerate(everyone)
        if theirs != reference
    }
    differ = {rank: names for rank, names in differ.items() if names or len(everyone[rank]) != len(reference)}
    if not differ:
        return
    if weights == "broadcast" and all(len(everyone[rank]) == len(reference) for rank in differ):
        _broadcast_from_rank0(named, sorted({name for names in differ.values() for name in names}), sorted(differ))
        return
    lines = []
    for rank, names in differ.items():
        if len(everyone[rank]) != len(reference):
            lines.append(f"rank {rank} holds {len(everyone[rank])} parameters and buffers, rank 0 {len(reference)}")
            continue
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        lines.append(f"rank {rank} differs from rank 0 in {len(names)} tensors ({shown})")
    raise ModelError(
        "ranks hold different weights: " + "; ".join(lines) + ". autopar.compile cuts each rank's shards from its own "
        "copy of the model, so every rank must build the same one: seed every rank alike (torch.manual_seed(s) "
        "before building the model) and load the same files, or build it on the meta device and pass "
        "init=autopar.SeededInit(seed) or init=autopar.FromCheckpoint(path)"
    )


@torch.no_grad()
def _broadcast_from_rank0(named: list[tuple[str, torch.Tensor]], names: list[str], ranks: list[int]) -> None:
    """Copy rank 0's ``names`` into every rank's model, in place (DDP's broadcast at construction)."""
    log.warning(
        "autopar: ranks %s hold other weights than rank 0 in %d tensors (%s%s); compile broadcasts rank 0's into "
        "every rank's model, as DDP does (weights='check' refuses them instead)",
        ranks,
        len(names),
        ", ".join(names[:3]),
        " ..." if len(names) > 3 else "",
    )
    tensors = dict(named)
    for name in names:
        tensor = tensors[name]
        whole = tensor.detach()
        buffer = whole if whole.is_contiguous() else whole.contiguous()
        dist.broadcast(buffer, src=0)
        if buffer is not whole:
            whole.copy_(buffer)
