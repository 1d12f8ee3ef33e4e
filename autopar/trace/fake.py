"""Meta-device models under FakeTensors: the shapes and devices of a model built on ``device``,
with no storage, so that ``torch.export`` traces it and the planner prices it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def has_meta_tensors(model: torch.nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def apply_order(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """(name prefix, module) in the order ``module.apply(fn)`` calls ``fn``."""
    for name, child in module.named_children():
        yield from apply_order(child, f"{prefix}{name}.")
    yield prefix, module


def own_tensors(module: torch.nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(slot, name, tensor) for the module's own parameters and buffers."""
    for name, tensor in module._parameters.items():
        if tensor is not None:
            yield "_parameters", name, tensor
    for name, tensor in module._buffers.items():
        if tensor is not None:
            yield "_buffers", name, tensor


@contextlib.contextmanager
def fake_tensors(
    model: torch.nn.Module, device: str | torch.device = "cpu", param_dtype: torch.dtype | None = None
) -> Iterator[None]:
    """Within the block, ``model``'s meta parameters and buffers are FakeTensors on ``device``.

    They have shapes and a device but no storage, so ``torch.export`` traces the model as if it
    were built on ``device`` (a meta tensor next to a real input is a device mismatch). Ties are
    kept: a tensor shared by two modules becomes one FakeTensor.

    ``param_dtype`` also swaps every floating parameter (meta or not) for one of that dtype, so
    that the model traces as if cast to it (a precision policy's compute dtype) without a copy
    of its weights; ``device="meta"`` swaps in meta tensors instead of FakeTensors.
    """
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: list[tuple[dict, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}

    def recast(slot: str, tensor: torch.Tensor) -> bool:
        return param_dtype is not None and slot == "_parameters" and tensor.is_floating_point() and tensor.dtype != param_dtype

    try:
        for _, module in apply_order(model):
            for slot, name, tensor in own_tensors(module):
                if not (tensor.is_meta or recast(slot, tensor)):
                    continue
                if id(tensor) not in fakes:
                    dtype = param_dtype if recast(slot, tensor) else tensor.dtype
                    if str(device) == "meta":
                        fake = torch.empty(tensor.shape, dtype=dtype, device="meta")
                    else:
                        with mode:
                            fake = torch.empty(tensor.shape, dtype=dtype, device=device)
                    if isinstance(tensor, torch.nn.Parameter):
                        fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                    fakes[id(tensor)] = fake
                table = getattr(module, slot)
                swapped.append((table, name, tensor))
                table[name] = fakes[id(tensor)]
        yield
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor
