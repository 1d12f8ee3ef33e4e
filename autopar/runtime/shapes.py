"""Calls whose inputs have other shapes than the example inputs: re-planned once per shape, cached.

Fine-tuning scripts change shapes all the time: a collator that pads each batch to its own
longest sequence, the last smaller batch of an epoch, greedy decoding that grows the sequence.
The traced graph and its plan hold the example inputs' shapes, so a call with other shapes gets a
graph of its own: the model traced on the call's inputs (on its meta copy, as another mode's graph
is, ``runtime.modes``), planned with every parameter and buffer pinned to the placements the module
already holds and the batch split on the same mesh axes, and rewritten. The graphs are cached by
(mode, shapes), so each shape is traced and planned once; one log line gives the time it took.

Every size may shrink, none may grow: the example inputs are the planned maximum (the memory
budget was checked at their size), and a larger call is refused with the fix.

A call's other arguments (a float scale, a flag, a count, a string) are in the graph as constants:
export specializes on the example's values. A call with other values gets a graph of its own
too, traced with the call's, as torch.compile recompiles for them (``constant_entry``). Values of
other types (objects) are not compared.

A call may pass other arguments than the example inputs: the same ones another way (by keyword
where the example passed them by position, keywords in another order) is the same call, laid out
as the example's (``relaid``, by the forward's signature); an argument left out or added (the
model's ``generate()`` calls it without the labels it was trained with, an evaluation passes no
targets and computes its metrics on the logits) gets a graph of its own, traced with the call's
arguments and cached by their structure and shapes (``call_key``). An argument of the example's
name may not be larger than planned (``check_arguments_within``); under ``batch="per_rank"`` the
call's batched inputs are found as the planner finds them (dim 0 of the first tensor's size).

Every rank must take the same decision, or one rank plans (collectives of its own) while another
runs the graph, and both hang. Each call's data check (``runtime.data.start_check``) gathers a
number made from the call's shapes from every rank, and a rank that meets a shape it has no graph
for settles that check before it plans: if any rank passed other shapes, every rank raises the same
error there, before any collective. Since ranks see the same shapes in the same order, their caches
hold the same graphs.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from autopar.errors import InputError
from autopar.ir.data import DataLayout
from autopar.runtime.base import constant_entry, flatten_inputs, is_constant, spec_children
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

# Per user input: a tensor's shape, or another argument's ``constant_entry``.
ShapeKey = tuple[Any, ...]
# (name, shape, dtype) of each user input, as ``runtime.base.user_metas`` gives them (for an
# argument that is not a tensor: its ``constant_entry`` as the shape, None as the dtype).
Metas = list[tuple[str, Any, Any]]


def shape_key(leaves: list[Any]) -> ShapeKey:
    """The shapes of a call's tensor leaves, and the ``constant_entry`` of its other leaves."""
    return tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else constant_entry(leaf) for leaf in leaves)


# Graphs of other shapes, arguments or values after which a module says that each costs a plan.
MANY_GRAPHS = 16


@functools.lru_cache(maxsize=4096)
def key_number(key: ShapeKey) -> float:
    """A float64-exact number that differs, almost surely, between two shape keys: the same on
    every process for the same key (a digest of its repr; Python's hash of a string is seeded per
    process)."""
    return float(int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=6).digest(), "big"))


# The first entry of the shape key of a call with other arguments than the example's: (this marker,
# the arguments' names, their structure).
_ARGUMENTS = "other arguments"


def call_key(spec: pytree.TreeSpec, leaves: list[Any]) -> ShapeKey:
    """The shape key of a call whose arguments' structure ``spec`` is not the example inputs':
    the structure first, then the shapes."""
    positional, keywords = spec_children(spec)
    names = [f"#{i + 1}" for i in range(positional.num_children)] + list(keywords.context or [])
    return ((_ARGUMENTS, ", ".join(names), str(spec)), *shape_key(leaves))


def is_call_key(key: ShapeKey) -> bool:
    """Whether ``key`` is a ``call_key`` (a call with other arguments than the example's)."""
    return bool(key) and isinstance(key[0], tuple) and len(key[0]) == 3 and key[0][0] == _ARGUMENTS


