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

Segments whose activations are offloaded run under ``Offloader.activation_hooks``: their saved
tensors go to the store in forward and come back in backward, one segment prefetched ahead.

Under a precision policy that casts ("bf16-mixed"), the store holds the parameter's master (fp32),
which ``autopar.optim.AdamW`` steps, and the offload pass fetches it already cast:
``offload(stub, key=..., dtype=torch.bfloat16)`` reads the store's copy in the compute dtype
(``Store.keep_cast``, rewritten by every write of the master), so a fetch moves and holds half the
bytes, and the tensor that ops save is the fetched one, which the hooks above drop. Its gradient
comes back in the compute dtype and is cast to the master's before it is added to the store, as
the cast's backward does where nothing is offloaded.

Store keys: ``param/FQN``, ``grad/FQN``, ``exp_avg/FQN``, ``exp_avg_sq/FQN`` (canonical FQNs),
``param/FQN@bfloat16`` (the compute copy), ``act/LAYER/N`` (the N-th saved tensor of a layer,
this step).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

from autopar.errors import OffloadError
from autopar.ir.memory import MemoryPlan
from autopar.ops.params import local_of
from autopar.runtime.optim_guard import refuse_torch_optimizers
from autopar.runtime.store import Store

aten = torch.ops.aten

# Saved tensors smaller than this stay on the device (a store entry costs more than they save).
MIN_ACTIVATION_BYTES = 4096


def param_key(fqn: str) -> str:
    return f"param/{fqn}"


def grad_key(fqn: str) -> str:
    return f"grad/{fqn}"


# A fetch: a parameter's canonical FQN, and the dtype it is read in (None: the stored master's).
Fetch = tuple[str, "torch.dtype | None"]


class _Fetch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stub: torch.Tensor, offloader: Offloader, fetch: Fetch) -> torch.Tensor:
        ctx.offloader, ctx.fqn, ctx.stub = offloader, fetch[0], weakref.ref(stub)
        ctx.master_dtype = offloader.store.meta[param_key(fetch[0])][1]
        return offloader.store.get(offloader.store_key(fetch))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None]:
        # The master's gradient, as the cast's backward gives it where nothing is offloaded.
        stub = ctx.stub()
        if stub is not None:
            ctx.offloader.take_grad(stub, ctx.fqn, grad.to(ctx.master_dtype))
        return None, None, None


