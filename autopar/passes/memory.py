"""Carry out a plan's memory decisions (``plan.memory``): fetch offloaded parameters at their
uses, run segments whose activations are offloaded under the offloader's saved-tensor hooks, and
wrap checkpointed segments in ``torch.utils.checkpoint`` (non-reentrant; a "selective" segment
with torch's selective checkpoint contexts, which keep the outputs of ``ir.memory.SELECTIVE_KEEPS``;
a "selective-op" one with torchtitan's op-level policy, ``_SelectiveOpPolicy``).

Both passes leave a graph without memory decisions as it is. Offload runs before checkpointing,
so that a fetch whose uses all lie in a checkpointed segment moves into it (and is fetched again
by the recompute instead of being kept as the segment's input).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx
import torch.utils.checkpoint

from autopar.errors import InternalError, PlanError
from autopar.ir.memory import selective_keeps, selective_op_role
from autopar.ir.plan import Plan
from autopar.passes.precision import is_param_cast
from autopar.passes.schedule import PARAM_GATHERS

OFFLOADER = "offload"  # the Offloader's attribute name in the rewritten graph module


def offload_params(
    gm: torch.fx.GraphModule, plan: Plan, offloader=None, fqns: Mapping[str, str] | None = None
) -> torch.fx.GraphModule:
    """Before every use of an offloaded parameter's placeholder, insert a fetch from the store
    (``gm.offload``), with the next fetch in graph order as its prefetch. ``fqns`` maps
    placeholder names to canonical parameter FQNs.

    A use that is the parameter's cast to the compute dtype (a precision policy's master weights)
    becomes the fetch itself, in that dtype (the store keeps that copy: ``runtime.offload``), and
    each later use of the cast gets a fetch of its own, so no cast copy stays on the device
    between uses. The cast node keeps its name: the plan may name it (a checkpoint segment's
    first node)."""
    if plan.memory is None or not plan.memory.offloaded("param"):
        return gm
    if offloader is None or fqns is None:
        raise InternalError("the plan offloads parameters, but compile gave the offload pass no Offloader")
    gm.add_submodule(OFFLOADER, offloader)
    offloaded = set(plan.memory.offloaded("param"))
    for placeholder in [n for n in gm.graph.nodes if n.op == "placeholder" and fqns.get(n.name) in offloaded]:
        fqn = fqns[placeholder.name]
        for user in list(placeholder.users):
            if _is_plain_cast(user):
                _cast_into_fetches(gm, user, fqn)
            else:
                _insert_fetch(gm, user, placeholder, placeholder, fqn, None)
    fetches = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == OFFLOADER]
    keys = [(n.kwargs["key"], n.kwargs.get("dtype")) for n in fetches]
    for k, fetch in enumerate(fetches):
        following = keys[k + 1] if plan.memory.prefetch and k + 1 < len(fetches) else (None, None)
        kwargs = {"key": keys[k][0], "next_key": following[0]}
        # dtypes only where a fetch is cast: a graph without a precision policy reads as before
        kwargs.update({name: dtype for name, dtype in (("dtype", keys[k][1]), ("next_dtype", following[1])) if dtype is not None})
        fetch.kwargs = kwargs
    offloader.previous = {keys[k]: keys[k - 1] for k in range(1, len(keys))}
    return gm


def _is_plain_cast(node: torch.fx.Node) -> bool:
    """A precision policy's cast of a parameter, with nothing but its dtype to carry out."""
    return is_param_cast(node) and set(node.kwargs) == {"dtype"} and len(node.args) == 1


def _insert_fetch(gm, user: torch.fx.Node, replaced: torch.fx.Node, placeholder: torch.fx.Node, fqn: str, dtype) -> None:
    """A fetch of ``fqn`` (in ``dtype``) right before ``user``, which reads it instead of ``replaced``."""
    with gm.graph.inserting_before(user):
        fetch = gm.graph.call_module(OFFLOADER, (placeholder,), {"key": fqn, "dtype": dtype})
    fetch.meta = dict(replaced.meta)
    user.replace_input_with(replaced, fetch)


