"""The offload runtime: fetch parameters at their uses, send gradients to the store as backward
makes them, and keep saved parameters out of the autograd graph.

An ``Offloader`` is a module in the rewritten graph (``gm.offload``); the offload pass calls it
before every use of an offloaded parameter: ``offload(stub, key=..., next_key=...)``. It returns a
fresh tensor read from the store, and starts reading ``next_key`` (the next fetch in graph order)
when the plan prefetches. The parameter the ``ParallelModule`` holds is an empty *stub* leaf that
only ties the fetch into autograd: the fetch's backward adds the gradient to the store and gives
the stub none.

Ops that save a fetched parameter for backward (``linear`` saves its weight) would keep it alive
from forward to backward. Under ``Offloader.saved_tensor_hooks()`` (which ``ParallelModule``
enters around the graph), such a saved tensor is replaced by its key, and backward reads it
again, prefetching the fetch before it. Checkpointed segments keep nothing: their own hooks are
the innermost ones, and their recompute fetches again.

Store keys: ``param/FQN``, ``grad/FQN``, ``exp_avg/FQN``, ``exp_avg_sq/FQN`` (canonical FQNs).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch

from autopar.memory.decisions import MemoryPlan
from autopar.memory.store import Store


def param_key(fqn: str) -> str:
    return f"param/{fqn}"


def grad_key(fqn: str) -> str:
    return f"grad/{fqn}"


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stub: torch.Tensor, offloader: "Offloader", fqn: str) -> torch.Tensor:
        ctx.offloader, ctx.fqn = offloader, fqn
        return offloader.store.get(param_key(fqn))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.offloader.add_grad(ctx.fqn, grad)
        return None, None, None


class Offloader(torch.nn.Module):
    """Carries out a plan's offload decisions against one store (see the module docstring)."""

    def __init__(self, memory: MemoryPlan, store: Store):
        super().__init__()
        self.memory = memory
        self.store = store
        self.params = set(memory.offloaded("param"))
        self.grads = set(memory.offloaded("grad")) | self.params  # a fetched parameter's gradient
        self.states = set(memory.offloaded("optimizer_state"))
        self.previous: dict[str, str] = {}  # fetch order, for backward prefetch (set by the pass)
        self._fetched: dict[int, tuple[weakref.ref, str]] = {}
        self._hooks: list[Any] = []

    def forward(self, stub: torch.Tensor, key: str, next_key: str | None = None) -> torch.Tensor:
        # A checkpoint's recompute runs fetches again inside backward, where the next fetch in
        # forward order was needed long ago: prefetch only in forward.
        if next_key is not None and torch._C._current_graph_task_id() == -1:
            self.store.prefetch(param_key(next_key))
        value = _Fetch.apply(stub, self, key)
        self._fetched[value.untyped_storage().data_ptr()] = (weakref.ref(value), key)
        return value

    # -- gradients ------------------------------------------------------------------------------
    def add_grad(self, fqn: str, grad: torch.Tensor) -> None:
        """Add to the stored gradient; with prefetch the write runs behind the rest of backward."""
        self.store.accumulate(grad_key(fqn), grad, wait=not self.memory.prefetch)

    def grad(self, fqn: str) -> torch.Tensor | None:
        key = grad_key(fqn)
        return self.store.get(key) if key in self.store else None

    def clear_grads(self) -> None:
        for fqn in self.grads:
            self.store.delete(grad_key(fqn))

    def attach_grad_hooks(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Send the gradients of resident parameters whose gradient is offloaded to the store
        as soon as autograd has accumulated them, and free them on the device."""
        for fqn, param in params.items():
            if fqn in self.grads and fqn not in self.params and param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_hook(fqn)))

    def _grad_hook(self, fqn: str):
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:
                self.add_grad(fqn, param.grad)
                param.grad = None
        return hook

    # -- saved tensors --------------------------------------------------------------------------
    @contextlib.contextmanager
    def saved_tensor_hooks(self) -> Iterator[None]:
        if not self.params:
            yield
            return
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._fetched.clear()

    def _pack(self, tensor: torch.Tensor) -> Any:
        pointer = tensor.untyped_storage().data_ptr()
        entry = self._fetched.get(pointer)
        if entry is not None:
            base = entry[0]()
            if base is not None and base.untyped_storage().data_ptr() == pointer:
                # The offset from the fetched tensor's own: a store may hand out views into buffers.
                return (entry[1], tensor.shape, tensor.stride(), tensor.storage_offset() - base.storage_offset())
        return tensor

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, tuple):
            return packed
        fqn, shape, stride, offset = packed
        before = self.previous.get(fqn)
        if before is not None and self.memory.prefetch:
            self.store.prefetch(param_key(before))
        full = self.store.get(param_key(fqn))
        return full.as_strided(shape, stride, full.storage_offset() + offset)


__all__ = ["Offloader", "param_key", "grad_key"]
