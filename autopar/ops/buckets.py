"""Scheduled parameter communication: bucketed gradient reductions and prefetched gathers.

The rewritten graph calls two stateful modules (added by ``passes.schedule``, sized by
``ir.options.CommOptions``):

- ``GradBuckets`` takes each parameter gradient that needs a reduction (DDP's all-reduce of a
  replicated parameter; FSDP's reduce-scatter of a sharded one) from the backward of a graph node,
  copies it into its slot of a flat bucket, and launches the bucket's collective asynchronously
  as soon as every slot of the bucket has arrived. Buckets fill in the reverse of the forward
  order of use, which is the order backward produces gradients. At the end of backward (an
  autograd engine callback) it waits on every bucket and adds each reduced gradient into the
  parameter's ``.grad`` (which autograd may already hold from uses that need no reduction).
  Where forward ran twice before one backward (``loss = pm(x) + pm(y)``), a launched bucket gets
  more gradients: they fill a new round of it, reduced on its own, and every round is added. A
  slot no gradient reached (a parameter frozen after compile, or one the loss does not depend on)
  is reduced as zeros but leaves ``.grad`` as it is (None), as eager does: a zero gradient would
  still move the parameter under weight decay or momentum.
  ``torch.autograd.grad`` over a parameter with a slot would get None back, the gradient landing
  in ``.grad``: its first gradient into a bucket refuses it (``ops.params.refuse_in_grad_call``).
  ``backward(inputs=...)`` runs a bucket node's backward as soon as it names one of its
  parameters, and autograd then computes the others' gradients too: only the named ones' are added.
- ``ParamGathers`` all-gathers sharded parameters in forward (FSDP's pattern), a group of them
  (one layer, as FSDP2's ``fully_shard(block)``) with one collective of a flat buffer, and
  issues the all-gather of the next group in forward order while the current one computes
  (prefetch); the first groups' gathers launch as forward starts (``begin``). A group marked to
  reshard after forward (``CommOptions.reshard_after_forward``) is not kept alive by autograd:
  while the graph runs (``saved_tensors_hooks``), a saved tensor that is (a view of) one of its
  gathered parameters is packed as its key and layout, so the gathered storage is freed after
  its last forward use; backward's first unpack of the group
  all-gathers it again (and the group backward needs next, ahead) and rebuilds the view with the
  same strides on the new storage, which holds the same values. FSDP2 frees and refills the
  unsharded storage in place instead; packing leaves autograd's saved tensors alone.

Held back (``pm.no_sync()``, DDP's gradient accumulation): while ``sync`` is off, an all-reduce
bucket whose parameters get their gradients from it alone (``Slot.alone``) launches nothing. Its
flat buffer is kept, summed over such backwards, and each parameter's ``.grad`` is a view of its
slot there, this rank's unreduced sum, as DDP's ``.grad`` is inside ``no_sync()``: ``zero_grad()``
drops or zeroes it as it would DDP's. The next synced backward adds what the views still hold into
its bucket before the all-reduce, so one collective serves every micro-step. Reduce-scatter
buckets (sharded parameters) still reduce at every backward: holding them would keep every
sharded gradient whole.

Numbers: a bucket's all-reduce is an all-reduce of each of its slots (sums are elementwise);
a reduce-scatter bucket lays each slot out rank-major (chunk ``r`` of every slot in section
``r``), so rank ``r`` receives exactly the sum of chunk ``r`` of each gradient, as the
all-reduce-then-chunk it replaces gave.
"""

from __future__ import annotations

import contextlib
import math
import operator
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.errors import UsageError
from autopar.ir.spec import chunk_piece, pad_piece, piece_rows
from autopar.ops import collectives
from autopar.ops.params import (
    BACKWARD_INPUTS,
    add_grads,
    as_like,
    hold_hooks,
    local_of,
    named_in_backward,
    refuse_in_grad_call,
    run_held_hooks,
)


