"""Differentiable collectives under the replicated-loss convention.

Every rank computes the same, whole loss. Each local tensor's gradient is then held in the *dual*
placement of the tensor: a Shard(d) tensor's gradient is the same shard of the true gradient,
and a Replicate or Partial tensor's gradient is the whole true gradient on every rank.

Each forward collective below therefore has the dual backward, not the adjoint that the stock
differentiable functional collectives use (those assume each rank holds a partial loss, as in
DDP, and on torch 2.13 gave gradients ``world_size`` times too large under our convention):

==================  ==================  ==========================================
forward             placements          backward
==================  ==================  ==========================================
``all_reduce``      P → R               identity
``reduce_scatter``  P → S(d)            all-gather along d
``all_gather``      S(d) → R            keep the local chunk along d
``chunk``           R → S(d)            all-gather along d
``all_to_all``      S(a) → S(b)         all-to-all S(b) → S(a)
``all_gather``,     S(d)/n ↔ R          as above, with ``blocks=n``: every rank holds
``chunk`` (strided)                     chunk r of each of n blocks (``spec.SS``)
``allreduce_grad``  R → R (identity)    all-reduce: used where an R input feeds a
                                        computation that is split on that axis, whose
                                        local input gradient is a partial sum
``move_pieces``     a permutation of    the inverse permutation (no sums: every
                    equal pieces        element has one owner before and after)
``all_to_all_rows`` rows → other ranks  the reverse exchange (its exact adjoint: the
                    (uneven splits)     rows are each rank's own, not replicated)
==================  ==================  ==========================================

Each function takes the process group by *name* (``group.group_name``) so that FX code generation
can print it; ``print(pm.graph)`` then shows every collective the module runs. The work itself is
done by ``torch.distributed._functional_collectives``.

**Traceable.** Under ``torch.compile`` (``autopar.compile(..., compiler="inductor")``, or a user's
``torch.compile`` of such a module) dynamo traces these autograd.Functions, forward and backward:
their bodies call only functional collectives (``torch.ops._c10d_functional.*`` with
``wait_tensor``), which AOTAutograd keeps as graph nodes that inductor buckets and reorders. A
group's size, rank and backend come from ``remember_groups`` (filled eagerly at compile), so that
nothing resolves a process group while tracing. The asynchronous ``start_*`` helpers of the eager
schedule (``ops.buckets``) are not traced: the compiled mode schedules in the graph instead.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx.traceback
import torch.utils.checkpoint
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.errors import CollectiveError, InternalError, UsageError
from autopar.ir.spec import strided_piece, unstride

_T = TypeVar("_T")
_PEER_KEY = "autopar/peer/{}"
_FAILED_KEY = "autopar/failed/{}"  # this rank's diagnosis, once a collective of its own failed


def register_peer() -> None:
    """Record this rank's host and pid in the default store, so that after a failed collective
    the survivors can say which rank died (``_diagnose``)."""
    store = dist.distributed_c10d._get_default_store()
    store.set(_PEER_KEY.format(dist.get_rank()), f"{socket.gethostname()}:{os.getpid()}")
    if store.check([_FAILED_KEY.format(dist.get_rank())]):  # from an earlier job of this process
        store.delete_key(_FAILED_KEY.format(dist.get_rank()))


# What gloo and NCCL say when the other end of a connection went away: a peer failed, not a timeout.
_PEER_CLOSED = (
    "closed by peer",
    "reset by peer",
    "connection closed",
    "broken pipe",
    "connection refused",
    "end of file",
    "remote process exited",
)


_EXIT_GRACE_S = 3.0


def _diagnose(ranks: list[int], error: BaseException | None = None) -> str:
    """Which rank is gone, as far as this host can tell.

    Every rank of the world is looked at, not only ``ranks`` (the failed collective's group): a
    rank whose group lost a peer fails, exits, and so fails the collectives of its other groups,
    whose ranks would otherwise blame it. A rank that failed this way recorded its own diagnosis
    in the store (``_record_failure``) before exiting; the rank to name is the one that is gone
    without such a record."""
    closed = error is not None and any(text in str(error).lower() for text in _PEER_CLOSED)
    # A peer's sockets close while its process is still exiting: after "closed by peer", give
    # the process a moment to end before saying that no rank died.
    deadline = time.monotonic() + (_EXIT_GRACE_S if closed else 0.0)
    while True:
        try:
            dead, absent, failed, elsewhere = _scan()
        except Exception as error:  # the store may have died with the rank that hosted it
            return f"could not tell which rank failed ({type(error).__name__}: {error})"
        if any(rank not in failed for rank in dead) or absent or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    first = [rank for rank in dead if rank not in failed]
    if first:
        return f"rank {', '.join(map(str, first))} is no longer running"
    if absent:
        return f"rank {', '.join(map(str, absent))} never reached autopar.compile (it failed or was killed before)"
    # Every rank that is gone failed after another (or the dead one runs on another host): repeat
    # what a rank that failed before this one found, where it named a rank.
    found = [(rank, text) for rank, text in failed.items() if rank != dist.get_rank() and "is no longer running" in text]
    if found:
        rank, text = found[0]
        return f"{text.split(' (as rank ')[0]} (as rank {rank} found)"
    unknown = [rank for rank in elsewhere if rank in ranks]
    if unknown:
        return f"no rank on this host died; ranks {unknown} run on other hosts" + (
            ", and a peer closed its connection: one of them failed" if closed else ""
        )
    if closed:
        return (
            "a peer closed its connection: a rank of the group failed or exited (its process may "
            "not have ended yet), not a timeout"
        )
    return "every rank of the group is still running: one of them did not answer within the timeout"


def _scan() -> tuple[list[int], list[int], dict[int, str], list[int]]:
    """(dead ranks on this host, ranks never registered, rank -> recorded diagnosis, ranks on other hosts)."""
    dead, absent, failed, elsewhere = [], [], {}, []
    store = dist.distributed_c10d._get_default_store()
    here = socket.gethostname()
    for rank in range(dist.get_world_size()):
        if store.check([_FAILED_KEY.format(rank)]):
            failed[rank] = store.get(_FAILED_KEY.format(rank)).decode()
        key = _PEER_KEY.format(rank)
        if not store.check([key]):
            absent.append(rank)
            continue
        host, pid = store.get(key).decode().rsplit(":", 1)
        if host != here:
            elsewhere.append(rank)
        elif not _running(int(pid)):
            dead.append(rank)
    return dead, absent, failed, elsewhere


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs here (a zombie, killed but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _record_failure(diagnosis: str) -> None:
    """Tell the other ranks that this one failed after a peer, not first (``_diagnose``)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([_FAILED_KEY.format(dist.get_rank())]):
            store.set(_FAILED_KEY.format(dist.get_rank()), diagnosis)
    except Exception:  # noqa: BLE001 - the store may be gone; the error itself still goes out
        pass


def _collective_error(kind: str, group_name: str, error: BaseException) -> CollectiveError:
    try:
        ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
    except Exception:
        ranks = []
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    diagnosis = _diagnose(ranks, error)
    _record_failure(diagnosis)
    return CollectiveError(
        f"{kind} over ranks {ranks} failed on rank {dist.get_rank()}: {diagnosis}.\n"
        f"  {type(error).__name__}: {first}\n"
        "  This step cannot finish; restart the job (torchrun --max-restarts, or from a checkpoint)."
    )


_before = threading.local()  # .hook: run once before this thread's next eager collective


def before_next_collective(hook: Callable[[], None] | None) -> None:
    """Run ``hook`` once, before the next eager collective of this thread (None: drop the one
    set). ``runtime.data`` waits for a call's data check there, not before the call's compute.
    A hook with a ``ride(x, group_name)`` method is offered the next collective where it is an
    all-reduce of a few numbers (``runtime.data``: the data check carries them in its own
    all-gather); where it returns their sum, the all-reduce is not run."""
    _before.hook = hook


def _guarded(kind: str, rides: bool = False) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Turn a failed collective into a CollectiveError that names the group and the dead rank.
    The wrapped function takes the group name as its last positional argument; ``rides``: it
    is an all-reduce whose first argument the hook may sum itself (``before_next_collective``)."""

    def wrap(fn: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(fn)
        def run(*args, **kwargs) -> _T:
            if torch.compiler.is_compiling():  # traced: the compiled graph runs the collective
                return fn(*args, **kwargs)
            hook = getattr(_before, "hook", None)
            if hook is not None:
                _before.hook = None
                ride = getattr(hook, "ride", None) if rides else None
                if ride is None:
                    hook()
                else:
                    summed = ride(args[0], args[-1])
                    if summed is not None:
                        return summed
            try:
                return fn(*args, **kwargs)
            except CollectiveError:
                raise
            except (RuntimeError, dist.DistError) as error:
                raise _collective_error(kind, args[-1], error) from error

        return run

    return wrap


def call_on_world(kind: str, fn: Callable[..., _T], *args, **kwargs) -> _T:
    """Run an object collective on the default group (plan broadcast, hash check) with the same
    diagnosis as the tensor collectives when a rank is missing."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as error:
        raise _collective_error(kind, dist.group.WORLD.group_name, error) from error


# Words of a failed collective's error, where the failure surfaces from a compiled graph's code
# rather than from one of the guarded functions above: a lost peer, or a timeout.
_COLLECTIVE_FAILED = _PEER_CLOSED + ("gloo", "nccl", "timed out")


def compiled_graph_error(part: str, error: BaseException) -> CollectiveError | None:
    """The diagnosis of ``error``, raised while a compiled graph's ``part`` ran ("forward"),
    where it is a failed collective (a ``DistError``, or a RuntimeError in gloo's or NCCL's
    words for a lost peer or a timeout): its functional collectives run inside inductor's
    code, outside ``_guarded``. None for any other error, which the caller lets pass as it is."""
    if isinstance(error, (CollectiveError, torch._dynamo.exc.TorchDynamoException)):  # compiling failed: not a peer
        return None
    worded = isinstance(error, RuntimeError) and any(text in str(error).lower() for text in _COLLECTIVE_FAILED)
    if not (worded or isinstance(error, dist.DistError)):
        return None
    return _collective_error(f"a collective of the compiled {part}", dist.group.WORLD.group_name, error)


# group name -> (size, this rank's index, backend): read while tracing, where resolving a process
# group would break dynamo's graph.
_GROUPS: dict[str, tuple[int, int, str]] = {}


def remember_groups(group_names) -> None:
    """Record the size, rank and backend of each group (eagerly, before anything is traced)."""
    for name in group_names:
        group = _resolve_process_group(name)
        _GROUPS[name] = (group.size(), group.rank(), dist.get_backend(group))


def _group(group_name: str) -> tuple[int, int, str]:
    """Outside tracing the group is resolved on every call: the cache holds one rank per name, and
    the numerics guard runs several ranks (and worlds reusing names) as threads of one process."""
    if not torch.compiler.is_compiling():
        group = _resolve_process_group(group_name)
        return group.size(), group.rank(), dist.get_backend(group)
    info = _GROUPS.get(group_name)
    if info is None:
        remember_groups([group_name])
        info = _GROUPS[group_name]
    return info


def group_size(group_name: str) -> int:
    return _group(group_name)[0]


def group_rank(group_name: str) -> int:
    return _group(group_name)[1]


def group_ranks(group_name: str) -> list[int]:
    """The global ranks of the group, in group order (eagerly)."""
    return dist.get_process_group_ranks(_resolve_process_group(group_name))


def _waited(x: torch.Tensor) -> torch.Tensor:
    """A functional collective's result, waited on: eagerly it is an ``AsyncCollectiveTensor``;
    where traced, funcol has already put the ``wait_tensor`` in the graph (a second one would
    be one more call per collective in inductor's code)."""
    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


@_guarded("all-reduce", rides=True)
def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _waited(funcol.all_reduce(x.contiguous(), "sum", group_name))


# torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to *_single; older torch has only
# the old names.
_gather_along = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_scatter_along = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


@_guarded("all-gather")
def _all_gather(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    return _waited(_gather_along(x.contiguous(), dim, group_name))


@_guarded("reduce-scatter")
def _reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    k = group_size(group_name)
    if _sums_exchanged(group_name) and x.shape[dim] % k == 0:
        received = _exchange_now(_pieces(x, dim, k), group_name)
        return received.sum(0).view(x.chunk(k, dim)[0].shape)
    return _waited(_scatter_along(x.contiguous(), "sum", dim, group_name))


# gloo's own reduce-scatter took 1.6-2.1 times as long as one all-to-all followed by a local sum
# of the pieces received, and longer than an all-reduce of the same tensor (16 MiB on 2 and 4
# ranks of a 2-core machine: benchmarks/bench_gloo_collectives.py and its README section). Both send
# (k-1)/k of the input, as ``cost.comm`` prices a reduce-scatter; the exchange holds one more
# buffer of the input's size until the sum (priced by ``cost.liveness`` where the cluster's
# collectives are gloo's). NCCL keeps its own.
def _sums_exchanged(group_name: str) -> bool:
    """Whether reduce-scatters on the group run as an all-to-all and a local sum (gloo). Where
    traced they stay reduce-scatters, which inductor buckets; the compiled mode's bucketing pass
    then makes each bucket the same all-to-all and sum (``passes.inductor_comm``)."""
    return _group(group_name)[2] == "gloo" and not torch.compiler.is_compiling()


def _exchange_now(pieces: torch.Tensor, group_name: str) -> torch.Tensor:
    """Send row j of ``pieces`` (k rows) to rank j; the rows received, in rank order."""
    return _waited(funcol.all_to_all_single(pieces.contiguous(), None, None, group_name))


def _exchange(pieces: torch.Tensor, group, async_op: bool = False) -> tuple[torch.Tensor, object]:
    """Send row j of ``pieces`` (k rows) to rank j; (the rows received, in rank order, and the
    work: None unless ``async_op``)."""
    received = torch.empty_like(pieces)
    return received, dist.all_to_all_single(received, pieces, group=group, async_op=async_op)


def _pieces(x: torch.Tensor, dim: int, k: int) -> torch.Tensor:
    """``x`` as (k, n): row j is chunk j along ``dim``, contiguous (what rank j is sent)."""
    if dim == 0:
        return x.contiguous().view(k, -1)
    return torch.stack(x.chunk(k, dim)).view(k, -1)


class _SumOnWait:
    """The work of a reduce-scatter run as an all-to-all: ``wait`` waits for the exchange and sums
    the k pieces received into ``out``."""

    __slots__ = ("_work", "_received", "_out")

    def __init__(self, work, received: torch.Tensor, out: torch.Tensor):
        self._work, self._received, self._out = work, received, out

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait()
            torch.sum(self._received, 0, out=self._out.view(-1))
            self._work = self._received = None
        return True


# Asynchronous collectives on whole flat buffers, for the scheduled parameter communication
# (``autopar.buckets``): each returns the work handle to wait on. The names say what they run,
# so that byte counters can wrap them like the functions above.
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@_guarded("all-reduce (gradient bucket)")
def start_all_reduce(x: torch.Tensor, group_name: str):
    """Sum ``x`` in place over the group; returns the work handle."""
    return dist.all_reduce(x, group=_resolve_process_group(group_name), async_op=True)


@_guarded("all-reduce")
def start_sum(x: torch.Tensor, group_name: str):
    """Sum ``x`` (no gradient) in place over the group; returns the work handle (None where
    traced: the sum is done, and the compiler places its wait)."""
    if torch.compiler.is_compiling():
        x.copy_(_all_reduce(x, group_name))
        return None
    return dist.all_reduce(x, group=_resolve_process_group(group_name), async_op=True)


@_guarded("reduce-scatter (gradient bucket)")
def start_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group_name: str):
    """``out`` = chunk ``rank`` (along dim 0) of the sum of ``x`` over the group; returns the work
    (on gloo an all-to-all whose ``wait`` sums what it received: ``_sums_exchanged``)."""
    group = _resolve_process_group(group_name)
    if _sums_exchanged(group_name):
        received, work = _exchange(x.view(group.size(), -1), group, async_op=True)
        return _SumOnWait(work, received, out)
    return _reduce_scatter_into(out, x, group=group, async_op=True)


def start_reduce_scatter_along(x: torch.Tensor, dim: int, group_name: str):
    """(work, out): ``out`` = chunk ``rank`` along ``dim`` of the sum of ``x`` over the group
    once the work is waited for (``dim``'s size divisible by the group's)."""
    k = group_size(group_name)
    out = torch.empty(x.chunk(k, dim)[0].shape, dtype=x.dtype, device=x.device)
    return start_reduce_scatter(out, _pieces(x, dim, k).view(-1), group_name), out


@_guarded("all-gather (parameter)")
def start_all_gather(out: torch.Tensor, x: torch.Tensor, group_name: str):
    """``out`` = every rank's ``x`` concatenated along dim 0; returns the work."""
    return _all_gather_into(out, x, group=_resolve_process_group(group_name), async_op=True)


@_guarded("wait")
def wait(work, group_name: str) -> None:
    if work is not None:
        work.wait()


def _chunk(x: torch.Tensor, dim: int, group_name: str, blocks: int = 1) -> torch.Tensor:
    size, rank, _ = _group(group_name)
    if blocks > 1:
        return strided_piece(x, dim, size, rank, blocks)
    return x.chunk(size, dim)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, group_name: str, blocks: int = 1) -> torch.Tensor:
    full = _all_gather(x, dim, group_name)
    if blocks > 1:
        full = unstride(full, dim, group_size(group_name), blocks)
    return full


