"""Example inputs that share memory (the same tensor twice, views of one another).

``torch.export`` takes the aliasing of its example inputs for a property of every call: given
``(z, z)`` for ``(idx, targets)`` it feeds every use of ``targets`` from one placeholder and
leaves the other unused, so every later call with two different tensors computes on one of
them. ``independent_inputs`` gives export a copy of each input that shares memory with an
earlier one, so that each input is its own placeholder: a graph that only reads its inputs then
computes what eager computes whether or not a call's inputs alias. A graph that writes an input
in place is different (eager's write would show through the other alias): ``check_call_aliases``
refuses a call whose inputs alias one another where one of them is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from autopar.errors import InputError


def _storage_key(tensor: torch.Tensor) -> int | None:
    """An id of the memory a tensor views, or None where it has none to share (a FakeTensor
    or subclass without storage: export makes those independent anyway)."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def independent_inputs(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """``(args, kwargs)`` with each tensor that shares memory with an earlier one cloned (its
    ``requires_grad`` kept); the others are passed as they are."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    seen: set[int] = set()
    out = []
    for leaf in leaves:
        key = _storage_key(leaf) if isinstance(leaf, torch.Tensor) else None
        if key is not None and key in seen:
            leaf = leaf.detach().clone().requires_grad_(leaf.requires_grad)
        elif key is not None:
            seen.add(key)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def written_inputs(gm: torch.fx.GraphModule) -> frozenset[str]:
    """The placeholders the graph writes in place (``copy_`` of a functionalized input mutation,
    or any op whose schema marks the argument written)."""
    written = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for argument, value in zip(node.target._schema.arguments, node.args):
            if isinstance(value, torch.fx.Node) and value.op == "placeholder":
                if argument.alias_info is not None and argument.alias_info.is_write:
                    written.add(value.name)
    return frozenset(written)


def check_call_aliases(values: Sequence[Any], names: Sequence[str], written: frozenset[str]) -> None:
    """Refuse a call whose user inputs share memory where the graph writes one of them: the
    graph was traced with independent inputs, and eager's write would show through the alias."""
    if not written:
        return
    owners: dict[int, str] = {}
    for value, name in zip(values, names):
        key = _storage_key(value) if isinstance(value, torch.Tensor) else None
        if key is None:
            continue
        other = owners.setdefault(key, name)
        if other != name and (name in written or other in written):
            raise InputError(
                f"inputs {other!r} and {name!r} share memory (the same tensor, or views of one tensor), and the "
                f"compiled graph writes {name if name in written else other!r} in place: it was traced with "
                "independent inputs, so the write would not show through the other as in eager. Pass a copy "
                f"({name}.clone()) or separate tensors"
            )


__all__ = ["check_call_aliases", "independent_inputs", "written_inputs"]