def relaid(signature: inspect.Signature | None, in_spec: pytree.TreeSpec, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` laid out as the example inputs were passed (``in_spec``), where the call
    passes the same arguments another way (by keyword where the example passed them by position
    or the reverse, keywords in another order); None where it passes others, or where the
    forward's ``signature`` (None: unknown) cannot tell."""
    given = _bound(signature, args, kwargs)
    if given is None:
        return None
    assert signature is not None
    positional_spec, keywords_spec = spec_children(in_spec)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [name for name, p in signature.parameters.items() if p.kind in kinds][: positional_spec.num_children]
    keywords = list(keywords_spec.context or [])
    if len(positional) < positional_spec.num_children or set(given) != {*positional, *keywords}:
        return None
    return tuple(given[name] for name in positional), {key: given[key] for key in keywords}


def _bound(signature: inspect.Signature | None, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The call's arguments by the names of ``signature`` (``**kwargs`` spread), or None where the
    signature is unknown, does not take the call, or takes some of it as ``*args``."""
    if signature is None:
        return None
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return None
    given: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)
        else:
            given[name] = value
    return given


def rank_rows(metas: Metas, layout: DataLayout) -> Metas:
    """``metas`` as a call under ``batch="per_rank"`` passes them: a data-parallel rank's rows of
    each batched input (``layout.inputs``)."""
    return [
        (name, (shape[0] // layout.size, *shape[1:]) if name in layout.inputs else shape, dtype) for name, shape, dtype in metas
    ]


def metas_key(metas: Metas) -> ShapeKey:
    """The shape key a call matching ``metas`` has."""
    return tuple(shape for _, shape, _ in metas)


def check_within(args: tuple, kwargs: dict, traced: TracedModel, metas: Metas, hint: str) -> list[Any]:
    """The call's flat user inputs, once checked against the planned ones (``metas``, the example
    inputs' shapes as a call passes them) for what a graph of its own cannot change: the same
    arguments, dtypes and dims, and no size larger than planned."""
    flat = flatten_inputs(args, kwargs, traced.in_spec, [name for name, _, _ in metas])
    _check_sizes(zip(flat, metas), hint)
    return flat


def check_arguments_within(
    signature: inspect.Signature | None,
    args: tuple,
    kwargs: dict,
    leaves: list[Any],
    traced: TracedModel,
    metas: Metas,
    hint: str,
) -> list[Any]:
    """``check_within`` for a call with other arguments than the example's: its flat ``leaves``,
    once each argument named as a planned input (by the forward's ``signature``) is checked
    against it, as ``check_within`` checks them. A call the forward does not take (an argument it
    requires left out, a keyword it has not) is refused as another layout is, naming the argument."""
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError:
            flatten_inputs(args, kwargs, traced.in_spec, [name for name, _, _ in metas])  # raises, by name
    if kwargs.get("use_cache") is True or kwargs.get("past_key_values") is not None:
        raise InputError(
            "a call passes use_cache=True or past_key_values (a key/value cache), as Hugging Face's generate() "
            "does by default: the compiled module runs graphs that keep no cache. Call generate(..., "
            "use_cache=False), which passes the whole sequence at each step"
        )
    given = _bound(signature, args, kwargs) or {}
    _check_sizes([(given[meta[0]], meta) for meta in metas if meta[0] in given], hint)
    return leaves


def _check_sizes(pairs, hint: str) -> None:
    """InputError for a (value, planned meta) pair of another dtype or dims, or a larger size."""
    for value, (name, shape, dtype) in pairs:
        if shape is None or is_constant(shape) or not isinstance(value, torch.Tensor):
            continue  # another argument's value: a graph of its own
        given = tuple(value.shape)
        if value.dtype != dtype or len(given) != len(shape) or any(g > s for g, s in zip(given, shape)):
            raise InputError(
                f"input {name!r} has shape {given} and dtype {value.dtype}, but this module was planned for "
                f"shape {shape} and dtype {dtype}{hint}: it takes that dtype and any size up to the planned one "
                "in each dim (a smaller batch or a shorter sequence is planned again once per shape). Pass "
                "inputs within the planned shape, or compile again with example inputs of the largest shape"
            )


def examples_of(args: tuple, kwargs: dict, metas: Metas | None, layout: DataLayout) -> tuple[tuple, dict]:
    """Example inputs to trace a call's shapes with: the call's own tensors, detached (a call under
    ``batch="per_rank"`` passes one data-parallel rank's rows: the batched inputs are repeated to
    the whole batch's rows, which the plan splits as before). ``metas``: the planned inputs, which
    the call's leaves are, in order; None for a call with other arguments, whose batched inputs
    are the tensors whose dim 0 has the size of the first one's (``solver.planners.data``'s rule)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    names = iter(name for name, _, _ in metas or [])
    rows = next((leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim()), None)
    made = []
    for leaf in leaves:
        name = next(names, None)
        if isinstance(leaf, torch.Tensor):
            example = leaf.detach().requires_grad_(leaf.requires_grad)
            batched = name in layout.inputs if metas is not None else leaf.dim() > 0 and leaf.shape[0] == rows
            if layout.per_rank and batched and layout.size > 1:
                example = example.repeat(layout.size, *([1] * (example.dim() - 1)))
            leaf = example
        made.append(leaf)
    args, kwargs = pytree.tree_unflatten(made, spec)
    return tuple(args), dict(kwargs)


def timed_build(key: ShapeKey, mode: str, build: Callable[[], Any], cached: int) -> Any:
    """``build()``, with the one log line that says which shapes were planned and how long it took."""
    start = time.perf_counter()
    made = build()
    arguments = f"arguments ({key[0][1]}), " if is_call_key(key) else ""
    shown = key[1:] if arguments else key
    shapes = ", ".join(repr(entry[2]) if is_constant(entry) else str(tuple(entry)) for entry in shown if entry is not None)
    log.info(
        "autopar: traced and planned the %s graph for %sinput shapes %s in %.2f s (%d shapes cached)",
        mode,
        arguments,
        shapes,
        time.perf_counter() - start,
        cached + 1,
    )
    if cached + 1 == MANY_GRAPHS:
        log.warning(
            "autopar: %d graphs traced and planned for calls of other shapes, arguments or values than the example "
            "inputs', each once: every new one costs a trace and a plan. Pad batches to a few lengths (a collator's "
            "pad_to_multiple_of), and pass a value that changes at every call (a step, a temperature) as a tensor",
            MANY_GRAPHS,
        )
    return made