def refuse_double_backward(grad: torch.Tensor, saves_inputs: bool = False) -> None:
    """Refuse a backward under ``create_graph=True`` whose result needs a graph of its own (a
    gradient penalty: ``torch.autograd.grad(out, x, create_graph=True)``, whose input gradient
    depends on the weights; ``saves_inputs``: a kernel whose backward reads what its forward saw,
    detached). The collective would run on it as a plain tensor, and the second backward would miss
    what the ranks must exchange (the gradients a split computation gives a weight held whole):
    wrong weight gradients, without a word. Probed before this refusal: an FSDP plan 0.41 off
    eager's gradients, a Megatron-style one 0.34."""
    if torch.is_grad_enabled() and (saves_inputs or grad.requires_grad):
        raise UsageError(
            "a gradient of a gradient (torch.autograd.grad(..., create_graph=True), as a gradient penalty takes) "
            "goes through this plan's communication, which the second backward cannot follow: it would get "
            "wrong weight gradients. Compute it where no rank exchanges anything: a plan that keeps the whole "
            "batch and every weight on each rank (autopar.hand_plan('ddp', ...) where it splits no batch, or a "
            "mesh of 1), or the penalty outside the compiled module"
        )


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name):
        return _all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        return grad, None


def refuse_per_rank_penalty(how: str) -> None:
    """Refuse a backward with ``create_graph=True`` through an output of a ``batch="per_rank"``
    call that ``how``, where ``_RowsInput`` cannot keep the second backward DDP's: it would sum
    the ranks' gradients."""
    if torch.is_grad_enabled():
        raise UsageError(
            "a gradient of a gradient (torch.autograd.grad(..., create_graph=True)) through an output that "
            f"{how} (batch='per_rank'): its second backward would sum the ranks' gradients where DDP averages "
            "them. A gradient penalty at the inputs runs where the output is each rank's rows and the input "
            "requires grad; otherwise compile with batch='whole' (every rank passes the whole batch), or compute "
            "it outside the compiled module"
        )


class _MeanGrad(torch.autograd.Function):
    """Identity in forward; backward averages the gradient over ``group_name``'s ranks
    (``mean_grad``)."""

    @staticmethod
    def forward(ctx, x, group_name):
        ctx.group_name = group_name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        refuse_per_rank_penalty("comes back whole, which each rank may take its own rows of")
        return _all_reduce(grad, ctx.group_name) / group_size(ctx.group_name), None


def mean_grad(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x``, whose gradient is averaged over the ranks of ``group_name`` in backward: where each
    rank computes its own loss from a tensor that every rank holds whole (a DDP script's loss on
    its own rows of the outputs), the step is the mean of those losses', as DDP's is; the same
    gradient on every rank stays as it is."""
    return _MeanGrad.apply(x, group_name)


class RowGrads:
    """The backwards in which a call's row outputs got a gradient (``scale_grad``), by autograd
    graph task: where one did, the gradient reaching a row input had the row outputs' scale
    (``rows_input``)."""

    __slots__ = ("task",)

    def __init__(self) -> None:
        self.task = -1

    def seen(self) -> bool:
        return self.task == torch._C._current_graph_task_id()


class _Scaled(torch.autograd.Function):
    """Identity in forward; backward scales the gradient by ``factor`` (each subclass says when)."""

    @staticmethod
    def forward(ctx, x, factor, rows):
        ctx.factor, ctx.rows = factor, rows
        return x.view_as(x)


class _ScaleGrad(_Scaled):
    @staticmethod
    def backward(ctx, grad):
        if ctx.rows is None:  # no input of the call requires grad: a second backward would reach the parameters
            refuse_per_rank_penalty("comes back as each rank's rows")
        else:
            ctx.rows.task = torch._C._current_graph_task_id()
        return grad * ctx.factor, None, None


def scale_grad(x: torch.Tensor, factor: float, rows: RowGrads | None = None) -> torch.Tensor:
    """``x``, whose gradient is scaled by ``factor`` in backward: a rank's own rows of a split
    output, whose gradient is that rank's loss's alone, take ``1 / data_parallel_size`` so that
    the parameters' step is the mean of the ranks' losses', as DDP's averaged gradients make it.
    ``rows`` records the backwards it ran in (``rows_input``)."""
    return _ScaleGrad.apply(x, factor, rows)


class _RowsInput(_Scaled):
    @staticmethod
    def backward(ctx, grad):
        # A backward after one with create_graph=True: what reaches the input through that one's
        # graph kept the row outputs' scale (below), whether or not a row output got a gradient here.
        if not ctx.rows.seen() and not getattr(ctx, "penalty", False):
            return grad, None, None
        if not torch.is_grad_enabled():
            return grad * ctx.factor, None, None
        # create_graph=True (a gradient penalty): the value is scaled, but not what a second backward
        # takes through it to the parameters, which their reductions then sum over the ranks: it
        # keeps the row outputs' 1 / data_parallel_size, DDP's average of the ranks' penalties.
        ctx.penalty = True
        return grad.detach() * ctx.factor + (grad - grad.detach()), None, None


def rows_input(x: torch.Tensor, factor: float, rows: RowGrads) -> torch.Tensor:
    """``x``, a rank's own rows of an input that requires grad, whose gradient is scaled by
    ``factor`` (``data_parallel_size``) in a backward where the row outputs' was scaled by its
    inverse (``rows``): that scale is DDP's average of the parameters' gradients, and DDP leaves
    an input's gradient as the rank's own loss gives it (an adversarial example's, a saliency
    map's)."""
    return _RowsInput.apply(x, factor, rows)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group_name, blocks):
        ctx.dim, ctx.group_name, ctx.blocks = dim, group_name, blocks
        return _gather(x, dim, group_name, blocks)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        return _chunk(grad, ctx.dim, ctx.group_name, ctx.blocks), None, None, None


class _Chunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group_name, blocks):
        ctx.dim, ctx.group_name, ctx.blocks = dim, group_name, blocks
        return _chunk(x, dim, group_name, blocks)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        return _gather(grad, ctx.dim, ctx.group_name, ctx.blocks), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group_name):
        ctx.dim, ctx.group_name = dim, group_name
        return _reduce_scatter(x, dim, group_name)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        return _all_gather(grad, ctx.dim, ctx.group_name), None, None


