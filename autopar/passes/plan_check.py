"""A plan given to ``compile`` is checked against the traced model before anything runs.

``Plan.load`` checks that each placement can hold its tensor on the mesh (``check_placements``),
and ``check_plan_matches`` that the plan was made for this graph. A hand edit can pass both and
still ask for something the rewrite cannot carry out (a parameter sharded where its placeholder
node says replicated, an op whose inputs and outputs no strategy of its rule pairs), which would
fail inside torch at the first call, or compute a wrong result. ``check_plan_strategies`` re-runs
what the solver chose from: every op's input and output specs and kernel must be one of the
strategies its rule offers (``rules.registry.node_strategies``, with the strided blocks the
solver offers), a getitem must pass on its producer's output spec, each parameter's placement
must be its placeholder node's, and tied parameters must agree.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from autopar.errors import PlanError
from autopar.ir.plan import NodePlan, Plan
from autopar.ir.spec import spec_text
from autopar.rules import op_info
from autopar.rules.registry import Strategy, node_strategies, offering_strided, split_blocks
from autopar.solver.problem.padded_casts import padded_cast_strategies
from autopar.trace import TracedModel

_FIX = "The plan was edited or damaged: re-plan (autopar.plan), or set this node to one of the allowed choices"


def check_plan_strategies(plan: Plan, traced: TracedModel) -> None:
    """Raise ``PlanError`` naming the first node, placement and what is allowed where ``plan``
    asks for a choice that the solver could not have made for ``traced`` on its mesh."""
    mesh = plan.spec_mesh
    _check_params(plan, traced)
    with offering_strided(split_blocks(traced.gm)):
        for node in traced.gm.graph.nodes:
            decision = plan.nodes.get(node.name)
            if decision is None or node.op != "call_function":
                continue
            if node.target is operator.getitem:
                _check_getitem(plan, node, decision)
                continue
            strategies = node_strategies(op_info(node), mesh) + list(_padded_cast(plan, node, mesh))
            if not any(_same(decision, strategy) for strategy in strategies):
                raise PlanError(_not_allowed(node, decision, strategies))


def _padded_cast(plan: Plan, node: torch.fx.Node, mesh) -> tuple[Strategy, ...]:
    """A policy's cast of a parameter the plan holds padded: offered the padded piece too
    (``solver.problem.padded_casts``)."""
    inputs = node.all_input_nodes
    producer = plan.nodes.get(inputs[0].name) if len(inputs) == 1 else None
    val = inputs[0].meta.get("val") if producer is not None else None
    if producer is None or not isinstance(val, torch.Tensor) or not producer.outs:
        return ()
    return padded_cast_strategies(node, producer.op, tuple(val.shape), [producer.outs[0]], mesh)


def _same(decision: NodePlan, strategy: Strategy) -> bool:
    return (
        tuple(decision.ins) == tuple(strategy.ins)
        and tuple(decision.outs) == tuple(strategy.outs)
        and decision.kernel == strategy.kernel
        and (decision.kernel is None or tuple(decision.kernel_axes) == tuple(strategy.kernel_axes))
        # which replicated inputs need no gradient all-reduce: an edit here would skip one
        and tuple(map(tuple, decision.whole_grad)) == tuple(map(tuple, strategy.whole_grad))
    )


def _choice_text(ins, outs, kernel) -> str:
    text = f"in {', '.join(spec_text(s) for s in ins) or '()'} -> out {', '.join(spec_text(s) for s in outs)}"
    return f"{text} (kernel {kernel})" if kernel else text


def _not_allowed(node: torch.fx.Node, decision: NodePlan, strategies: list[Strategy], limit: int = 6) -> str:
    allowed = [_choice_text(s.ins, s.outs, s.kernel) for s in strategies]
    shown = "; ".join(allowed[:limit]) + (f"; and {len(allowed) - limit} more" if len(allowed) > limit else "")
    return (
        f"invalid plan: node {node.name!r} ({node.format_node()}) has {_choice_text(decision.ins, decision.outs, decision.kernel)}, "
        f"which no strategy of its rule allows. Allowed: {shown}. {_FIX}"
    )


def _check_getitem(plan: Plan, node: torch.fx.Node, decision: NodePlan) -> None:
    producer, index = node.args
    source = plan.nodes.get(producer.name)
    if source is None or index >= len(source.outs):
        return
    want = source.outs[index]
    if tuple(decision.outs) != (want,) or (decision.ins and tuple(decision.ins) != (want,)):
        raise PlanError(
            f"invalid plan: node {node.name!r} (output {index} of {producer.name!r}) has "
            f"{_choice_text(decision.ins, decision.outs, None)}, but {producer.name!r} gives {spec_text(want)} there, "
            f"and a getitem passes its producer's placement on. Allowed: in {spec_text(want)} -> out {spec_text(want)}. {_FIX}"
        )


def _check_params(plan: Plan, traced: TracedModel) -> None:
    """Each parameter's placement is its placeholder node's, and tied parameters agree."""
    for fqn, canonical in traced.ties.items():
        if fqn in plan.params and canonical in plan.params and plan.params[fqn] != plan.params[canonical]:
            raise PlanError(
                f"invalid plan: parameters {fqn!r} and {canonical!r} are one tensor (tied), but the plan gives them "
                f"{spec_text(plan.params[fqn])} and {spec_text(plan.params[canonical])}. Allowed: one placement for "
                f"both. {_FIX}"
            )

    for graph_input in traced.inputs:
        if graph_input.kind not in ("param", "buffer") or graph_input.fqn not in plan.params:
            continue
        spec = plan.params[graph_input.fqn]
        node = plan.nodes.get(graph_input.name)
        if node is not None and node.outs and tuple(node.outs[0]) != tuple(spec):
            raise PlanError(
                f"invalid plan: parameter {graph_input.fqn!r} has placements {spec_text(spec)}, but its placeholder "
                f"node {graph_input.name!r} has {spec_text(node.outs[0])}: the two must agree. Allowed: "
                f"{spec_text(node.outs[0])} for both, or edit both (and the ops that read it). {_FIX}"
            )


__all__ = ["check_plan_strategies"]
