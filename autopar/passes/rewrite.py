"""Passes that carry out a plan on the traced graph. None of them chooses anything.

- ``localize_shapes``: size arguments (view, reshape, expand, ...) become local sizes.
- ``use_kernels``: ops whose chosen strategy names a kernel call that kernel instead; custom ops
  with a differentiable eager implementation (``ops.kernels.EAGER_IMPLEMENTATIONS``) call it;
  attention whose mask is computed from the graph's inputs (a padding mask from the batch)
  attends causally where the mask, at run time, is only causal (``ops.causal_mask``).
- ``insert_collectives``: wherever a producer's spec differs from what its consumer takes, the
  steps of ``spec.transition_steps`` are inserted as explicit collective nodes; where an
  replicated input feeds a split computation, an ``allreduce_grad`` node is inserted so the
  input's gradient is summed in backward (``solver.problem.op_prices.grad_sync_axes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from autopar.ir.plan import NodePlan, Plan
from autopar.ir.spec import local_shape, transition_steps
from autopar.ops import collectives, get_kernel
from autopar.ops.causal_mask import attention_causal_when_it_is
from autopar.ops.kernels import EAGER_IMPLEMENTATIONS
from autopar.rules.registry import SIZE_ARGS, Strategy, localize_kwargs, normalized_kwargs, tensor_meta
from autopar.solver.problem.op_prices import grad_sync_axes
from autopar.trace import requires_grad
from autopar.trace.attention import ancestors

# Views become reshapes: export drops a .contiguous() when the traced tensor happened to be
# contiguous, but a resharded local tensor may not be, and then view() fails. reshape() is the
# same view wherever a view is possible, and copies only where view() would raise.
_VIEW_TO_RESHAPE = {torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


# Ops besides SIZE_ARGS whose size arguments ``localize_kwargs`` rewrites.
_LOCAL_SIZE_OPS = {
    torch.ops.aten.unflatten.int,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
}


def localize_shapes(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _VIEW_TO_RESHAPE:
            node.target = torch.ops.aten.reshape.default
        if node.target not in SIZE_ARGS and node.target not in _LOCAL_SIZE_OPS:
            continue
        decision = plan.nodes[node.name]
        local = local_shape(decision.shapes[0], decision.outs[0], plan.mesh_shape)
        kw = normalized_kwargs(node)
        _set_arguments(node, localize_kwargs(node.target, kw, local))
    return gm


def use_kernels(gm: torch.fx.GraphModule, plan: Plan, groups: Sequence[str]) -> torch.fx.GraphModule:
    for node in gm.graph.nodes:
        decision = plan.nodes.get(node.name)
        if node.op != "call_function" or decision is None:
            continue
        if decision.kernel is None:
            if node.target in EAGER_IMPLEMENTATIONS:
                node.target = EAGER_IMPLEMENTATIONS[node.target]
            elif node.target is torch.ops.aten.scaled_dot_product_attention.default and _mask_from_data(node):
                node.target = attention_causal_when_it_is
            continue
        kernel = get_kernel(decision.kernel)
        kw = normalized_kwargs(node)
        kw["axis_groups"] = tuple(groups[axis] for axis in decision.kernel_axes)
        node.target = kernel
        node.args = ()
        node.kwargs = kw
    return gm


def _mask_from_data(node: torch.fx.Node) -> bool:
    """Whether the SDPA call ``node`` passes a mask computed from the graph's inputs (the
    placeholders: the batch, or a buffer), not causal already: one that ``trace.attention``
    could not prove causal, which a call may still find causal (``ops.causal_mask``)."""
    kw = normalized_kwargs(node)
    mask = kw.get("attn_mask")
    if not isinstance(mask, torch.fx.Node) or kw.get("is_causal"):
        return False
    return any(value.op == "placeholder" for value in ancestors([mask]))


def insert_collectives(gm: torch.fx.GraphModule, plan: Plan, groups: Sequence[str]) -> torch.fx.GraphModule:
    graph = gm.graph
    nodes = {node.name: node for node in graph.nodes}
    for node in list(graph.nodes):
        decision = plan.nodes.get(node.name)
        if decision is None or node.op == "placeholder" or not decision.inputs:
            continue
        replacements: list[torch.fx.Node] = []
        for index, ((producer, out_index), dst) in enumerate(zip(decision.inputs, decision.ins)):
            source = nodes[producer]
            src = plan.nodes[producer].outs[out_index]
            value = source
            if out_index:
                # getitem follows its tuple-valued producer: nothing to move.
                assert src == dst, f"getitem {node.name} must take {producer}[{out_index}] as it is"
                replacements.append(value)
                continue
            steps = transition_steps(src, dst)
            if steps is None:
                raise AssertionError(f"plan asks for impossible transition {src} → {dst} into {node.name}")
            # A collective over a mesh axis of size 1 is the identity (and priced at 0): skip it.
            with graph.inserting_before(node):
                for step in steps:
                    if plan.mesh_shape[step.axis] > 1:
                        value = _step_node(graph, value, step, groups)
                if requires_grad(source) and node.op != "output":
                    strategy = Strategy(decision.ins, decision.outs, whole_grad=decision.whole_grad)
                    for axis in grad_sync_axes(strategy, index):
                        if plan.mesh_shape[axis] > 1:
                            value = graph.call_function(collectives.allreduce_grad, (value, groups[axis]))
            replacements.append(value)
        if any(r is not nodes[p] for r, (p, _) in zip(replacements, decision.inputs)):
            _replace_tensor_inputs(node, replacements)
    return gm


def _step_node(graph: torch.fx.Graph, value: torch.fx.Node, step, groups: Sequence[str]) -> torch.fx.Node:
    group = groups[step.axis]
    if step.kind == "all_reduce":
        return graph.call_function(collectives.all_reduce, (value, group))
    if step.kind == "all_gather":
        extra = (step.blocks,) if step.blocks > 1 else ()
        return graph.call_function(collectives.all_gather, (value, step.dim, group, *extra))
    if step.kind == "chunk":
        extra = (step.blocks,) if step.blocks > 1 else ()
        return graph.call_function(collectives.chunk, (value, step.dim, group, *extra))
    if step.kind == "reduce_scatter":
        return graph.call_function(collectives.reduce_scatter, (value, step.dim, group))
    if step.kind == "all_to_all":
        return graph.call_function(collectives.all_to_all, (value, step.src_dim, step.dim, group))
    raise AssertionError(f"unknown step {step}")


def _replace_tensor_inputs(node: torch.fx.Node, replacements: list[torch.fx.Node]) -> None:
    """Swap the tensor inputs of ``node`` (in OpInfo order) for ``replacements``."""
    position = iter(replacements)

    def swap(value: Any) -> Any:
        if isinstance(value, torch.fx.Node):
            if tensor_meta(value.meta.get("val")) is not None:
                return next(position)
            return value
        if isinstance(value, (list, tuple)):
            return type(value)(swap(v) for v in value)
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        return value

    if node.op == "output" or not isinstance(node.target, torch._ops.OpOverload):
        if node.op == "call_function" and getattr(node.target, "__autopar_kernel__", None):
            node.kwargs = swap(dict(node.kwargs))
            return
        node.args = swap(node.args)
        node.kwargs = swap(dict(node.kwargs))
        return
    _set_arguments(node, {k: swap(v) for k, v in normalized_kwargs(node).items()})


def _set_arguments(node: torch.fx.Node, kw: dict[str, Any]) -> None:
    """Write schema-named arguments back as positional args (and kwarg-only as kwargs)."""
    args, kwargs = [], {}
    for arg in node.target._schema.arguments:
        if arg.kwarg_only:
            if arg.name in node.kwargs or kw[arg.name] != (arg.default_value if arg.has_default_value() else None):
                kwargs[arg.name] = kw[arg.name]
        else:
            args.append(kw[arg.name])
    node.args = tuple(args)
    node.kwargs = kwargs


__all__ = ["localize_shapes", "use_kernels", "insert_collectives", "NodePlan"]