@_guarded("all-to-all")
def _all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group_name: str) -> torch.Tensor:
    """S(src_dim) → S(dst_dim): chunk j along ``dst_dim`` goes to rank j, and the pieces received
    are joined along ``src_dim`` in rank order: one all-to-all. (Planned shards divide evenly:
    ``ir.spec.is_valid``.)"""
    k = group_size(group_name)
    if x.shape[dst_dim] % k:
        raise InternalError(
            f"all-to-all of a tensor of shape {tuple(x.shape)} into {k} chunks along dim {dst_dim}: "
            "that dim does not divide evenly, which a valid plan never asks for (ir.spec.is_valid)"
        )
    received = _exchange_now(_pieces(x, dst_dim, k), group_name)
    shape = x.chunk(k, dst_dim)[0].shape
    return torch.cat([piece.view(shape) for piece in received.unbind(0)], dim=src_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src_dim, dst_dim, group_name):
        ctx.src_dim, ctx.dst_dim, ctx.group_name = src_dim, dst_dim, group_name
        return _all_to_all(x, src_dim, dst_dim, group_name)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        return _all_to_all(grad.contiguous(), ctx.dst_dim, ctx.src_dim, ctx.group_name), None, None, None


def _move(
    x: torch.Tensor,
    dim: int,
    group_name: str,
    src: tuple[tuple[int, ...], ...],
    dst: tuple[tuple[int, ...], ...],
    piece_rows: int,
) -> torch.Tensor:
    """Rank ``r`` holds the pieces ``src[r]`` (piece ids, each ``piece_rows`` long along ``dim``,
    in local order) and ends with the pieces ``dst[r]``, in that order: one all-to-all."""
    rank = group_rank(group_name)
    owner = {piece: r for r, pieces in enumerate(src) for piece in pieces}
    target = {piece: r for r, pieces in enumerate(dst) for piece in pieces}
    rows = x.movedim(dim, 0)
    pieces = dict(zip(src[rank], rows.split(piece_rows, 0))) if src[rank] else {}
    # all_to_all_single sends in destination order and receives in source order.
    send = sorted(src[rank], key=lambda piece: (target[piece], src[rank].index(piece)))
    arrive = sorted(dst[rank], key=lambda piece: (owner[piece], src[owner[piece]].index(piece)))
    input_splits = [piece_rows * sum(1 for p in src[rank] if target[p] == r) for r in range(len(src))]
    output_splits = [piece_rows * sum(1 for p in dst[rank] if owner[p] == r) for r in range(len(src))]
    outgoing = torch.cat([pieces[p] for p in send]) if send else rows.new_empty((0, *rows.shape[1:]))
    received = _all_to_all_rows(outgoing, output_splits, input_splits, group_name)
    by_piece = dict(zip(arrive, received.split(piece_rows, 0)))
    if not dst[rank]:
        return rows.new_empty((0, *rows.shape[1:])).movedim(0, dim)
    return torch.cat([by_piece[p] for p in dst[rank]]).movedim(0, dim)


