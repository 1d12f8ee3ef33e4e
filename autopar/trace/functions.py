"""Custom ``torch.autograd.Function``s traced as one op that keeps their backward.

``torch.export`` traces through ``MyFn.apply``: the graph keeps the forward's ops and autograd
then differentiates those, so a Function whose backward is not its forward's derivative
(a straight-through estimator, gradient reversal, a scaled gradient, a fused kernel's hand
backward) would silently train with the wrong gradient. While tracing (``functions_as_one_op``),
every call of a user Function's ``apply`` becomes one call of the custom op
``autopar::autograd_function``: its tensor arguments in a list and a key naming the Function
and its non-tensor arguments (``_CALLS``), which export keeps whole. No rule knows the op, so
it is placed replicated (recorded as a fallback in the plan).

The op's forward calls ``MyFn.apply`` without autograd. Its backward runs ``MyFn.apply`` again
on the saved inputs with autograd on and asks autograd for the gradients: autograd then calls
the user's own backward, with its own ``ctx`` (saved tensors, ``needs_input_grad``,
``mark_non_differentiable``, ``once_differentiable``, several outputs), at the cost of running
the Function's forward twice. A rewritten graph calls ``MyFn.apply`` directly instead
(``ops.kernels.EAGER_IMPLEMENTATIONS``), so the compiled module runs each forward once, as eager.

Functions of torch and autopar themselves are left as they are (they are torch's own ops).
The key is made from the Function's qualified name and the repr of its non-tensor arguments, so
that the graph (and its hash) is the same in every process.
"""

from __future__ import annotations

import contextlib
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from autopar.errors import TraceError, UsageError


@dataclass(frozen=True)
class _Call:
    """A traced call: the Function, and its arguments with each tensor replaced by ``_TENSOR``."""

    function: type
    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec


_TENSOR = object()
_CALLS: dict[str, _Call] = {}
_OUT_SPECS: dict[str, tuple[tuple[Any, ...], pytree.TreeSpec]] = {}  # key → the outputs' structure


def _is_user_function(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return not (module == "torch" or module.startswith(("torch.", "autopar.")))


def _register(function: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, list[torch.Tensor]]:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    template = tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)
    # Addresses in a repr differ between processes; the key must not (it is in the graph's hash).
    shown = re.sub(r" at 0x[0-9a-fA-F]+", "", ", ".join("T" if leaf is _TENSOR else repr(leaf) for leaf in template))
    base = f"{function.__module__}.{function.__qualname__}({shown}|{spec})"
    call = _Call(function, template, spec)
    for number in itertools.count():  # arguments that print alike but differ get their own key
        key = f"{base}#{number}" if number else base
        held = _CALLS.setdefault(key, call)
        if held is call or _same_call(held, call):
            return key, tensors
    raise AssertionError("unreachable")


def _same_call(a: _Call, b: _Call) -> bool:
    if a.function is not b.function or a.spec != b.spec or len(a.leaves) != len(b.leaves):
        return False
    for x, y in zip(a.leaves, b.leaves):
        if x is y:
            continue
        try:
            if type(x) is not type(y) or not bool(x == y):
                return False
        except Exception:  # noqa: BLE001 - objects that cannot be compared are different calls
            return False
    return True


def _rebuild(key: str, tensors: list[torch.Tensor]) -> tuple[type, tuple[tuple[Any, ...], dict[str, Any]]]:
    call = _CALLS.get(key)
    if call is None:
        raise UsageError(
            f"autopar: the custom autograd Function call {key!r} was traced in another process; "
            "compile the model in this process (autopar.compile traces it) before running its graph"
        )
    given = iter(tensors)
    leaves = [next(given) if leaf is _TENSOR else leaf for leaf in call.leaves]
    return call.function, pytree.tree_unflatten(leaves, call.spec)


def _tensor_outputs(out: Any, key: str | None = None) -> list[torch.Tensor]:
    """The tensors of a Function's output; with ``key``, its structure is kept for ``_restructure``."""
    leaves, spec = pytree.tree_flatten(out)
    if key is not None:
        _OUT_SPECS[key] = (tuple(_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves), spec)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]


