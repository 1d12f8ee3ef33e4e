"""Parameters as DTensors, the graph on their local shards.

A compiled module's parameters are ``nn.Parameter``s that are DTensors on its device mesh, as
FSDP2's are: torch's own tools (``clip_grad_norm_``, optimizers, DCP) see the whole model. Where
the plan replicates every parameter (data parallel, or one device) they are plain tensors, as
DDP's are, and the graph reads them directly: a DTensor there would only add host time (its
dispatch in every optimizer op and gradient hand-off) to a step that is often host-bound. The
rewritten graph runs on the local shards: the runtime passes it each parameter's ``LocalLeaf``,
a plain leaf tensor on the shard's storage whose accumulated gradient is moved into the
parameter's ``.grad`` (a DTensor with the same placements) as soon as autograd accumulates it,
and the parameter's own post-accumulate-grad hooks run then.

Why not ``param.to_local()``: its backward node is made when forward starts, so autograd, which
runs ready nodes latest-made first, would run every parameter's at the end of backward and
hold all gradients until then (a leaf's accumulation runs at once, as for a plain parameter).
What bypasses autograd (the scheduled gradient buckets, which write reduced gradients at the
end of backward) goes through ``add_grad``. Like FSDP2's, the DTensor parameters are not in
the autograd graph: ``runtime.autograd_calls`` puts each one's leaf (``leaf_of``) in their place
in ``torch.autograd.grad`` and ``backward(inputs=...)``.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from autopar.errors import HookError, UsageError


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of ``tensor`` (itself if it is not a DTensor), sharing its storage."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def as_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor of ``like``'s kind: a DTensor with ``like``'s mesh, placements and
    whole shape (no copy, no communication) if ``like`` is one, else ``local`` itself.

    A gradient laid out as the parameter's shard shares the parameter's spec, made with DTensor's
    own constructor as FSDP2 makes its gradients (``from_local`` builds a new spec through an
    autograd function: about 45 us against 3, for every parameter at every step)."""
    if not isinstance(like, DTensor):
        return local
    shard = like._local_tensor
    if local.shape == shard.shape and local.stride() == shard.stride() and local.dtype == shard.dtype:
        return DTensor(local, like._spec, requires_grad=False)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


@torch.no_grad()
def add_grad(param: torch.Tensor, local: torch.Tensor) -> None:
    """Add ``local`` (this rank's gradient shard of ``param``) into ``param.grad``, as autograd's
    accumulation would: set it when there is none, add into its local shard otherwise."""
    _add_grad(param, local)