class _MovePieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group_name, src, dst, piece_rows):
        ctx.args = dim, group_name, src, dst, piece_rows
        return _move(x, dim, group_name, src, dst, piece_rows)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        dim, group_name, src, dst, piece_rows = ctx.args
        return _move(grad, dim, group_name, dst, src, piece_rows), None, None, None, None, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group_name, reduce_dtype):
        ctx.group_name, ctx.reduce_dtype = group_name, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        if ctx.reduce_dtype is None or ctx.reduce_dtype == grad.dtype:
            return _all_reduce(grad, ctx.group_name), None, None
        return _all_reduce(grad.to(ctx.reduce_dtype), ctx.group_name).to(grad.dtype), None, None


class _GatherParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group_name, reduce_dtype):
        ctx.dim, ctx.group_name, ctx.reduce_dtype = dim, group_name, reduce_dtype
        return _all_gather(x, dim, group_name)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        if ctx.reduce_dtype is None or ctx.reduce_dtype == grad.dtype:
            return _reduce_scatter(grad, ctx.dim, ctx.group_name), None, None, None
        return _reduce_scatter(grad.to(ctx.reduce_dtype), ctx.dim, ctx.group_name).to(grad.dtype), None, None, None


class _GatherCastParam(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group_name, reduce_dtype, param_dtype):
        ctx.dim, ctx.group_name, ctx.reduce_dtype, ctx.dtype = dim, group_name, reduce_dtype or x.dtype, x.dtype
        return _all_gather(x.to(param_dtype), dim, group_name)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        return _reduce_scatter(grad.to(ctx.reduce_dtype), ctx.dim, ctx.group_name).to(ctx.dtype), None, None, None, None