def _cast_into_fetches(gm: torch.fx.GraphModule, cast: torch.fx.Node, fqn: str) -> None:
    """``cast`` becomes a fetch in its dtype, read by its first use; each later use gets its own."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    later = sorted(cast.users, key=order.__getitem__)[1:]
    (placeholder,) = cast.args
    dtype = cast.kwargs["dtype"]
    for user in later:
        _insert_fetch(gm, user, cast, placeholder, fqn, dtype)
    cast.op, cast.target, cast.kwargs = "call_module", OFFLOADER, {"key": fqn, "dtype": dtype}


class Checkpointed(torch.nn.Module):
    """A segment of the graph, recomputed in backward (``torch.utils.checkpoint``, non-reentrant):
    all of it under ``policy`` "full"; under "selective", all but the ops whose outputs
    ``ir.memory.selective_keeps``, which torch caches from forward (``create_selective_checkpoint_contexts``);
    under "selective-op", all but attention and every other matmul (``_SelectiveOpPolicy``)."""

    def __init__(self, body: torch.fx.GraphModule, policy: str = "full"):
        super().__init__()
        self.body = body
        self.policy = policy
        if policy in _SELECTIVE_CONTEXTS:
            for target in {n.target for n in body.graph.nodes if n.op == "call_module" and n.target in _REPLAYED_ELSEWISE}:
                setattr(body, target, _OutsideSelective(getattr(body, target)))

    def forward(self, *args):
        contexts = _SELECTIVE_CONTEXTS.get(self.policy)
        if contexts is not None:
            return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False, context_fn=contexts)
        return torch.utils.checkpoint.checkpoint(self.body, *args, use_reentrant=False)


# Submodules that run other ops in a checkpoint's recompute than in forward: parameter gathers
# (prefetched ahead in forward, gathered in place in the recompute) and offload fetches.
_REPLAYED_ELSEWISE = (PARAM_GATHERS, OFFLOADER)


class _OutsideSelective(torch.nn.Module):
    """A gather or fetch inside a selective segment, run outside torch's dispatch modes: the
    selective checkpoint replays forward's sequence of ops from its cache in the recompute, and
    fails on an op forward did not run; outside, the recompute simply runs it again (as a
    "full" segment does), and its output is never cached."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        with torch.utils._python_dispatch._disable_current_modes():
            return self.inner(*args, **kwargs)


def _selective_policy(ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy:
    """torch's selective checkpoint policy of a "selective" segment: keep matmul and attention
    outputs, recompute the rest. MUST, not PREFER: torch.compile would otherwise be free to
    choose differently from what the plan priced."""
    if selective_keeps(op):
        return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


class _SelectiveOpPolicy:
    """torchtitan's op-level policy for one call of a "selective-op" segment: keep attention and
    the 1st, 3rd, 5th ... matmul (``ir.memory.selective_op_role``), recompute the rest. Forward
    and the recompute count their matmuls apart, so both make the same choice for the same op
    (torch's selective checkpoint replays forward's cache by position). A fresh one per call:
    the count starts again at every layer, as the planner prices it (``ir.memory.selective_op_kept``)."""

    def __init__(self):
        self.counts = {False: 0, True: 0}  # matmuls seen, by ctx.is_recompute

    def __call__(self, ctx, op, *args, **kwargs) -> torch.utils.checkpoint.CheckpointPolicy:
        role = selective_op_role(op)
        if role == "matmul":
            self.counts[ctx.is_recompute] += 1
        if role == "keep" or (role == "matmul" and self.counts[ctx.is_recompute] % 2 == 1):
            return torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
        return torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective_op_contexts():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_SelectiveOpPolicy())


# The context functions of the selective policies, by name; a policy not here ("full") has none.
_SELECTIVE_CONTEXTS = {
    "selective": lambda: torch.utils.checkpoint.create_selective_checkpoint_contexts(_selective_policy),
    "selective-op": _selective_op_contexts,
}


