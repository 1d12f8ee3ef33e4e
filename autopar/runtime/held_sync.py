"""The held parameters' gradient syncs of a pipelined step, run behind the backward that remains.

A pipeline holds each parameter's chain of casts and collectives once a step (``passes.held``):
every microbatch reads one detached leaf, whose gradient sums theirs. A leaf's sum is final once
each stage of this rank that reads it has run the backward of the step's last microbatch
(torch's schedules say which backward is a stage's last: ``last_backward``, where DDP and FSDP
stages under torch's pipelining start their own reductions). ``HeldReducer`` starts each leaf's
reduction then, asynchronously, so that it runs while the rank computes the rest of the step:

* in that last backward itself, as autograd accumulates the leaf's final gradient (a leaf is
  accumulated once per backward call: one autograd graph, recomputed segments included), the
  all-reduces in buckets of ``HELD_BUCKET_BYTES`` per group and dtype, as DDP's reducer fills its
  buckets in backward order; a gather's reduce-scatter on its own, as FSDP2's;
* what is left (a bucket with a gradient that did not come: a parameter this step did not use)
  when the stage's last backward returns: before the backward of the stage that follows it on
  this rank, which it then overlaps (interleaved schedules hold several stages a rank);
* anything else (a chain whose backward does more than reduce, through autograd) at ``finish``,
  which waits for every reduction and adds each result into its parameter's ``.grad`` in the
  reduce dtype's sum (one rounding fewer than a backward through the chain under a precision
  policy, which takes the value's dtype).

A leaf accumulated again after its reduction started would be a sum missing a part: the hook
raises instead (``InternalError``). The stage planner prices the same overlap
(``solver.pricing.schedules``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch.distributed.pipelining import PipelineStage

from autopar.cost import comm
from autopar.errors import InternalError
from autopar.ops import collectives
from autopar.ops.params import add_grad
from autopar.passes.held import DirectSync

# Bytes of summed gradients all-reduced by one collective (as DDP's buckets, beside which the
# chains' own backward would run one collective a parameter), as the stage planner prices them.
HELD_BUCKET_BYTES = comm.HELD_BUCKET_BYTES


class Held(NamedTuple):
    """One held chain's step: its value (with the chain's graph), the leaf the microbatches read,
    its parameter, and its reduction where that is all its backward does (``passes.held.direct_sync``)."""

    value: torch.Tensor
    leaf: torch.Tensor
    param: torch.Tensor
    sync: DirectSync | None


def _summed(leaf: torch.Tensor) -> torch.Tensor | None:
    """The leaf's gradient, summed over the step's microbatches (in the parameter's dtype where a
    cast's: ``sum_in``), taken off the leaf."""
    grad = getattr(leaf, "summed", None)
    grad = leaf.grad if grad is None else grad
    leaf.grad = leaf.summed = None
    return grad


def sum_in(leaf: torch.Tensor, dtype: torch.dtype) -> None:
    """Sum the microbatches' gradients of ``leaf`` (a cast parameter's) in ``dtype``, the
    parameter's own, as FSDP2 accumulates unsharded gradients in its reduce dtype: each
    accumulated gradient moves into ``leaf.summed``."""

    def move(tensor: torch.Tensor) -> None:
        grad = tensor.grad.to(dtype)
        tensor.grad = None
        summed = getattr(tensor, "summed", None)
        tensor.summed = grad if summed is None else summed.add_(grad)

    leaf.register_post_accumulate_grad_hook(move)


class _Pending(NamedTuple):
    """A started reduction: its work, and what to hand each parameter once it is waited for."""

    work: Any
    group: str
    finish: Any  # () → [(param, local gradient)]


class _Bucket:
    """Summed gradients all-reduced together: the same groups, dtype and reading stages; filled
    in the reverse of the order the chains were made (backward's), fixed before the step, so
    that every rank of the stage mesh puts the same gradients in it whatever order they arrive in."""

    def __init__(self, key: tuple):
        self.key, self.names, self.size = key, [], 0
        self.grads: dict[str, torch.Tensor | None] = {}


class HeldReducer:
    """The reductions of one step's held leaves (module docstring). ``made``: name → ``Held``;
    ``readers``: name → the stage modules of this rank that read it."""

    def __init__(self, made: dict[str, Held], readers: dict[str, list[Any]]):
        self._made = made
        self._waiting = {name: {id(m) for m in readers.get(name, ())} for name in made}
        self._started: set[str] = set()
        self._queues: dict[tuple, list[_Bucket]] = {}  # per key, the buckets not yet started, in order
        self._bucket_of: dict[str, _Bucket] = {}
        self._pending: list[_Pending] = []
        self._later: list[str] = []  # chains whose backward does more than reduce
        self.final: Any = None  # the stage module running its last backward, if one is
        for name in reversed(list(made)):
            held = made[name]
            if held.sync is None or held.sync.kind != "all_reduce":
                continue
            key = (held.sync.groups, held.sync.dtype or held.param.dtype, frozenset(self._waiting[name]))
            queue = self._queues.setdefault(key, [])
            nbytes = held.leaf.numel() * key[1].itemsize
            if not queue or (queue[-1].names and queue[-1].size + nbytes > HELD_BUCKET_BYTES):
                queue.append(_Bucket(key))
            queue[-1].names.append(name)
            queue[-1].size += nbytes
            self._bucket_of[name] = queue[-1]
        for name, held in made.items():
            if held.leaf.requires_grad:
                held.leaf.register_post_accumulate_grad_hook(lambda _, name=name: self._accumulated(name))

    def _accumulated(self, name: str) -> None:
        if name in self._started:
            raise InternalError(
                f"the held value {name!r} got a gradient after its sync started: its sum would miss a part. "
                "This is a bug in autopar: please report it with the plan JSON (plan.save(path))"
            )
        waiting = self._waiting[name]
        if self.final is not None and id(self.final) in waiting:
            waiting.discard(id(self.final))
            if not waiting:
                self._start([name])

    def stage_done(self, stage: Any) -> None:
        """``stage`` ran its last backward of the step: start what that completed."""
        ready = []
        for name, waiting in self._waiting.items():
            if id(stage) in waiting:
                waiting.discard(id(stage))
                if not waiting and name not in self._started:
                    ready.append(name)
        self._start(ready)

    def finish(self) -> None:
        """Start what is left, wait for every reduction, and add the results into ``.grad``."""
        self._start([name for name in self._made if name not in self._started])
        for name in self._later:
            held = self._made[name]
            grad = _summed(held.leaf)
            if grad is not None:
                torch.autograd.backward(held.value, grad.to(held.value.dtype))
        for pending in self._pending:
            collectives.wait(pending.work, pending.group)
            for param, local in pending.finish():
                add_grad(param, local)
        self._pending = []

    def _start(self, names: Iterable[str]) -> None:
        for name in names:
            self._started.add(name)
            held = self._made[name]
            if name in self._bucket_of:
                self._bucket_of[name].grads[name] = _summed(held.leaf)
            elif held.sync is None:
                self._later.append(name)
            else:
                grad = _summed(held.leaf)
                if grad is not None:
                    self._scatter(held.param, grad.to(held.sync.dtype or grad.dtype), held.sync.steps)
        for queue in self._queues.values():
            while queue and len(queue[0].grads) == len(queue[0].names):
                self._all_reduce(queue.pop(0))

    def _all_reduce(self, bucket: _Bucket) -> None:
        groups, dtype, _ = bucket.key
        pairs = [(self._made[name].param, grad) for name, grad in bucket.grads.items() if grad is not None]
        if not pairs:
            return
        flat = torch.cat([grad.reshape(-1).to(dtype) for _, grad in pairs])
        for group in groups[1:]:  # a second data-parallel axis: summed first
            flat = collectives.no_grad_all_reduce(flat, group)

        def finish() -> list[tuple[torch.Tensor, torch.Tensor]]:
            out, at = [], 0
            for param, grad in pairs:  # a .grad set here is a view of the bucket, as DDP's are
                out.append((param, flat[at : at + grad.numel()].view(grad.shape)))
                at += grad.numel()
            return out

        self._pending.append(_Pending(collectives.start_all_reduce(flat, groups[0]), groups[0], finish))

    def _scatter(self, param: torch.Tensor, grad: torch.Tensor, steps: tuple[tuple, ...]) -> None:
        """A gather chain's backward (``DirectSync.steps``): the steps before its last run now,
        the last (a reduce-scatter where it divides evenly) started."""
        *before, last = steps
        grad = _scatter_steps(grad, tuple(before))
        kind, group, *rest = last
        if kind != "reduce_scatter" or grad.shape[rest[0]] % collectives.group_size(group):
            local = _scatter_steps(grad, (last,))
            self._pending.append(_Pending(None, group, lambda: [(param, local)]))
            return
        work, out = collectives.start_reduce_scatter_along(grad, rest[0], group)
        self._pending.append(_Pending(work, group, lambda: [(param, out)]))


def _scatter_steps(grad: torch.Tensor, steps: tuple[tuple, ...]) -> torch.Tensor:
    """``grad`` through ``steps`` (``DirectSync.steps``), outside autograd."""
    for kind, group, *rest in steps:
        if kind == "reduce_scatter":
            grad = collectives.no_grad_reduce_scatter(grad, rest[0], group)
        elif kind == "chunk":
            grad = collectives.no_grad_chunk(grad, rest[0], group, rest[1])
        else:
            grad = collectives.no_grad_all_reduce(grad, group)
    return grad


class HeldSyncStage(PipelineStage):
    """torch's ``PipelineStage`` that tells the step's ``HeldReducer`` (``submod.reducer``) when
    it runs its last backward of the step (``last_backward``, where torch starts a DDP or FSDP
    stage's reductions)."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, *args: Any, **kwargs: Any):
        reducer = getattr(self.submod, "reducer", None)
        last_backward = kwargs.get("last_backward", args[0] if args else False)
        if reducer is None or not last_backward:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, *args, **kwargs)
        reducer.final = self.submod
        try:
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, *args, **kwargs)
        finally:
            reducer.final = None
        reducer.stage_done(self.submod)
        return result