@_guarded("all-to-all (rows)")
def _all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    return _waited(funcol.all_to_all_single(x.contiguous(), list(out_splits), list(in_splits), group_name))


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group_name):
        ctx.splits, ctx.group_name = (list(out_splits), list(in_splits)), group_name
        return _all_to_all_rows(x, list(out_splits), list(in_splits), group_name)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(grad)
        out_splits, in_splits = ctx.splits
        return _all_to_all_rows(grad, in_splits, out_splits, ctx.group_name), None, None, None


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    """Send rows ``[sum(in_splits[:j]), sum(in_splits[:j+1]))`` of ``x`` to rank ``j`` of the group
    and receive ``out_splits[j]`` rows from each rank ``j``, in rank order (torch's
    ``all_to_all_single`` along dim 0, uneven). Backward sends the gradients back the same way."""
    return _AllToAllRows.apply(x, out_splits, in_splits, group_name)


def no_grad_all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group_name: str) -> torch.Tensor:
    """``all_to_all_rows`` outside autograd (for counts and indices)."""
    return _all_to_all_rows(x, list(out_splits), list(in_splits), group_name)


def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """P → R: sum the partial values of every rank on the axis."""
    return _AllReduce.apply(x, group_name)


def all_gather(x: torch.Tensor, dim: int, group_name: str, blocks: int = 1) -> torch.Tensor:
    """S(dim) → R: concatenate the shards of every rank along ``dim`` (S(dim)/blocks → R:
    interleave them back into their blocks)."""
    return _AllGather.apply(x, dim, group_name, blocks)