@torch.no_grad()
def add_grads(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``add_grad`` of each (parameter, local gradient) pair under one ``no_grad``: the end of
    backward hands over a whole bucket at once (entering ``no_grad`` per parameter cost more
    than the hand-over itself)."""
    for param, local in pairs:
        _add_grad(param, local)


def _add_grad(param: torch.Tensor, local: torch.Tensor) -> None:
    if local.dtype != param.dtype:
        local = local.to(param.dtype)
    if param.grad is None:
        param.grad = as_like(local, param)
    else:
        local_of(param.grad).add_(local)


def storage_id(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s own storage (a DTensor's wrapper has one of its own, empty):
    ``p.data = value`` replaces it, and nothing else of a DTensor (see ``data_replaced``)."""
    return torch.Tensor.untyped_storage(tensor)._cdata


def data_replaced(fqn: str) -> UsageError:
    """The refusal of a DTensor parameter whose ``.data`` was assigned: torch ignores that on a
    DTensor (its local shard stays), as on FSDP2's parameters."""
    return UsageError(
        f"parameter '{fqn}' of a compiled module had its .data replaced after autopar.compile (p.data = value: "
        "torch.nn.utils.vector_to_parameters, a SAM-style restore or an average swapped in for evaluation). It is a "
        "DTensor shard, and torch ignores .data assignment on one (as on FSDP2's parameters): the module would go on "
        "with the old values, without a word. Write in place instead: p.data.copy_(value) with value a DTensor of "
        "the same placements (p.data.clone() saves one), or pm.load_state_dict({name: whole_tensor}, strict=False) "
        "for whole tensors"
    )


# id(DTensor parameter) -> a weak reference to the LocalLeaf its compiled module reads it through
_LEAVES: dict[int, weakref.ref] = {}
# Above 0 while ``torch.autograd.grad`` runs (``runtime.autograd_calls``): a gradient that reaches
# ``.grad`` outside autograd (a bucket's) would not come back from it (``refuse_in_grad_call``).
GRAD_CALLS = [0]
# While ``backward(inputs=...)`` runs: the ids of the parameters it names (``runtime.autograd_calls``).
# Autograd computes every gradient that a bucket node takes as soon as one of its parameters is
# named; ``ops.buckets`` keeps those of the others out of ``.grad`` (``named_in_backward``).
BACKWARD_INPUTS: list[frozenset[int] | None] = [None]


def named_in_backward(param: torch.Tensor) -> bool:
    """Whether the backward running now may write ``param``'s ``.grad``: every parameter, unless
    it was called with ``inputs=`` that do not name ``param``."""
    named = BACKWARD_INPUTS[0]
    return named is None or id(param) in named


def hold_leaves(leaves: Iterable[LocalLeaf]) -> None:
    """Register ``leaves`` (a compiled module's, one per DTensor parameter) for ``leaf_of``, weakly."""
    for leaf in leaves:
        key = id(leaf.param)
        _LEAVES[key] = weakref.ref(leaf, lambda ref, key=key: _LEAVES.pop(key) if _LEAVES.get(key) is ref else None)


def holds_leaves() -> bool:
    """Whether any compiled module's leaves are registered (``hold_leaves``) and alive."""
    return bool(_LEAVES)


def leaf_of(param: object) -> LocalLeaf | None:
    """The ``LocalLeaf`` of ``param`` if it is a compiled module's DTensor parameter, else None."""
    entry = _LEAVES.get(id(param))
    leaf = None if entry is None else entry()
    return leaf if leaf is not None and leaf.param is param else None


def refuse_in_grad_call() -> None:
    """Raise where ``torch.autograd.grad`` reached a gradient that the compiled module hands to
    ``.grad`` at the end of backward instead of back through autograd (``ops.buckets``)."""
    if GRAD_CALLS[0]:
        raise UsageError(
            "torch.autograd.grad reached a parameter gradient that this compiled module reduces in a bucket "
            "and writes into .grad at the end of backward, outside autograd: it would come back as None and "
            "land in .grad. Use loss.backward() (or loss.backward(inputs=[...]) for some parameters) and read "
            "p.grad; torch.autograd.grad with respect to inputs and activations works as in eager"
        )


# id(parameter) -> (a weak reference to it, the post-accumulate-grad hooks of a plain one):
# parameters whose reduced gradient a bucket hands to .grad at the end of backward (``hold_hooks``)
_HELD: dict[int, tuple[weakref.ref, OrderedDict]] = {}


def hold_hooks(param: torch.Tensor) -> None:
    """Run ``param``'s post-accumulate-grad hooks when ``run_held_hooks`` says, not when autograd
    accumulates into it. A bucket (``ops.buckets``) hands a parameter's reduced gradient to
    ``.grad`` at the end of backward; autograd would run the hooks before, on a ``.grad`` still None
    or the last step's (torch's optimizer-in-backward recipe stepped stale gradients, without a
    word). A plain parameter becomes a ``_HeldParameter``: the hooks it holds move here, new ones
    come here, and ``register_hook`` is refused (``grad_hook_refused``). A DTensor parameter's hooks
    stay its own: autograd never runs them, and ``LocalLeaf`` leaves them to the bucket."""
    key = id(param)
    entry = _HELD.get(key)
    if entry is not None and entry[0]() is param:
        return
    hooks: OrderedDict = OrderedDict()
    if type(param) is torch.nn.Parameter:
        if param._post_accumulate_grad_hooks:
            hooks.update(param._post_accumulate_grad_hooks)
            param._post_accumulate_grad_hooks.clear()  # autograd holds this very dict and finds it empty
        param.__class__ = _HeldParameter
    _HELD[key] = (weakref.ref(param, lambda ref, key=key: _HELD.pop(key) if _HELD.get(key, (None,))[0] is ref else None), hooks)


def _held(param: torch.Tensor) -> OrderedDict | None:
    """The hooks ``hold_hooks`` holds for ``param`` (a DTensor's: its own, None while it has none),
    or None if it holds none."""
    entry = _HELD.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return param._post_accumulate_grad_hooks if isinstance(param, DTensor) else entry[1]


def run_held_hooks(params: Iterable[torch.Tensor]) -> None:
    """Run the post-accumulate-grad hooks of each of ``params`` that ``hold_hooks`` holds, once
    each, in order: their ``.grad`` is final for this backward."""
    seen: set[int] = set()
    for param in params:
        hooks = _held(param) if id(param) not in seen else None
        seen.add(id(param))
        for hook in tuple(hooks.values()) if hooks else ():
            hook(param)


def adopt_in_backward_optimizers(module: torch.nn.Module) -> None:
    """Move the steps that ``torch.distributed.optim._apply_optimizer_in_backward`` hooked on a
    parameter's ``AccumulateGrad`` node to a post-accumulate-grad hook, for each parameter of
    ``module`` whose reduced gradient does not come through that node: a DTensor's (autograd never
    reaches it: its optimizer stepped nothing, without a word) and a bucketed one's (the node runs
    before the bucket hands over the reduced gradient: it stepped on ``.grad`` None). The hook
    runs once ``.grad`` is final (``run_held_hooks``) and does what torch's did: each of the
    parameter's optimizers steps, then ``.grad`` is None. A no-op unless that function was used."""
    in_backward = sys.modules.get("torch.distributed.optim.apply_optimizer_in_backward")
    handles = getattr(in_backward, "param_to_optim_hook_handle_map", None)
    if not handles:
        return
    for param in module.parameters():
        if param in handles and (isinstance(param, DTensor) or _held(param) is not None):
            for handle in handles.pop(param):
                handle.remove()
            param.register_post_accumulate_grad_hook(_step_in_backward)


def _step_in_backward(param: torch.Tensor) -> None:
    for optimizer in param._in_backward_optimizers:
        optimizer.step()
    param.grad = None


def grad_hook_refused(why: str) -> HookError:
    """The refusal of a ``register_hook`` gradient hook on a compiled module's parameter that would
    not run on its gradient (``why``)."""
    return HookError(
        f"a hook registered with register_hook on a parameter of a compiled module would not run: {why}. Register "
        "the hook on the model's parameter before autopar.compile (it is traced), or use "
        "p.register_post_accumulate_grad_hook, which runs on the reduced .grad"
    )


class _HeldParameter(torch.nn.Parameter):
    """A plain parameter whose gradient a bucket reduces (``hold_hooks``). A copy of it (a deep copy
    of the module) is held by nothing and registers its hooks as any parameter does."""

    def register_post_accumulate_grad_hook(self, hook: Callable[[torch.Tensor], None]) -> RemovableHandle:
        hooks = _held(self)
        if hooks is None:
            return super().register_post_accumulate_grad_hook(hook)
        handle = RemovableHandle(hooks)
        hooks[handle.id] = hook
        return handle

    def register_hook(self, hook: Callable) -> RemovableHandle:
        if _held(self) is None:
            return super().register_hook(hook)
        raise grad_hook_refused(
            "the plan reduces its gradient in a bucket, which hands it to .grad at the end of backward, and "
            "autograd would run the hook before, on no gradient"
        )


class LocalLeaf:
    """The tensor the graph reads for a DTensor parameter (see the module docstring). Each read
    also refuses a parameter whose ``.data`` was assigned since the last (``data_replaced``)."""

    def __init__(self, param: DTensor, fqn: str = ""):
        self.param, self.fqn = param, fqn
        self._leaf: torch.Tensor | None = None
        # the parameter whose storage this is: a deep copy of the module (AveragedModel) holds another
        self._owner, self._storage = id(param), storage_id(param)

    @property
    def last(self) -> torch.Tensor | None:
        """The leaf the graph read last (None before the first call)."""
        return self._leaf

    def check(self) -> None:
        """Refuse the parameter if its ``.data`` was assigned (``data_replaced``)."""
        param = self.param
        storage = storage_id(param)
        if storage != self._storage:
            if self._owner == id(param):
                raise data_replaced(self.fqn)
            self._owner, self._storage = id(param), storage

    def get(self) -> torch.Tensor:
        """The leaf, made again if the parameter's shard or ``requires_grad`` changed."""
        self.check()
        param = self.param
        if param._backward_hooks:
            raise grad_hook_refused("autopar computes the gradient on the local shard, not through that DTensor")
        local, leaf = param._local_tensor, self._leaf
        if (
            leaf is None
            or leaf.data_ptr() != local.data_ptr()
            or leaf.shape != local.shape
            or leaf.dtype != local.dtype
            or leaf.requires_grad != param.requires_grad
        ):
            leaf = self._leaf = local.detach().requires_grad_(param.requires_grad)
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(self._route)
        return leaf

    def _route(self, leaf: torch.Tensor) -> None:
        # Runs once per parameter and backward, so it takes the short way where it can: the first
        # gradient of a step, laid out as the shard, becomes the DTensor .grad as it is.
        grad = leaf.grad
        if grad is not None:  # None where every use's gradient went to a bucket (ops.buckets)
            leaf.grad = None
            param = self.param
            shard = param._local_tensor
            if param.grad is None and grad.dtype == shard.dtype and grad.shape == shard.shape and grad.stride() == shard.stride():
                param.grad = DTensor(grad, param._spec, requires_grad=False)
            else:
                add_grad(param, grad)
        hooks = self.param._post_accumulate_grad_hooks
        if hooks and _held(self.param) is None:  # a bucket's gradient runs them when it arrives
            for hook in tuple(hooks.values()):
                hook(self.param)