class OffloadedActivations(torch.nn.Module):
    """A segment of the graph whose saved activations go to the offload store in forward and come
    back in backward (``Offloader.activation_hooks``)."""

    def __init__(self, body: torch.fx.GraphModule, offloader, name: str, previous: str | None):
        super().__init__()
        self.body = body
        self.name, self.previous = name, previous
        self._offloader = [offloader]  # not a submodule: the graph module holds it once

    def forward(self, *args):
        with self._offloader[0].activation_hooks(self.name, self.previous):
            return self.body(*args)


def offload_activations(gm: torch.fx.GraphModule, plan: Plan, offloader=None) -> torch.fx.GraphModule:
    """Outline each segment of ``plan.memory.offload_activations`` into an
    ``OffloadedActivations`` submodule; in backward each one prefetches the segment before it."""
    if plan.memory is None or not plan.memory.offload_activations:
        return gm
    if offloader is None:
        raise InternalError("the plan offloads activations, but compile gave the offload pass no Offloader")
    previous = None
    for index, segment in enumerate(plan.memory.offload_activations):
        nodes = _segment_nodes(gm, segment.first, segment.last)
        _outline(
            gm,
            nodes,
            f"offloaded_{index}",
            lambda body, name=segment.name, before=previous: OffloadedActivations(body, offloader, name, before),
        )
        previous = segment.name
    gm.graph.eliminate_dead_code()
    return gm


def checkpoint_segments(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Outline each segment of ``plan.memory.checkpoint`` into a ``Checkpointed`` submodule."""
    if plan.memory is None or not plan.memory.checkpoint:
        return gm
    for index, segment in enumerate(plan.memory.checkpoint):
        nodes = _segment_nodes(gm, segment.first, segment.last)
        _outline(gm, nodes, f"checkpoint_{index}", lambda body, policy=segment.policy: Checkpointed(body, policy))
    gm.graph.eliminate_dead_code()
    return gm


def _segment_nodes(gm: torch.fx.GraphModule, first: str, last: str) -> list[torch.fx.Node]:
    listed = list(gm.graph.nodes)
    names = {node.name: i for i, node in enumerate(listed)}
    if first not in names or last not in names:
        missing = first if first not in names else last
        raise PlanError(
            f"checkpoint segment {first} .. {last}: node {missing} is not in the rewritten graph: re-plan for this model"
        )
    start, end = names[first], names[last]
    nodes = [n for n in listed[start : end + 1] if n.op not in ("placeholder", "output")]
    inside = set(nodes)
    # Fetches and parameter gathers right before the segment whose every use is inside: the
    # recompute fetches or gathers them again, instead of the segment keeping them as inputs.
    while start > 0:
        candidate = listed[start - 1]
        if (
            candidate.op != "call_module"
            or candidate.target not in (OFFLOADER, PARAM_GATHERS)
            or not set(candidate.users) <= inside
        ):
            break
        nodes.insert(0, candidate)
        inside.add(candidate)
        start -= 1
    return nodes


def _outline(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], name: str, wrap=None) -> None:
    inside = set(nodes)
    inputs: list[torch.fx.Node] = []
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [node for node in nodes if any(user not in inside for user in node.users)]
    body = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for arg in inputs:
        env[arg] = body.placeholder(arg.name)
        env[arg].meta = dict(arg.meta)
    for node in nodes:
        env[node] = body.node_copy(node, lambda arg: env[arg])
    body.output(tuple(env[node] for node in outputs))
    gm.add_submodule(name, (wrap or Checkpointed)(torch.fx.GraphModule(gm, body)))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        for k, node in enumerate(outputs):
            item = gm.graph.call_function(operator.getitem, (call, k))
            item.meta = dict(node.meta)
            # The name it stands for, which plans (and a pipeline's stage wiring) know it by.
            item.meta["autopar"] = {**node.meta.get("autopar", {}), "outlined_from": node.name}
            for user in list(node.users):
                if user not in inside:
                    user.replace_input_with(node, item)
    for node in reversed(nodes):
        gm.graph.erase_node(node)


__all__ = ["offload_params", "offload_activations", "checkpoint_segments", "Checkpointed", "OffloadedActivations", "OFFLOADER"]
