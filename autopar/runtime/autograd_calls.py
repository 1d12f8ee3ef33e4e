"""``torch.autograd.grad`` and ``backward(inputs=...)`` over a compiled module's parameters: as in
eager, or refused.

A compiled module's DTensor parameters are not in the autograd graph: its graph reads each one's
``LocalLeaf`` (``ops.params``), as FSDP2's graph reads its unsharded parameters. So
``d_loss.backward(inputs=list(pm_d.parameters()))`` (a GAN's discriminator step) computed no
gradient at all under a sharding plan, and ``torch.autograd.grad(loss, pm.parameters(),
allow_unused=True)`` returned None for each (zeros with ``materialize_grads=True``), where eager
and a data-parallel plan gave the gradients: a plan the solver picked trained nothing, without a
word, and torch's own error without ``allow_unused`` pointed at that flag.

``install`` wraps ``torch.autograd.backward`` (which ``Tensor.backward`` calls) and
``torch.autograd.grad`` once a process, from the first module that holds DTensor parameters.
Each puts, in place of such a parameter among ``inputs``, the leaf its graph read last
(``ops.params.leaf_of``): ``backward`` then writes the parameter's ``.grad`` as a whole backward
does (buckets, hooks and all), and ``grad`` returns its gradient as a DTensor of the parameter's
placements (differentiable under ``create_graph=True``). ``grad`` over a gradient that the module
reduces in a bucket, which reaches ``.grad`` at the end of backward instead of coming back, is
refused on every rank alike as the gradient reaches the bucket (``ops.params.refuse_in_grad_call``),
naming ``loss.backward()``. A call over no compiled parameter pays a type check per input. Code
that bound ``torch.autograd.grad`` to another name before the first ``compile`` calls torch's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import GradientEdge
from torch.distributed.tensor import DTensor

from autopar.errors import UsageError
from autopar.ops.params import BACKWARD_INPUTS, GRAD_CALLS, as_like, leaf_of

_TORCH: dict[str, Callable[..., Any]] = {}  # torch's own backward and grad, once wrapped


def install() -> None:
    """Wrap ``torch.autograd.backward`` and ``torch.autograd.grad`` (once a process)."""
    if _TORCH:
        return
    _TORCH["backward"], _TORCH["grad"] = torch.autograd.backward, torch.autograd.grad
    torch.autograd.backward = functools.wraps(_TORCH["backward"])(_backward)
    torch.autograd.grad = functools.wraps(_TORCH["grad"])(_grad)


def _backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None):
    _refuse_tracing_placeholders(tensors)
    if inputs is None:
        return _TORCH["backward"](tensors, grad_tensors, retain_graph, create_graph, grad_variables)
    inputs = inputs if isinstance(inputs, dict) else _items(inputs)  # a generator is read once
    named = BACKWARD_INPUTS[0]
    BACKWARD_INPUTS[0] = frozenset(map(id, inputs.values() if isinstance(inputs, dict) else inputs))
    try:
        return _TORCH["backward"](tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs=_as_leaves(inputs)[0])
    finally:
        BACKWARD_INPUTS[0] = named


def _refuse_tracing_placeholders(tensors: Any) -> None:
    """A backward of a FakeTensor outside any tracing: a value made from what a forward hook (or
    other code the model runs) kept while autopar traced it, such as an activation stored for an
    auxiliary loss. Its backward ran and wrote gradients computed from no data, without a word."""
    if isinstance(tensors, torch.Tensor):
        tensors = (tensors,)
    fake = [t for t in tensors if isinstance(t, FakeTensor)] if isinstance(tensors, (tuple, list)) else []
    if fake and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        raise UsageError(
            "backward of a tensor made from a tracing placeholder (a FakeTensor): something the model ran while "
            "autopar traced it kept a tensor, such as a forward hook that stores an activation for a loss, and that "
            "code does not run at each call (the compiled graph does). Return what the loss needs from the model's "
            "forward (or from the hook, which is traced), or remove the hook before autopar.compile"
        )


def _grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph=None,
    create_graph=False,
    only_inputs=True,
    allow_unused=None,
    is_grads_batched=False,
    **kwargs,
):
    inputs, params = _as_leaves(inputs)
    if params and is_grads_batched:
        raise UsageError(
            "torch.autograd.grad(..., is_grads_batched=True) with respect to a compiled module's sharded "
            "parameters is not supported: call it once per grad_outputs, or use loss.backward() and p.grad"
        )
    GRAD_CALLS[0] += 1
    try:
        result = _TORCH["grad"](
            outputs,
            inputs,
            grad_outputs=grad_outputs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            only_inputs=only_inputs,
            allow_unused=allow_unused,
            is_grads_batched=is_grads_batched,
            **kwargs,
        )
    finally:
        GRAD_CALLS[0] -= 1
    if not params:
        return result
    if isinstance(result, dict):
        return {key: _as_param_grad(g, params.get(key), create_graph) for key, g in result.items()}
    return tuple(_as_param_grad(g, params.get(i), create_graph) for i, g in enumerate(result))


def _as_leaves(inputs: Any) -> tuple[Any, dict[Any, DTensor]]:
    """``inputs`` with each compiled DTensor parameter replaced by the leaf its graph read last (a
    sequence as a list: ``model.parameters()`` is a generator), and those parameters by position
    (by key for a dict)."""
    if isinstance(inputs, dict):
        keys = list(inputs)
        values, found = _as_leaves(list(inputs.values()))
        return (dict(zip(keys, values)) if found else inputs), {keys[i]: p for i, p in found.items()}
    single = isinstance(inputs, (torch.Tensor, GradientEdge))
    items = _items(inputs)
    found: dict[Any, DTensor] = {}
    for i, item in enumerate(items):
        leaf = leaf_of(item) if isinstance(item, DTensor) else None
        if leaf is not None and leaf.last is not None:
            items[i], found[i] = leaf.last, item
    return (items[0] if single else items), found


def _items(inputs: Any) -> list[Any]:
    """``inputs`` (one tensor or gradient edge, or a sequence of them) as a list."""
    return [inputs] if isinstance(inputs, (torch.Tensor, GradientEdge)) else list(inputs)


def _as_param_grad(grad: torch.Tensor | None, param: DTensor | None, differentiable: bool) -> torch.Tensor | None:
    """The gradient of ``param``'s leaf as the parameter's gradient: a DTensor of its placements,
    through ``from_local``'s autograd where a penalty on it must reach the graph."""
    if param is None or grad is None:
        return grad
    if differentiable:
        return DTensor.from_local(
            grad, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return as_like(grad, param)