class OffloadedGrad(torch.Tensor):
    """The ``.grad`` of a parameter whose gradient the plan offloads, once backward has made it: a
    stand-in that holds no memory and reads through to the store. An op on it runs on the stored
    gradient, read onto the device for that op alone (a foreach op, one tensor at a time), and an
    op that writes it writes the store: so torch's ``clip_grad_norm_(pm.parameters())`` (what HF's
    Trainer calls) measures and clips every gradient, one at a time, where before it saw the
    resident ones alone and the step went on with the offloaded ones unclipped (0.006 off eager
    after one step), without a word; backward's accumulation (``add_``), ``zero_`` and writes
    through views of it (``p.grad.view(-1)[:k].mul_(c)``: a view is a stand-in too) reach the
    store as well. The stored gradient counts only while ``.grad`` holds its stand-in: a ``.grad`` set
    to None (``pm.zero_grad()``; before, the stored gradients summed over the steps, 0.022 off
    eager after three) makes the next backward replace it."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, offloader: Offloader, fqn: str, whole: Any = None, views: tuple = (), device=None):
        held = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, strides=like.stride(), dtype=like.dtype, device=device or like.device, requires_grad=False
        )
        held.offloader, held.fqn, held.whole, held.views = weakref.ref(offloader), fqn, whole, views
        return held

    def __repr__(self) -> str:  # type: ignore[override]
        return f"OffloadedGrad({self.fqn!r}, shape={tuple(self.shape)}, in the offload store)"

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stored gradient, this stand-in's value): the gradient (this rank's shard) on the
        compute device, zeros where ``zero_`` cleared it; for an offloaded parameter's stub on a
        plan of DTensor parameters a DTensor (``whole``), so that it computes with the other
        gradients as theirs do (a norm summed over the ranks' shards). The value is the gradient
        seen through the views taken of the stand-in (``views``), so writes to it reach the first."""
        offloader = self._offloader()
        key = grad_key(self.fqn)
        if key in offloader.store:
            value = offloader.store.get(key)
        else:  # shaped as the stored parameter where this stands in for a stub's gradient
            stored = offloader.store.meta.get(param_key(self.fqn))
            value = torch.zeros(stored[0] if stored else self.shape, dtype=self.dtype, device=self.device)
        base = self.whole(value) if self.whole is not None else value
        seen = base
        for func, args, kwargs in self.views:
            seen = func(seen, *args, **kwargs)
        return base, seen

    def write(self, base: torch.Tensor) -> None:
        offloader = self._offloader()
        offloader.store.put(grad_key(self.fqn), local_of(base), wait=not offloader.memory.prefetch)

    def view_of(self, func: Any, args: tuple, kwargs: dict) -> OffloadedGrad:
        """A stand-in for the view ``func`` takes of this one: it reads, and writes, the stored
        gradient through that view."""
        stored = self._offloader().store.meta.get(param_key(self.fqn))
        with torch.device("meta"):  # a stub's stand-in is empty: its gradient has the stored parameter's shape
            probe = torch.empty(stored[0], dtype=self.dtype) if stored and not self.views else None
            if probe is None:
                probe = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype)
            like = func(probe, *args, **kwargs)
        return OffloadedGrad(like, self._offloader(), self.fqn, self.whole, (*self.views, (func, args, kwargs)), self.device)

    def _offloader(self) -> Offloader:
        offloader = self.offloader()
        if offloader is None:
            raise OffloadError(f"the gradient of '{self.fqn}' was in the offload store of a module that is gone")
        return offloader

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, OffloadedGrad):
            if func in (aten.detach.default, aten.detach_.default, aten.alias.default):
                return first  # (an in-place op on it still reaches the store)
            if func is aten.zero_.default and not first.views:
                first._offloader().store.delete(grad_key(first.fqn))
                return first
            if _is_view(func):
                return first.view_of(func, args[1:], kwargs)
        if func._schema.name.startswith("aten::_foreach_"):
            return _each_tensor(func, args, kwargs)
        return _read_through(func, args, kwargs)