def apply_function(tensors: list[torch.Tensor], key: str) -> Any:
    """``MyFn.apply`` on the call's arguments (what a rewritten graph runs, with autograd)."""
    function, (args, kwargs) = _rebuild(key, list(tensors))
    return _ORIGINAL_APPLY.__func__(function, *args, **kwargs)


def apply_function_eager(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """The op's tensor outputs, differentiated by autograd through the user's backward."""
    return _tensor_outputs(apply_function(tensors, key))


@torch.library.custom_op("autopar::autograd_function", mutates_args=())
def _autograd_function(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    with torch.no_grad():
        outs = _tensor_outputs(apply_function(tensors, key), key)
    # A custom op's outputs may not alias its inputs (an identity forward returns its input).
    ids = {t.untyped_storage()._cdata for t in tensors}
    return [t.clone() if t.untyped_storage()._cdata in ids else t for t in outs]


@_autograd_function.register_fake
def _(tensors, key):
    versions = [t._version for t in tensors]
    with torch.no_grad():
        outs = _tensor_outputs(apply_function(tensors, key), key)
    written = [i for i, (t, v) in enumerate(zip(tensors, versions)) if t._version != v]
    if written:  # the op is declared pure: an in-place forward would be traced as if it were not
        raise TraceError(
            f"custom autograd Function {_CALLS[key].function.__qualname__} writes its tensor argument(s) "
            f"{written} in place (ctx.mark_dirty), which autopar cannot keep as one op: other uses of that tensor "
            "would not see the write. Make its forward out of place (return a new tensor: x.clone() then write into it)"
        )
    return [torch.empty_like(t) for t in outs]


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[0])
    ctx.key = inputs[1]
    # Which inputs asked for a gradient: the Function's ``ctx.needs_input_grad`` must say the same.
    ctx.wants_grad = [t.requires_grad for t in inputs[0]]


def _backward(ctx, grads):
    """Run the Function again with autograd on, and let autograd call its own backward."""
    saved = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(wants) for t, wants in zip(saved, ctx.wants_grad)]
    with torch.enable_grad():
        outs = apply_function_eager(leaves, ctx.key)
    pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
    wanted = [i for i, t in enumerate(leaves) if t.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(leaves)
    if pairs and wanted:
        found = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs], allow_unused=True)
        for i, grad in zip(wanted, found):
            result[i] = grad
    return result, None


_autograd_function.register_autograd(_backward, setup_context=_setup_context)

FUNCTION_OP = torch.ops.autopar.autograd_function.default
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]


def _traced_apply(cls, *args, **kwargs):
    if not _is_user_function(cls):
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    modules = [type(leaf).__name__ for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.nn.Module)]
    if modules:  # its parameters would be the model's own tensors, not the compiled module's shards
        raise TraceError(
            f"custom autograd Function {cls.__qualname__} is given a module ({', '.join(modules)}) as an argument: "
            "autopar keeps each Function as one op on its tensor arguments, and the module's parameters would not "
            "be the compiled module's. Pass the tensors it uses (module.weight, ...) as arguments instead"
        )
    key, tensors = _register(cls, args, kwargs)
    if not tensors:  # nothing to differentiate: its forward is traced as it is
        return _ORIGINAL_APPLY.__func__(cls, *args, **kwargs)
    return _restructure(key, _autograd_function(tensors, key))


def _restructure(key: str, outs: list[torch.Tensor]) -> Any:
    """The op's flat outputs in the structure ``cls.apply`` returned when the op ran (a tensor,
    a tuple with non-tensor items, ...)."""
    leaves, spec = _OUT_SPECS[key]
    given = iter(outs)
    return pytree.tree_unflatten([next(given) if leaf is _TENSOR else leaf for leaf in leaves], spec)


@contextlib.contextmanager
def functions_as_one_op() -> Iterator[None]:
    """Inside the block, ``apply`` of every user autograd Function calls ``autopar::autograd_function``."""
    torch.autograd.Function.apply = classmethod(_traced_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _ORIGINAL_APPLY


__all__ = ["FUNCTION_OP", "apply_function_eager", "functions_as_one_op"]
