"""The same weights on every rank: a checksum compared at ``compile``, and a refusal naming the ranks.

Every rank cuts its shards from its own copy of the model, so ranks that built it differently
(another seed, another checkpoint) would train a mix of models without a word. DDP broadcasts
rank 0's parameters and buffers at construction instead. autopar compares checksums, for three
reasons: the check reads each tensor once on its own device and sends a few bytes per tensor
(a broadcast sends the whole model from rank 0 to every rank); the user's ``model`` is left as the
user built it (a broadcast would change it under them on every rank but 0, and an eager
reference built from it would then differ from what trains); and a rank that disagrees is
usually a bug (a missed seed, a rank that loaded another file) better fixed at its source.

Models built on the meta device (``SeededInit``, ``FromCheckpoint``) are materialized from a
seed or a checkpoint that is the same on every rank by construction: they skip the check.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Any

import torch
import torch.distributed as dist

from autopar.ops.collectives import call_on_world

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


def check_same_weights(model: torch.nn.Module, init: Any = None) -> None:
    """Refuse (ValueError on every rank) when ranks hold different parameters or buffers.

    ``init`` is ``compile``'s: a model materialized by ``SeededInit`` or ``FromCheckpoint`` is
    the same on every rank by construction, and costs nothing here."""
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
    lines = []
    for rank, names in differ.items():
        if len(everyone[rank]) != len(reference):
            lines.append(f"rank {rank} holds {len(everyone[rank])} parameters and buffers, rank 0 {len(reference)}")
            continue
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        lines.append(f"rank {rank} differs from rank 0 in {len(names)} tensors ({shown})")
    raise ValueError(
        "ranks hold different weights: " + "; ".join(lines) + ". autopar.compile cuts each rank's shards from its own "
        "copy of the model, so every rank must build the same one: seed every rank alike (torch.manual_seed(s) "
        "before building the model) and load the same files, or build it on the meta device and pass "
        "init=autopar.SeededInit(seed) or init=autopar.FromCheckpoint(path)"
    )