def chunk(x: torch.Tensor, dim: int, group_name: str, blocks: int = 1) -> torch.Tensor:
    """R → S(dim) (or S(dim)/blocks): keep this rank's piece; no communication in forward."""
    if not x.requires_grad:  # the batch's inputs and labels: no backward, so no autograd node (host time a call)
        return _chunk(x, dim, group_name, blocks)
    return _Chunk.apply(x, dim, group_name, blocks)


def reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """P → S(dim): sum the partial values and keep this rank's chunk along ``dim``."""
    return _ReduceScatter.apply(x, dim, group_name)


def all_to_all(x: torch.Tensor, src_dim: int, dst_dim: int, group_name: str) -> torch.Tensor:
    """S(src_dim) → S(dst_dim) on one axis."""
    return _AllToAll.apply(x, src_dim, dst_dim, group_name)


def allreduce_grad(x: torch.Tensor, group_name: str, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Identity in forward; all-reduces the gradient in backward (Megatron's ``f``). With
    ``reduce_dtype`` (a precision policy's, for a parameter's gradient) the gradient is cast to
    it, summed, and the sum cast back to the gradient's dtype."""
    return _AllReduceGrad.apply(x, group_name, reduce_dtype)


# The key of a gather's layer in its nodes' ``meta["custom"]`` (``torch.fx.traceback.annotate``),
# which survives dynamo, AOTAutograd and recomputation: the compiled mode's bucketing reads it
# (``passes.inductor_comm``) to gather one layer per collective, as ``ir.gathers`` groups them.
LAYER_ANNOTATION = "autopar_layer"


def gather_param(
    x: torch.Tensor, dim: int, group_name: str, reduce_dtype: torch.dtype | None = None, layer: str | None = None
) -> torch.Tensor:
    """FSDP's pair for a sharded parameter whose uses are split on the axis: all-gather in
    forward, reduce-scatter of the (partial) gradient in backward. The same numbers as
    ``allreduce_grad(all_gather(x, dim, g), g, reduce_dtype)``, with half the bytes in backward;
    the compiled mode's schedule (``passes.schedule.schedule_in_graph``) puts it in the graph,
    for inductor to bucket and reorder, with the parameter's ``layer`` (``ir.gathers.param_layer``)
    annotated on its collectives where traced (``LAYER_ANNOTATION``)."""
    if layer is not None and torch.compiler.is_compiling():
        with torch.fx.traceback.annotate({LAYER_ANNOTATION: layer}):
            return _GatherParam.apply(x, dim, group_name, reduce_dtype)
    return _GatherParam.apply(x, dim, group_name, reduce_dtype)


def gather_cast_param(
    x: torch.Tensor, dim: int, group_name: str, reduce_dtype: torch.dtype | None, param_dtype: torch.dtype
) -> torch.Tensor:
    """FSDP2's mixed-precision pair: this rank's shard (the master dtype) cast to ``param_dtype``
    and all-gathered in it (half the bytes of gathering the master), the whole gradient cast to
    ``reduce_dtype`` (the shard's dtype where None) and reduce-scattered, the shard's gradient
    in the shard's dtype. The same numbers as casting ``gather_param``'s result."""
    return _GatherCastParam.apply(x, dim, group_name, reduce_dtype, param_dtype)


def _recompute_everything(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_in_backward() -> tuple:
    return create_selective_checkpoint_contexts(_recompute_everything)


def gather_param_resharded(
    x: torch.Tensor,
    dim: int,
    group_name: str,
    reduce_dtype: torch.dtype | None = None,
    layer: str | None = None,
    param_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gather_param`` (cast to ``param_dtype`` after the gather, where given) whose gathered
    parameter is not kept for backward: AOTAutograd's partitioner all-gathers it again in
    backward (FSDP's ``reshard_after_forward``), as SimpleFSDP does: the gather and the cast run
    in a selective activation checkpoint whose policy makes every op in it MUST_RECOMPUTE (the
    all-gather, its wait, the concatenation of a gather along a dim other than 0, the cast), so
    backward saves the shard, not the whole parameter. Outside ``torch.compile`` no checkpoint
    is needed: eagerly the parameter's users save it anyway, and the eager schedule frees
    gathers its own way (``ops.buckets.ParamGathers``)."""
    if not torch.compiler.is_compiling():
        return _gather_cast(x, dim, group_name, reduce_dtype, param_dtype)
    with torch.fx.traceback.annotate({LAYER_ANNOTATION: layer} if layer is not None else {}):
        return torch.utils.checkpoint.checkpoint(
            _gather_cast, x, dim, group_name, reduce_dtype, param_dtype, use_reentrant=False, context_fn=_recompute_in_backward
        )


def _gather_cast(
    x: torch.Tensor, dim: int, group_name: str, reduce_dtype: torch.dtype | None, param_dtype: torch.dtype | None
) -> torch.Tensor:
    whole = gather_param(x, dim, group_name, reduce_dtype)
    return whole if param_dtype is None else whole.to(param_dtype)


def move_pieces(
    x: torch.Tensor,
    dim: int,
    group_name: str,
    src: tuple[tuple[int, ...], ...],
    dst: tuple[tuple[int, ...], ...],
    piece_rows: int,
) -> torch.Tensor:
    """Permute equal pieces (``piece_rows`` long along ``dim``) among the group's ranks: rank ``r``
    holds pieces ``src[r]`` (ids in local order) and gets ``dst[r]``. Backward moves the
    gradient pieces back."""
    return _MovePieces.apply(x, dim, group_name, src, dst, piece_rows)


def no_grad_reduce_scatter(x: torch.Tensor, dim: int, group_name: str) -> torch.Tensor:
    """The sum of the ranks' ``x``, chunk ``rank`` along ``dim``, outside autograd (a kernel's
    own backward)."""
    return _reduce_scatter(x, dim, group_name)


def no_grad_all_gather(x: torch.Tensor, dim: int, group_name: str, blocks: int = 1) -> torch.Tensor:
    """S(dim) (or S(dim)/blocks) → R outside autograd, for gathering state dicts and gradients."""
    return _gather(x, dim, group_name, blocks)


def no_grad_chunk(x: torch.Tensor, dim: int, group_name: str, blocks: int = 1) -> torch.Tensor:
    """R → S(dim) (or S(dim)/blocks) outside autograd: this rank's piece, contiguous."""
    return _chunk(x, dim, group_name, blocks)


def no_grad_all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return _all_reduce(x, group_name)
