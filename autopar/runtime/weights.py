"""The same weights on every rank: a checksum compared at ``compile``, and a refusal naming the ranks.

Every rank cuts its shards from its own copy of the model, so ranks that built it differently
(another seed, another checkpoint) would train a mix of models without a word. DDP broadcasts
rank 0's parameters and buffers at construction instead. autopar compares checksums, for three
reasons: the check reads each tensor once on its own device and sends a few integers per tensor
(a broadcast sends the whole model from rank 0 to every rank); the user's ``model`` is left as the
user built it (a broadcast would change it under them on every rank but 0, and an eager
reference built from it would then differ from what trains); and a rank that disagrees is
usually a bug (a missed seed, a rank that loaded another file) better fixed at its source.

Models built on the meta device (``SeededInit``, ``FromCheckpoint``) are materialized from a
seed or a checkpoint that is the same on every rank by construction: they skip the check.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autopar.ops.collectives import call_on_world

_CHUNK = 1 << 22  # elements per chunk: bounds the int64 temporary at 32 MiB per tensor


def fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """(sum, position-weighted sum) of ``tensor``'s bytes read as integers, modulo 2**64.

    Exact: any change of a bit changes the sum of its word, and two words swapped change the
    weighted one. Integer sums are associative, so every device and chunking gives the same value.
    """
    flat = tensor.detach().contiguous().view(-1)
    if flat.element_size() in (2, 4, 8) and flat.dtype != torch.bool:
        words = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    else:
        words = flat.view(torch.uint8)
    total = weighted = 0
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device, dtype=torch.int64)
        total += int(chunk.sum())
        weighted += int((chunk * positions).sum())
    return total % 2**64, weighted % 2**64


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
    differ = {rank: [name for (name, _), a, b in zip(named, theirs, reference) if a != b]
              for rank, theirs in enumerate(everyone) if theirs != reference}
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