def _is_view(func: Any) -> bool:
    """An op whose output aliases its first input without writing it (``view``, ``t``, ``select``)."""
    returns = func._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _read_through(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on the stored gradients of the stand-ins among its arguments; what it writes of
    them goes back to the store, and an in-place op returns its stand-in."""
    read: dict[int, tuple[OffloadedGrad, torch.Tensor, torch.Tensor]] = {}

    def load(value: Any) -> Any:
        if not isinstance(value, OffloadedGrad):
            return value
        if id(value) not in read:
            read[id(value)] = (value, *value.read())
        return read[id(value)][2]

    out = func(*pytree.tree_map(load, args), **pytree.tree_map(load, kwargs))
    written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    names = [a.name for a in func._schema.arguments]
    for name in written:
        given = args[names.index(name)] if names.index(name) < len(args) else kwargs.get(name)
        for held in pytree.tree_leaves(given):
            if isinstance(held, OffloadedGrad):
                held.write(read[id(held)][1])
    values = {id(value): held for held, _, value in read.values()}
    return pytree.tree_map(lambda v: values.get(id(v), v) if isinstance(v, torch.Tensor) else v, out)


def _each_tensor(func: Any, args: tuple, kwargs: dict) -> Any:
    """A foreach op over lists holding stand-ins: one call over the other positions, and one per
    stand-in, so that only one stored gradient is on the device at once."""
    size = len(args[0])
    lists = [i for i, a in enumerate(args) if isinstance(a, (list, tuple)) and len(a) == size]
    held = [k for k in range(size) if any(isinstance(args[i][k], OffloadedGrad) for i in lists)]
    plain = [k for k in range(size) if k not in set(held)]

    def at(positions: list[int]) -> tuple:
        return tuple([a[k] for k in positions] if i in lists else a for i, a in enumerate(args))

    outs: dict[int, Any] = {}
    if plain:
        result = func(*at(plain), **kwargs)
        outs.update(zip(plain, result if result is not None else [None] * len(plain), strict=True))
    for k in held:
        result = _read_through(func, at([k]), kwargs)
        outs[k] = result[0] if result is not None else None
    if all(out is None for out in outs.values()):
        return None
    return [outs[k] for k in range(size)]


def holds_offloaded_grad(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` is the stand-in of a gradient in the offload store (``OffloadedGrad``)."""
    grad = param.grad
    return isinstance(grad._local_tensor if isinstance(grad, DTensor) else grad, OffloadedGrad)


def _stays(tensor: torch.Tensor) -> bool:
    """Saved tensors kept on the device by activation offload: parameters and views of them
    (resident already), small ones, and layouts that a dense copy cannot rebuild (broadcast
    views, overlaps)."""
    base = tensor._base if tensor._base is not None else tensor
    if base.requires_grad and base.grad_fn is None:
        return True
    if tensor.numel() * tensor.element_size() < MIN_ACTIVATION_BYTES:
        return True
    return not tensor.is_contiguous() and not _dense(tensor)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether the elements fill their memory exactly once, in some order of the dims."""
    expected = 1
    for dim in sorted(range(tensor.dim()), key=tensor.stride):
        if tensor.size(dim) == 1:
            continue
        if tensor.stride(dim) != expected:
            return False
        expected *= tensor.size(dim)
    return True


class Offloader(torch.nn.Module):
    """Carries out a plan's offload decisions against one store (see the module docstring)."""

    def __init__(self, memory: MemoryPlan, store: Store):
        super().__init__()
        self.memory = memory
        self.store = store
        self.params = set(memory.offloaded("param"))
        self.grads = set(memory.offloaded("grad")) | self.params  # a fetched parameter's gradient
        self.states = set(memory.offloaded("optimizer_state"))
        self.previous: dict[Fetch, Fetch] = {}  # fetch order, for backward prefetch (set by the pass)
        self._fetched: dict[int, tuple[weakref.ref, Fetch]] = {}
        self._activation_keys: dict[str, list[str]] = {}  # segment -> its stored activations, this step
        self._read_started: set[str] = set()  # segments whose backward has begun reading
        self._hooks: list[Any] = []
        # canonical FQN -> makes this rank's shard of an offloaded parameter (or its gradient) the
        # whole DTensor, where the plan's parameters are DTensors (set by the module)
        self.whole: dict[str, Any] = {}

    def forward(
        self,
        stub: torch.Tensor,
        key: str,
        next_key: str | None = None,
        dtype: torch.dtype | None = None,
        next_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Parameter ``key`` (a canonical FQN) from the store, in ``dtype`` (the compute copy) or
        as stored; ``next_key`` (in ``next_dtype``) is prefetched."""
        # A checkpoint's recompute runs fetches again inside backward, where the next fetch in
        # forward order was needed long ago: prefetch only in forward.
        if next_key is not None and torch._C._current_graph_task_id() == -1:
            self.store.prefetch(self.store_key((next_key, next_dtype)))
        fetch = (key, dtype)
        value = _Fetch.apply(stub, self, fetch)
        self._fetched[value.untyped_storage().data_ptr()] = (weakref.ref(value), fetch)
        return value

    def store_key(self, fetch: Fetch) -> str:
        """The store key a fetch reads: the master's, or its copy in the fetch's dtype (made on
        the first fetch in that dtype, then rewritten with every write of the master)."""
        fqn, dtype = fetch
        key = param_key(fqn)
        if dtype is None or key not in self.store or self.store.meta[key][1] == dtype:
            return key
        return self.store.keep_cast(key, dtype)

    # -- gradients ------------------------------------------------------------------------------
    def add_grad(self, fqn: str, grad: torch.Tensor) -> None:
        """Add to the stored gradient; with prefetch the write runs behind the rest of backward."""
        self.store.accumulate(grad_key(fqn), grad, wait=not self.memory.prefetch)

    def grad(self, fqn: str, param: torch.Tensor) -> torch.Tensor | None:
        """The stored gradient of ``fqn``, or None where ``param`` (its parameter or stub) holds no
        stand-in for it (``OffloadedGrad``): none made since its ``.grad`` was set to None."""
        key = grad_key(fqn)
        return self.store.get(key) if key in self.store and holds_offloaded_grad(param) else None

    def take_grad(self, param: torch.Tensor, fqn: str, grad: torch.Tensor) -> None:
        """Backward made ``grad`` (this rank's shard) for ``param``: add it to the stored gradient
        where ``param`` holds the stand-in, else replace what the store holds (``.grad`` was set to
        None since), and leave the stand-in in ``.grad``."""
        if holds_offloaded_grad(param):
            self.add_grad(fqn, grad)
            return
        self.store.put(grad_key(fqn), grad.detach(), wait=not self.memory.prefetch)
        held = OffloadedGrad(local_of(param), self, fqn, None if isinstance(param, DTensor) else self.whole.get(fqn))
        param.grad = DTensor(held, param._spec, requires_grad=False) if isinstance(param, DTensor) else held

    def clear_grads(self) -> None:
        for fqn in self.grads:
            self.store.delete(grad_key(fqn))

    def attach_grad_hooks(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Send the gradients of resident parameters whose gradient is offloaded to the store
        as soon as autograd has accumulated them, and free them on the device; and refuse a
        torch optimizer over any parameter whose value, gradient or state is offloaded
        (``runtime.optim_guard``)."""
        for fqn, param in params.items():
            if fqn in self.grads and fqn not in self.params and param.requires_grad:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._grad_hook(fqn)))
        # What these parameters hold is in the store: a torch optimizer must not step them.
        offloaded = {fqn: "value" for fqn in self.params}
        offloaded.update({fqn: "gradient" for fqn in self.grads - self.params})
        offloaded.update({fqn: "optimizer state" for fqn in self.states - self.grads})
        refuse_torch_optimizers(params, offloaded)

    def _grad_hook(self, fqn: str):
        def hook(param: torch.Tensor) -> None:
            # (where .grad held the stand-in, backward's accumulation has reached the store already)
            if param.grad is not None and not holds_offloaded_grad(param):  # a DTensor's: its local shard is stored
                grad, param.grad = local_of(param.grad), None
                self.take_grad(param, fqn, grad)

        return hook

    # -- offloaded activations --------------------------------------------------------------------
    @contextlib.contextmanager
    def activation_hooks(self, segment: str, previous: str | None) -> Iterator[None]:
        """Saved tensors of ``segment`` go to the store under ``act/SEGMENT/N`` (written behind
        with prefetch) and are read back when backward needs them. The first read of a segment
        prefetches every tensor of ``previous`` (the offloaded segment before it in forward),
        whose backward comes next. Parameters stay: a resident one is kept as it is, a fetched
        one is saved by its key, as under ``saved_tensor_hooks``."""
        keys: list[str] = []
        self._activation_keys[segment] = keys
        self._read_started.discard(segment)

        def pack(tensor: torch.Tensor) -> Any:
            fetched = self._pack(tensor)
            if fetched is not tensor:
                return ("param", fetched)
            if _stays(tensor):
                return ("kept", tensor)
            key = f"act/{segment}/{len(keys)}"
            keys.append(key)
            self.store.put(key, tensor.contiguous(), wait=not self.memory.prefetch)
            return ("stored", (key, None if tensor.is_contiguous() else tensor.stride()))

        def unpack(packed: Any) -> torch.Tensor:
            kind, value = packed
            if kind == "kept":
                return value
            if kind == "param":
                return self._unpack(value)
            if segment not in self._read_started:
                self._read_started.add(segment)
                if self.memory.prefetch and previous is not None:
                    for key in self._activation_keys.get(previous, ()):
                        self.store.prefetch(key)
            key, stride = value
            loaded = self.store.get(key)
            if stride is None:
                return loaded
            # The saved layout, not only the values: a backward matmul on a transposed operand
            # takes another kernel path (and rounds differently) than on a contiguous one.
            out = torch.empty_strided(loaded.shape, stride, dtype=loaded.dtype, device=loaded.device)
            return out.copy_(loaded)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

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
        fetch, shape, stride, offset = packed
        before = self.previous.get(fetch)
        if before is not None and self.memory.prefetch:
            self.store.prefetch(self.store_key(before))
        full = self.store.get(self.store_key(fetch))
        return full.as_strided(shape, stride, full.storage_offset() + offset)


__all__ = ["Offloader", "param_key", "grad_key"]