@dataclass(frozen=True, slots=True)
class Slot:
    """One parameter gradient reduced in a bucket.

    ``kind`` is "all_reduce" (over ``groups``) or "reduce_scatter" (over ``groups[0]``, along
    ``dim``; the gradient arrives whole and leaves as this rank's chunk). ``uses`` counts the
    graph nodes whose backward add into it: the slot is complete when all have. ``dtype`` is
    the reduction's: a precision policy's ``reduce_dtype`` where it is not the parameter's
    (each gradient is cast into the slot, the reduced one back to the parameter's dtype).
    """

    key: str
    kind: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    groups: tuple[str, ...]
    dim: int = 0
    uses: int = 1
    group: int = -1
    alone: bool = False  # the parameter's every use is in this slot: only the bucket writes its .grad
    # A padded shard's (``ir.spec.padded_axis``): the unpadded size of ``dim``, which ``shape`` pads
    # to the group size times ``ceil(size / k)``; -1: not padded
    size: int = -1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Bucket:
    slots: tuple[Slot, ...]

    @property
    def kind(self) -> str:
        return self.slots[0].kind

    @property
    def groups(self) -> tuple[str, ...]:
        return self.slots[0].groups

    @property
    def numel(self) -> int:
        return sum(slot.numel for slot in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * self.slots[0].dtype.itemsize


def make_buckets(slots: Sequence[Slot], cap_bytes: int, first_cap_bytes: int | None = None) -> list[Bucket]:
    """Group ``slots`` (in the order backward produces them) into buckets of at most
    ``cap_bytes`` (the first of at most ``first_cap_bytes``); a slot larger than the cap gets a
    bucket of its own. Slots of one bucket share kind, groups, dtype, dim and gather group."""
    buckets: list[Bucket] = []
    current: list[Slot] = []
    size = 0
    for slot in slots:
        cap = first_cap_bytes if first_cap_bytes is not None and not buckets else cap_bytes
        nbytes = slot.numel * slot.dtype.itemsize
        same = current and (current[0].kind, current[0].groups, current[0].dtype, current[0].dim, current[0].group) == (
            slot.kind,
            slot.groups,
            slot.dtype,
            slot.dim,
            slot.group,
        )
        if current and (not same or size + nbytes > cap):
            buckets.append(Bucket(tuple(current)))
            current, size = [], 0
        current.append(slot)
        size += nbytes
    if current:
        buckets.append(Bucket(tuple(current)))
    return buckets


class _Pending:
    """One bucket's state during one backward."""

    __slots__ = ("flat", "left", "written", "zeroed", "work", "out", "done", "held", "summed")

    def __init__(self, bucket: Bucket, device: torch.device, flat: torch.Tensor | None = None):
        self.flat: torch.Tensor | None = (
            flat if flat is not None else torch.empty(bucket.numel, dtype=bucket.slots[0].dtype, device=device)
        )
        self.left = sum(slot.uses for slot in bucket.slots)
        self.written: set[str] = set()
        # slots no gradient arrived for (a parameter frozen after compile, or one the loss does not
        # reach): zeros in the collective, but their .grad stays as it is (None), as in eager
        self.zeroed: set[str] = set()
        self.work = None
        self.out: torch.Tensor | None = None
        self.done = False  # waited on its first group (retired by the next launch, ``_retire``)
        self.held = False  # summed into the held buffer (``sync`` off): nothing launched
        # a retired bucket's all-reduce on its second group, launched then (``_retire``: summed
        # while backward goes on): (work, group)
        self.summed: tuple[object, str] | None = None


# id of a ``.grad`` that is a view of held gradients → the view: ``optimizer.step()`` refuses them.
_held_grads: dict[int, weakref.ref] = {}
_step_hook: list[object] = []


def _refuse_held_step(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
    """A global optimizer step pre-hook: a step on gradients ``no_sync()`` holds back (each rank's
    own unreduced sum) would move the ranks' replicas apart without an error."""
    if not _held_grads:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            ref = _held_grads.get(id(param.grad)) if param.grad is not None else None
            if ref is not None and ref() is param.grad:
                raise UsageError(
                    "optimizer.step() ran on gradients that pm.no_sync() holds back: inside no_sync() each rank's "
                    ".grad is its own unreduced sum, as DDP's, so the ranks would step apart. Step after a backward "
                    "outside no_sync() (every micro-step but the last under no_sync(), then step)"
                )


class GradBuckets(torch.nn.Module):
    """Bucketed, asynchronous gradient reductions (see the module docstring).

    ``params`` maps slot keys to the parameters whose ``.grad`` receives the result; the
    runtime binds them (``bind``) once the module holds its shards.
    """

    def __init__(self, buckets: Sequence[Bucket]):
        super().__init__()
        self.buckets = list(buckets)
        self._where = {slot.key: (b, i) for b, bucket in enumerate(self.buckets) for i, slot in enumerate(bucket.slots)}
        self._offsets = []
        for bucket in self.buckets:
            offsets, at = [], 0
            for slot in bucket.slots:
                offsets.append(at)
                at += slot.numel
            self._offsets.append(offsets)
        self._params: dict[str, torch.Tensor] = {}
        # Each bucket's buffers from the last backward (an all-reduce's flat, a reduce-scatter's
        # output), reused when no ``.grad`` views them any more (``zero_grad()`` dropped them), as
        # DDP keeps its buckets.
        self._spare: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._pending: list[_Pending | None] | None = None
        # Launched buckets that more gradients came for in the same backward (the graph ran forward
        # twice before one backward, ``loss = pm(a) + pm(b)``): each such round is reduced on its own
        # and every round's result is added into ``.grad`` at the end of backward.
        self._rounds: list[tuple[int, _Pending]] = []
        self._task = -1  # the autograd graph task the pending buckets belong to
        # the bucket (index, round) in flight that the next launch retires (``_retire``): a
        # reduce-scatter, whose input is held, or an all-reduce with further groups to sum over
        self._retiring: tuple[int, _Pending] | None = None
        self._scatter_inputs = 0  # reduce-scatter inputs alive now
        self.max_scatter_inputs = 0  # most reduce-scatter inputs alive at once in the last backward (tests)
        self.sync = True  # off inside ``pm.no_sync()``: all-reduces held back (module docstring)
        self._held: dict[int, torch.Tensor] = {}  # bucket → this rank's unreduced sum of held backwards
        self._views: dict[str, torch.Tensor] = {}  # slot key → the ``.grad`` set to its view of the held buffer
        self._held_written: dict[int, set[str]] = {}  # bucket → the slots a held backward wrote (the others stay None)
        self.launches = 0  # collectives launched (tests)

    def bind(self, params: dict[str, torch.Tensor]) -> None:
        missing = [slot.key for bucket in self.buckets for slot in bucket.slots if slot.key not in params]
        if missing:
            raise AssertionError(f"gradient buckets have slots for parameters the module does not hold: {missing}")
        self._params = dict(params)
        for key in self._where:
            hold_hooks(self._params[key])  # their hooks run once the bucket hands over the gradient

    def forward(
        self, *params: torch.Tensor, key: str | None = None, keys: Sequence[str] | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Identity on ``params``, whose gradients backward hands to their slots (``keys``; one
        parameter may name its slot as ``key`` and gets a tensor back, not a tuple). The graph
        calls this once per bucket with all its parameters (``passes.schedule``): one autograd
        node a bucket, not one a parameter, is host time a step saves (a bucket launches when
        all its slots have arrived, which is when that node's backward runs)."""
        if key is not None:
            return _SyncGrads.apply(self, (key,), *params)[0]
        return _SyncGrads.apply(self, tuple(keys or ()), *params)

    def has(self, key: str) -> bool:
        return key in self._where

    @property
    def held_numel(self) -> int:
        """Elements of unreduced gradients held for the next synced backward (``pm.no_sync()``)."""
        return sum(flat.numel() for flat in self._held.values())

    def release_held(self) -> None:
        """Reduce now what ``pm.no_sync()`` holds back, and hold nothing more until it is turned
        off again, before another graph's backward (of other shapes, arguments or mode) adds into
        those ``.grad`` views, or runs in the same backward as this graph; every rank calls it after
        the same call. Each such ``.grad`` is then its reduced sum, a gradient as any other, which
        the next backward adds to (reducing its own part): the micro-steps' sum eager has."""
        self.sync = True
        for index in sorted(self._held):
            flat = self._held.pop(index)
            for group in self.buckets[index].groups:
                collectives.wait(collectives.start_all_reduce(flat, group), group)
            self._held_written.pop(index, None)
            for slot in self.buckets[index].slots:
                view = self._views.pop(slot.key, None)
                if view is not None:
                    _held_grads.pop(id(view), None)

    def _holds(self, index: int) -> bool:
        """Whether bucket ``index`` can be held back: an all-reduce whose parameters' ``.grad``
        can be views of it (same dtype, written by it alone, none set by anything else now)."""
        bucket = self.buckets[index]
        if bucket.kind != "all_reduce":
            return False
        for slot in bucket.slots:
            param = self._params[slot.key]
            if not slot.alone or slot.dtype != param.dtype:
                return False
            if param.grad is not None:  # (asked only of a bucket not held: none of its views is out)
                return False  # a gradient already there (reduced, or the user's) cannot become a view
        return True

    def _take_held(self, index: int) -> tuple[torch.Tensor | None, set[str]]:
        """Bucket ``index``'s held buffer, its slots detached from the ``.grad`` views, and the
        slots it holds gradients for: a slot whose ``.grad`` was replaced or dropped since
        (``zero_grad()``), or that no held backward wrote, counts as zeros."""
        held = self._held.pop(index, None)
        written = self._held_written.pop(index, set())
        if held is None:
            return None, set()
        kept = set()
        for position, slot in enumerate(self.buckets[index].slots):
            view = self._views.pop(slot.key, None)
            if view is not None:
                _held_grads.pop(id(view), None)
            param = self._params[slot.key]
            if view is not None and param.grad is view:
                param.grad = None
                kept.add(slot.key)
            else:
                self._slot_view(index, position, held).zero_()
        return held, kept & written

    # -- backward -------------------------------------------------------------------------

    def add(self, key: str, grad: torch.Tensor) -> None:
        if BACKWARD_INPUTS[0] is not None and not named_in_backward(self._params[key]):
            return  # backward(inputs=...) that leaves it out: its slot stays unreached, its .grad as it is
        index, position = self._where[key]
        pending = self._round(index, grad.device)
        bucket = self.buckets[index]
        slot = bucket.slots[position]
        target = self._slot_view(index, position, pending.flat)
        if slot.kind == "reduce_scatter":
            grad = _rank_major(pad_piece(grad, slot.dim, slot.shape[slot.dim]), slot.dim, collectives.group_size(slot.groups[0]))
        if key in pending.written:
            target.add_(grad.reshape(target.shape))
        else:
            target.copy_(grad.reshape(target.shape))
            pending.written.add(key)
        pending.zeroed.discard(key)  # a held round's second forward may reach a slot the first did not
        pending.left -= 1
        if pending.left == 0:
            self._launch(index, pending)

    def add_all(self, keys: Sequence[str], grads: Sequence[torch.Tensor | None]) -> None:
        """``add`` of each gradient that arrived (None: none did). Where they fill a whole
        all-reduce bucket not written yet this round (the graph's node for the bucket, every
        parameter reached), they go into its flat buffer in one copy, as DDP's reducer copies
        in C++: one op instead of a slot view and a copy per parameter."""
        if BACKWARD_INPUTS[0] is not None:
            grads = [grad if named_in_backward(self._params[key]) else None for key, grad in zip(keys, grads, strict=True)]
        index = self._where[keys[0]][0] if keys else -1
        bucket = self.buckets[index] if keys else None
        whole = (
            bucket is not None
            and bucket.kind == "all_reduce"
            and all(grad is not None for grad in grads)
            and tuple(keys) == tuple(slot.key for slot in bucket.slots)
            and all(slot.uses == 1 for slot in bucket.slots)
        )
        if whole:
            pending = self._round(index, grads[0].device)
            if not pending.written and all(grad.dtype == pending.flat.dtype for grad in grads):
                torch.cat([grad.reshape(-1) for grad in grads], out=pending.flat)
                pending.written.update(keys)
                pending.left -= len(keys)
                if pending.left == 0:
                    self._launch(index, pending)
                return
        for key, grad in zip(keys, grads, strict=True):
            if grad is not None:
                self.add(key, grad)

    def _round(self, index: int, device: torch.device) -> _Pending:
        """Bucket ``index``'s state in this backward, started where it is the first gradient."""
        task = torch._C._current_graph_task_id()
        if self._pending is None or task != self._task:  # this backward's first gradient into a bucket
            refuse_in_grad_call()  # torch.autograd.grad would get None back for it, and .grad would get it
        if self._pending is not None and task != self._task:
            self._drop()  # a backward that raised before its end left buckets half full
        if self._pending is None:
            self._pending = [None] * len(self.buckets)
            self._task = task
            self._scatter_inputs = self.max_scatter_inputs = 0
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self.buckets[index]
        pending = self._pending[index]
        if pending is not None and pending.work is not None:
            # launched already: this gradient is another forward's (forward ran more than once
            # before this backward); it goes into a new round, reduced on its own
            self._rounds.append((index, pending))
            pending = self._pending[index] = _Pending(bucket, device)
            if bucket.kind == "reduce_scatter":
                self._scatter_inputs += 1
                self.max_scatter_inputs = max(self.max_scatter_inputs, self._scatter_inputs)
        if pending is None:
            flat, out = self._reusable(index, device)
            pending = self._pending[index] = _Pending(bucket, device, flat)
            pending.out = out
            if bucket.kind == "reduce_scatter":
                self._scatter_inputs += 1
                self.max_scatter_inputs = max(self.max_scatter_inputs, self._scatter_inputs)
        return pending

    def _slot_view(self, index: int, position: int, flat: torch.Tensor) -> torch.Tensor:
        slot = self.buckets[index].slots[position]
        start = self._offsets[index][position]
        if slot.kind == "reduce_scatter":
            # Rank-major layout: section r holds chunk r of every slot, so each slot's region is
            # strided across the sections; see ``_sections``.
            return self._sections(index, flat)[:, start // self._k(index) : (start + slot.numel) // self._k(index)]
        return flat[start : start + slot.numel]

    def _k(self, index: int) -> int:
        return collectives.group_size(self.buckets[index].groups[0])

    def _sections(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        k = self._k(index)
        return flat.view(k, flat.numel() // k)

    def _launch(self, index: int, pending: _Pending) -> None:
        bucket = self.buckets[index]
        for key in (slot.key for slot in bucket.slots if slot.key not in pending.written):
            position = self._where[key][1]
            self._slot_view(index, position, pending.flat).zero_()  # no use of it ran this time
            pending.written.add(key)
            pending.zeroed.add(key)
        if not self.sync and (index in self._held or self._holds(index)):
            held, kept = self._take_held(index)
            if held is not None:
                pending.flat.add_(held)
            self._held[index] = pending.flat  # its views become the .grad at the end of backward
            self._held_written[index] = kept
            pending.held = True
            return
        held, kept = self._take_held(index)
        if held is not None:  # the micro-steps held back by no_sync(), reduced with this one
            pending.flat.add_(held)
            pending.zeroed -= kept  # written by an earlier micro-step: its .grad gets the sum
        self.launches += 1
        group_name = bucket.groups[0]
        if bucket.kind == "all_reduce":
            pending.work = collectives.start_all_reduce(pending.flat, group_name)
        else:
            if pending.out is None:
                pending.out = torch.empty(
                    pending.flat.numel() // self._k(index), dtype=pending.flat.dtype, device=pending.flat.device
                )
            pending.work = collectives.start_reduce_scatter(pending.out, pending.flat, group_name)
        if bucket.kind == "reduce_scatter" or len(bucket.groups) > 1:
            previous, self._retiring = self._retiring, (index, pending)
            if previous is not None:
                self._retire(*previous)

    def _retire(self, index: int, pending: _Pending) -> None:
        """Wait for bucket ``index``'s round ``pending`` on its first group, as the next bucket
        launches: a reduce-scatter's input (the whole gradients) is freed; where the bucket has a
        second group, its result is summed over it behind the rest of backward (hybrid sharding's
        shard over the replicas; an all-reduce's second data-parallel axis). Further groups wait
        for the end of backward."""
        if pending.done:
            return
        bucket = self.buckets[index]
        groups = bucket.groups
        collectives.wait(pending.work, groups[0])
        pending.done = True
        if bucket.kind == "reduce_scatter":
            pending.flat = None
            self._scatter_inputs -= 1
        if len(groups) > 1:
            result = pending.flat if bucket.kind == "all_reduce" else pending.out
            pending.summed = (collectives.start_all_reduce(result, groups[1]), groups[1])

    def _reusable(self, index: int, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The last backward's buffers of bucket ``index`` if nothing else holds them any more
        (``zero_grad()`` dropped the ``.grad`` views, and no one kept a reference); else None,
        None: fresh buffers, so that a gradient still held is never overwritten."""
        spare = self._spare.get(index)
        if spare is None or not all(t.device == device and _unshared(t) for t in spare if t is not None):
            return None, None
        return spare

    def _drop(self) -> None:
        """Forget the buckets of an unfinished backward (waiting for what was launched)."""
        pending_all, self._pending = self._pending, None
        rounds, self._rounds = self._rounds, []
        self._retiring = None
        for index, pending in [*rounds, *enumerate(pending_all or ())]:
            if pending is not None and pending.held:
                self._show_held(index, pending)  # kept, as autograd keeps what an unfinished backward accumulated
            elif pending is not None and pending.work is not None and not pending.done:
                collectives.wait(pending.work, self.buckets[index].groups[0])
            if pending is not None and pending.summed is not None:
                collectives.wait(*pending.summed)

    def _finish(self) -> None:
        pending_all = [(index, pending) for index, pending in enumerate(self._pending or ()) if pending is not None]
        for index, pending in pending_all:
            if pending.work is None and not pending.held:
                self._launch(index, pending)
        pending_all = [*self._rounds, *pending_all]
        self._pending, self._retiring, self._rounds = None, None, []
        ready: list[torch.Tensor] = []  # parameters whose .grad this backward wrote: their hooks run last
        for index, pending in pending_all:
            if pending.held:
                ready.extend(self._show_held(index, pending))
                continue
            bucket = self.buckets[index]
            if not pending.done:
                collectives.wait(pending.work, bucket.groups[0])
            # A reduce-scatter's input (the whole gradients) is not kept, as FSDP2 frees it: kept
            # for reuse, it would hold every sharded parameter's gradient whole all step.
            self._spare[index] = (pending.flat if bucket.kind == "all_reduce" else None, pending.out)
            result = pending.flat if bucket.kind == "all_reduce" else pending.out
            further = bucket.groups[1:]
            if pending.summed is not None:  # launched when the bucket retired
                collectives.wait(*pending.summed)
                further = further[1:]
            for group_name in further:  # further mesh axes, one after another
                collectives.wait(collectives.start_all_reduce(result, group_name), group_name)
            at, handed = 0, []
            for slot in bucket.slots:
                numel = slot.numel if bucket.kind == "all_reduce" else slot.numel // self._k(index)
                shape = slot.shape if bucket.kind == "all_reduce" else _chunk_shape(slot.shape, slot.dim, self._k(index))
                if bucket.kind == "all_reduce":
                    reduced = result[at : at + numel].view(shape)
                else:
                    reduced = _from_dim0(result[at : at + numel], shape, slot.dim)
                    if slot.size >= 0:  # a padded shard: this rank's own rows of its padded chunk
                        reduced = _own_rows(reduced, slot.dim, slot.size, bucket.groups[0])
                at += numel
                # reduced in a policy's reduce_dtype: lands in the master's; a DTensor
                # parameter's gradient is a DTensor with its placements (ops.params)
                if slot.key not in pending.zeroed:
                    handed.append((self._params[slot.key], reduced))
            add_grads(handed)
            ready.extend(param for param, _ in handed)
        run_held_hooks(ready)

    def _show_held(self, index: int, pending: _Pending) -> list[torch.Tensor]:
        """The ``.grad`` of each parameter a held backward reached becomes its view of bucket
        ``index``'s held buffer (one that none reached keeps its None, as in eager); returns them."""
        held = self._held[index]
        written = self._held_written[index] = self._held_written.get(index, set()) | (pending.written - pending.zeroed)
        if not _step_hook:
            _step_hook.append(register_optimizer_step_pre_hook(_refuse_held_step))
        reached, shown = pending.written - pending.zeroed, []
        for position, slot in enumerate(self.buckets[index].slots):
            if slot.key not in written:
                continue
            param = self._params[slot.key]
            view = as_like(self._slot_view(index, position, held).view(slot.shape), param)
            param.grad = self._views[slot.key] = view
            _held_grads[id(view)] = weakref.ref(view)
            if slot.key in reached:
                shown.append(param)
        return shown


def _unshared(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the only tensor on its storage (no view of it is alive)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # the storage object made here holds one reference, ``tensor`` the other
    return use_count(tensor.untyped_storage()._cdata) <= 2


def _chunk_shape(shape: tuple[int, ...], dim: int, k: int) -> tuple[int, ...]:
    return tuple(s // k if d == dim else s for d, s in enumerate(shape))


def _own_rows(chunk: torch.Tensor, dim: int, size: int, group_name: str) -> torch.Tensor:
    """This rank's rows of its padded ``chunk`` of a dim of ``size`` (``ir.spec.piece_rows``)."""
    rows = piece_rows(size, collectives.group_size(group_name), collectives.group_rank(group_name))
    return chunk.narrow(dim, 0, rows)


def _rank_major(grad: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """(k, numel/k): row r is chunk r of ``grad`` along ``dim``, each chunk with ``dim`` moved
    first (so that a chunk is one contiguous block whatever ``dim`` is)."""
    moved = grad.movedim(dim, 0)
    return moved.reshape(k, -1)


def _from_dim0(flat: torch.Tensor, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """Undo ``_rank_major`` for one chunk: ``flat`` holds the chunk with ``dim`` first."""
    if dim == 0:
        return flat.view(shape)
    moved_shape = (shape[dim],) + tuple(s for d, s in enumerate(shape) if d != dim)
    return flat.view(moved_shape).movedim(0, dim).contiguous()


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


class _SyncGrads(torch.autograd.Function):
    """Identity in forward; backward hands each gradient that arrived to its bucket slot and
    returns none (the reduced gradient reaches ``.grad`` at the end of backward). A parameter that
    needs no gradient (frozen after compile), or whose output no gradient reached, adds nothing:
    its slot is reduced as zeros and its ``.grad`` stays None, as in eager."""

    @staticmethod
    def forward(ctx, buckets, keys, *params):
        ctx.buckets, ctx.keys = buckets, keys
        ctx.set_materialize_grads(False)
        outs = tuple(param.view_as(param) for param in params)
        if not all(map(_REQUIRES_GRAD, params)):  # the common case reads each flag once, in C
            # a frozen parameter's view needs no gradient either: nothing computes one for it
            ctx.mark_non_differentiable(*(out for out, param in zip(outs, params, strict=True) if not param.requires_grad))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        needs = ctx.needs_input_grad[2:]
        ctx.buckets.add_all(ctx.keys, [grad if need else None for grad, need in zip(grads, needs, strict=True)])
        return (None, None, *(None for _ in grads))


class ParamGathers(torch.nn.Module):
    """FSDP's forward: all-gather each sharded parameter before its use, the next ones ahead.

    ``order`` lists the gathered keys in forward order, each with its group, dim and the bytes of
    the whole tensor. ``groups`` splits ``order`` into consecutive runs of keys (one process
    group, one dtype) gathered by ONE collective, as FSDP2 gathers a ``fully_shard`` block:
    each rank's shards are copied into one flat buffer (each with its dim moved first), the flat
    buffers are all-gathered, and each whole parameter is copied out of the rank-major result.
    None: one group per key. At the first gather of a group, the next group is gathered ahead,
    and further ones while within ``prefetch_bytes`` (0: none ahead). The backward of a gather
    hands the whole gradient to ``GradBuckets`` (a reduce-scatter slot). ``reshard`` flags the
    groups freed after forward and gathered again in backward (module docstring; None: none),
    which needs the graph to run under ``saved_tensors_hooks()``.
    """

    def __init__(
        self,
        order: Sequence[tuple[str, str, int, int]],
        prefetch_bytes: int,
        grads: GradBuckets | None,
        groups: Sequence[Sequence[str]] | None = None,
        reshard: Sequence[bool] | None = None,
        sizes: Mapping[str, int] | None = None,
    ):
        super().__init__()
        self.order = list(order)
        # key -> the unpadded size of the gathered dim of a padded shard (``ir.spec.padded_axis``):
        # each rank's piece is padded to ``ceil(size / k)`` rows for the collective, and the
        # gathered tensor cut back to ``size``
        self.sizes = dict(sizes or {})
        self._index = {key: i for i, (key, _, _, _) in enumerate(self.order)}
        self.groups = [tuple(g) for g in groups] if groups is not None else [(key,) for key, _, _, _ in self.order]
        if [key for g in self.groups for key in g] != [key for key, _, _, _ in self.order]:
            raise AssertionError("gather groups must split the gather order into consecutive runs")
        for g in self.groups:
            if len({self.order[self._index[key]][1] for key in g}) != 1:
                raise AssertionError(f"gather group {g} spans process groups")
        self._group_of = {key: gi for gi, g in enumerate(self.groups) for key in g}
        self._group_bytes = [sum(self.order[self._index[key]][3] for key in g) for g in self.groups]
        self.prefetch_bytes = prefetch_bytes
        self.grads = grads
        self.reshard = list(reshard) if reshard is not None else [False] * len(self.groups)
        if len(self.reshard) != len(self.groups):
            raise AssertionError("one reshard flag per gather group")
        self._shards: dict[str, torch.Tensor] = {}
        self._inflight: dict[int, tuple[object, torch.Tensor, list[tuple[str, tuple[int, ...]]]]] = {}
        self._ready: dict[str, torch.Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        # The storage of each parameter gathered in this forward (data pointer -> weak reference
        # to the tensor owning it, key); of resharded groups, the saved tensors packed per group
        # and not unpacked yet, and the groups gathered again in backward (key -> owning tensor).
        self._roots: dict[int, tuple[weakref.ref, str]] = {}
        self._packed: dict[int, int] = {}
        self._regathered: dict[int, dict[str, torch.Tensor]] = {}
        self.num_backward_gathers = 0  # all-gathers of resharded groups in backward (tests, benchmarks)
        self._begun = False  # ``begin`` launched this forward's first gathers

    def cast_to(self, key: str, dtype: torch.dtype, stored: torch.dtype) -> None:
        """Gather ``key`` cast to ``dtype`` (a precision policy's ``param_dtype``: FSDP2 gathers
        the cast shards); its gradient slot keeps its own dtype. ``order`` gave its bytes in
        the ``stored`` dtype: the prefetch window counts them in ``dtype``, as they move."""
        self._dtypes[key] = dtype
        index = self._index[key]
        name, group, dim, nbytes = self.order[index]
        self.order[index] = (name, group, dim, nbytes // stored.itemsize * dtype.itemsize)
        gi = self._group_of[key]
        self._group_bytes[gi] = sum(self.order[self._index[other]][3] for other in self.groups[gi])

    def bind(self, shards: dict[str, torch.Tensor]) -> None:
        self._shards = {key: local_of(shard) for key, shard in shards.items()}

    def forward(self, shard: torch.Tensor, key: str) -> torch.Tensor:
        return _GatherParam.apply(shard, self, key)

    def start(self, gi: int, current: tuple[str, torch.Tensor] | None = None) -> None:
        """Launch the all-gather of group ``gi`` (``current``: a key's shard as the graph passed
        it; the others are the bound shards)."""
        if gi in self._inflight:
            return
        keys = self.groups[gi]
        group_name = self.order[self._index[keys[0]]][1]
        moved, layout = [], []
        for key in keys:
            shard = current[1] if current is not None and key == current[0] else self._shards.get(key)
            if shard is None:
                raise AssertionError(f"parameter gather group {keys} needs the shard of {key!r}: bind() the parameters")
            dim = self.order[self._index[key]][2]
            piece = shard.detach().to(self._dtypes.get(key, shard.dtype)).movedim(dim, 0)
            if key in self.sizes:
                piece = pad_piece(piece, 0, -(-self.sizes[key] // collectives.group_size(group_name)))
            moved.append(piece)
            layout.append((key, tuple(piece.shape)))
        if len({piece.dtype for piece in moved}) != 1:
            raise AssertionError(f"parameter gather group {keys} mixes dtypes")
        # copy-in: this rank's shards, one after another, in one flat buffer
        flat = torch.cat([piece.reshape(-1) for piece in moved]) if len(moved) > 1 else moved[0].contiguous().view(-1)
        k = collectives.group_size(group_name)
        out = torch.empty(k * flat.numel(), dtype=flat.dtype, device=flat.device)
        self._inflight[gi] = (collectives.start_all_gather(out, flat, group_name), out, layout)

    def _complete(self, gi: int) -> dict[str, torch.Tensor]:
        """Wait for group ``gi`` and copy each whole parameter out of the rank-major result;
        return them by key."""
        work, out, layout = self._inflight.pop(gi)
        group_name = self.order[self._index[layout[0][0]]][1]
        collectives.wait(work, group_name)
        k = collectives.group_size(group_name)
        rows = out.view(k, -1)  # row r: rank r's flat buffer
        at = 0
        wholes = {}
        for key, shape in layout:
            numel = math.prod(shape)
            # (k, numel) → (k * chunk rows, ...): a view when the group is one parameter, else a copy
            whole = rows[:, at : at + numel].reshape((k * shape[0],) + shape[1:])
            if key in self.sizes:  # a padded shard: the padding is at the end (torch.chunk's cut)
                whole = whole[: self.sizes[key]]
            dim = self.order[self._index[key]][2]
            wholes[key] = whole.movedim(0, dim) if dim else whole
            at += numel
        return wholes

    def _discard(self) -> None:
        """Wait for and drop gathers still in flight or not yet used: a forward cut short (or a
        recompute in backward) may leave some, and they hold values from before the optimizer step.
        Also forget the last forward's packed parameters: a backward that still unpacks one
        gathers its group again."""
        for work, _, layout in self._inflight.values():
            collectives.wait(work, self.order[self._index[layout[0][0]]][1])
        self._inflight.clear()
        self._ready.clear()
        self._roots.clear()
        self._packed.clear()
        self._regathered.clear()

    # -- reshard after forward ------------------------------------------------------------

    @contextlib.contextmanager
    def saved_tensors_hooks(self) -> Iterator[None]:
        """Run the graph's forward under this: it launches the first groups' gathers at once
        (``begin``), and frees resharded groups after forward (class docstring)."""
        self.begin()
        try:
            if not any(self.reshard):
                yield
                return
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._begun = False

    def begin(self) -> None:
        """A forward starts: drop what the last one left and launch the first group's gather
        (and the groups ahead within ``prefetch_bytes``) now, as FSDP2 unshards its root at the
        start of forward, so that it overlaps what the graph runs before the first gathered use
        (an embedding's own collectives, say) instead of waiting there. Its first ``gather``
        then finds them in flight."""
        if torch._C._current_graph_task_id() != -1 or not self.groups:  # a recompute in backward
            return
        self._discard()
        if all(key in self._shards for key in self.groups[0]):
            self._start_from(0)
            self._begun = True

    def _pack(self, tensor: torch.Tensor) -> object:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (a tensor subclass)
            return tensor
        found = self._roots.get(storage.data_ptr()) if storage.nbytes() else None
        if found is None:
            return tensor
        root = found[0]()
        # While the owner is alive no other storage can start at its address: the tensor views it.
        if root is None or root.untyped_storage().data_ptr() != storage.data_ptr() or root.dtype != tensor.dtype:
            return tensor
        key = found[1]
        gi = self._group_of[key]
        if not self.reshard[gi]:
            return tensor
        self._packed[gi] = self._packed.get(gi, 0) + 1
        return _Packed(gi, key, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())

    def _unpack(self, packed: object) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        gi = packed.group
        roots = self._regathered.get(gi)
        if roots is None:
            self._start_again(gi)
            if self.prefetch_bytes > 0:  # the group backward needs next: the last earlier one still packed
                waiting = [g for g in range(gi) if self._packed.get(g, 0) > 0 and g not in self._regathered]
                if waiting:
                    self._start_again(waiting[-1])
            roots = self._regathered[gi] = {key: _owner(whole) for key, whole in self._complete(gi).items()}
        tensor = roots[packed.key].as_strided(packed.shape, packed.stride, packed.offset)
        self._packed[gi] = self._packed.get(gi, 0) - 1
        if self._packed[gi] <= 0:  # the group's last saved tensor: backward holds the rest
            self._packed.pop(gi)
            self._regathered.pop(gi)
        return tensor

    def _start_again(self, gi: int) -> None:
        if gi not in self._inflight:
            self.start(gi)
            self.num_backward_gathers += 1

    def live_gathered(self) -> list[str]:
        """The keys of the parameters gathered by the last forward whose gathered storage is
        still alive (after forward: the groups not resharded)."""
        return sorted(key for ref, key in self._roots.values() if ref() is not None)

    def gather(self, key: str, shard: torch.Tensor) -> torch.Tensor:
        index = self._index[key]
        in_backward = torch._C._current_graph_task_id() != -1  # a checkpoint's recompute
        if index == 0 and not in_backward:
            if self._begun:  # launched by ``begin`` with the bound shards: the same storage
                self._begun = False
            else:
                self._discard()
        if key not in self._ready:
            gi = self._group_of[key]
            if in_backward:
                self.start(gi, (key, shard))
            else:
                self._start_from(gi, (key, shard))
            wholes = self._complete(gi)
            if not in_backward:
                for gathered_key, whole in wholes.items():
                    root = _owner(whole)
                    self._roots[root.untyped_storage().data_ptr()] = (weakref.ref(root), gathered_key)
            self._ready.update(wholes)
        return self._ready.pop(key)

    def _start_from(self, gi: int, current: tuple[str, torch.Tensor] | None = None) -> None:
        """Launch group ``gi``'s gather and the prefetch ahead of it: the next group always,
        further ones while within ``prefetch_bytes`` (none with 0)."""
        self.start(gi, current)
        ahead = 0
        for next_gi in range(gi + 1, len(self.groups)) if self.prefetch_bytes > 0 else ():
            nbytes = self._group_bytes[next_gi]
            if next_gi > gi + 1 and ahead + nbytes > self.prefetch_bytes:
                break
            if all(other in self._shards for other in self.groups[next_gi]):
                self.start(next_gi)
            ahead += nbytes


@dataclass(frozen=True, slots=True)
class _Packed:
    """A saved view of a resharded gathered parameter: which, and its layout on the storage."""

    group: int
    key: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _owner(whole: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds a gathered parameter (the all-gather's output when the
    parameter is a view of it), laid out the same way each time the group is gathered."""
    return whole._base if whole._base is not None else whole


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, gathers, key):
        ctx.gathers, ctx.key, ctx.dtype = gathers, key, shard.dtype
        return gathers.gather(key, shard)

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.gathers.grads
        if grads is not None and grads.has(ctx.key):
            grads.add(ctx.key, grad)
            return None, None, None
        # The gradient is whole on every rank (the computation was not split): keep the chunk.
        _, group_name, dim, _ = ctx.gathers.order[ctx.gathers._index[ctx.key]]
        k, rank = collectives.group_size(group_name), collectives.group_rank(group_name)
        return chunk_piece(grad, dim, k, rank).to(ctx.dtype).contiguous(), None, None
