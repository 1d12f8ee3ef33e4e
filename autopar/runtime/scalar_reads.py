"""A number read out of a DTensor that is not whole on every rank: refused, naming the read that is.

``.item()``, ``float()``, ``int()``, ``bool()`` and formatting of a one-element DTensor call
``aten._local_scalar_dense``, which DTensor runs on the rank's local tensor whatever its
placements. A reduction over a sharded gradient (``p.grad.norm()``, ``.abs().max()``,
``torch.isfinite(p.grad).all()``) is ``Partial`` until redistributed, so the read gave this rank's
part: under an FSDP plan ``float(wte.grad.norm())`` read 0.418 where eager's is 0.859, a clip
written by hand from such norms trained 0.2-1.2 off eager, and a "skip the step on a non-finite
gradient" check stepped on three ranks of four and skipped on the fourth, without a word.

``install`` (once a process, from the first module that holds DTensor parameters) puts a handler
for the op in DTensor's dispatcher: a DTensor replicated on every mesh dim larger than 1 reads
as before (what ``clip_grad_norm_`` returns, a loss); any other is refused, naming
``.full_tensor()`` (a collective every rank calls) or the whole-model tools. A refusal rather than a
gather: the read is implicit (a format string under ``if rank == 0``), where a collective would
wait for ranks that never come.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autopar.errors import UsageError

_OP = torch.ops.aten._local_scalar_dense.default
_INSTALLED: list[bool] = []


def install() -> None:
    """Refuse reading a number out of a DTensor that is not whole on every rank (once a process)."""
    handlers = getattr(DTensor._op_dispatcher, "_custom_op_handlers", None)
    if _INSTALLED or handlers is None:
        return
    handlers[_OP] = read_scalar
    _INSTALLED.append(True)


def read_scalar(op_call: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op_call`` on the local tensor of the DTensor ``args[0]`` where that is the whole value."""
    tensor = args[0]
    mesh = tensor.device_mesh
    split = [(dim, p) for dim, p in enumerate(tensor.placements) if not p.is_replicate() and mesh.size(dim) > 1]
    if split:
        raise UsageError(
            f"reading a number (.item(), float(), bool(), a format) out of a DTensor that is not whole on every rank "
            f"(placements {tuple(tensor.placements)}: a reduction over a sharded tensor, such as p.grad.norm()): it "
            "would be this rank's part, and ranks would decide apart. Call .full_tensor() first on every rank (a "
            "collective: not under `if rank == 0`), or use the whole model's tools: the norm "
            "torch.nn.utils.clip_grad_norm_ returns, pm.grad_norm(), or pm.full_grads() for single gradients"
        )
    return op_call(tensor.to_local(), *args[1:], **kwargs)


__all__ = ["install", "read_scalar"]
