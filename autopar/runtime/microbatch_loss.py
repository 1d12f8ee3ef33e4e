"""How a pipelined step puts its microbatches' losses together into the whole batch's.

A pipeline computes the model's loss per microbatch. Where that loss is a mean over the batch's
rows, the mean of the microbatch means is the whole batch's mean. A cross entropy (or NLL) with
``reduction="mean"`` is not such a mean: it divides by the number of targets that are not
``ignore_index`` (-100: padding, prompt tokens), which varies between microbatches, so the mean
of the microbatch means differs from eager's whole-batch loss (and so do the gradients). Hugging
Face causal LMs compute their loss this way.

``label_counts`` finds that loss in the traced graph: a mean-reduced
``aten.cross_entropy_loss`` / ``aten.nll_loss*`` whose target comes from the user's inputs by
ops that read no parameter (HF: ``labels`` padded, shifted, flattened). Each call then runs
that chain on every microbatch's inputs and counts its targets ``n_m`` (not ``ignore_index``).
When the model's loss is that mean, scaled by constants only, the pipeline weights microbatch
m's loss by ``M · n_m / N`` (``N = Σ n_m``), so that the step's loss and gradients are eager's
(``torchtitan`` and HF's ``num_items_in_batch`` weight the same way). Equal counts give weights
of exactly 1. Where the counts differ and the loss adds other terms (an auxiliary loss), or a
microbatch has no target at all (its mean is 0/0), the call is refused with the cause. A loss
*summed* over the batch (``reduction="sum"``, as HF's ``num_items_in_batch`` makes it) would
come out as the mean of the microbatch sums: refused when the module is built.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from autopar.errors import InputError, ModelError
from autopar.trace import TracedModel
from autopar.trace.attention import ancestors

aten = torch.ops.aten

# Losses that reduce over their targets; ``reduction``: 0 none, 1 mean, 2 sum.
_TARGET_LOSSES = {
    aten.cross_entropy_loss.default,
    aten.nll_loss.default,
    aten.nll_loss_nd.default,
    aten.nll_loss_forward.default,
    aten.nll_loss2d.default,
    aten.nll_loss2d_forward.default,
}
# Ops between that loss and the model's loss that keep it "the mean, times a constant".
_KEEPS_MEAN = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.mul.Scalar,
    aten.div.Scalar,
}


@dataclass
class LabelCounts:
    """The target chain of a mean-reduced loss, and whether the model's loss is that mean alone."""

    chain: torch.fx.GraphModule  # user inputs (in graph order) -> the loss's target
    ignore_index: int
    loss: str  # the op, for messages
    alone: bool  # the model's loss is this mean, scaled by constants

    def weights(self, user_inputs: list[Any], num_microbatches: int) -> list[float]:
        """Each microbatch's loss weight ``M · n_m / N`` (module docstring), or a ValueError."""
        M = num_microbatches
        chunks = [torch.tensor_split(v, M) if isinstance(v, torch.Tensor) and v.dim() else [v] * M for v in user_inputs]
        with torch.no_grad():
            counts = [int((self.chain(*[c[m] for c in chunks]) != self.ignore_index).sum()) for m in range(M)]
        total = sum(counts)
        if total == 0 or len(set(counts)) == 1:  # no target anywhere (eager's loss is NaN too), or even
            return [1.0] * M
        if not self.alone:
            raise InputError(
                f"this step's {M} microbatches hold {counts} targets other than ignore_index ({self.ignore_index}), "
                f"and the model's loss is {self.loss}'s mean over them combined with other terms, so no weighting of "
                "the microbatch losses gives eager's whole-batch loss: give every microbatch the same number of "
                "targets (spread the ignored ones evenly), or compile without a pipeline"
            )
        if 0 in counts:
            raise InputError(
                f"microbatch {counts.index(0)} of this step holds no target other than ignore_index "
                f"({self.ignore_index}) (counts {counts}): its mean loss is 0/0, NaN, where eager's whole-batch mean "
                "skips it. Give every microbatch at least one target (reorder the batch's rows), or use fewer microbatches"
            )
        return [M * n / total for n in counts]


def label_counts(traced: TracedModel, loss_node: torch.fx.Node) -> LabelCounts | None:
    """The counter for ``loss_node``'s mean-reduced target loss (module docstring), or None where
    the loss has none whose target the inputs give. Raises for a loss summed over its targets."""
    needed = ancestors([loss_node])
    found = [n for n in loss_node.graph.nodes if n in needed and n.op == "call_function" and n.target in _TARGET_LOSSES]
    user = [gi.name for gi in traced.inputs if gi.kind == "user"]
    counters = []
    for node in found:
        args = normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs
        reduction, ignore_index = int(args.get("reduction", 1)), int(args.get("ignore_index", -100))
        if reduction == 2:
            raise ModelError(
                f"this pipelined model's loss sums {node.target} over its targets (reduction='sum', as Hugging Face "
                "models compute it when given num_items_in_batch): a pipeline would return the mean of the "
                "microbatch sums, 1/M of eager's. Use the mean (drop num_items_in_batch: the pipeline weights each "
                "microbatch by its count of targets), or compile without a pipeline"
            )
        target = args.get("target")
        if reduction != 1 or args.get("weight") is not None or not isinstance(target, torch.fx.Node):
            continue
        chain = _chain(traced.gm, target, user)
        if chain is not None and not _is_floating(target):
            counters.append((node, chain, ignore_index))
    if len(counters) != 1 or len(found) != 1:
        return None if not counters else LabelCounts(counters[0][1], counters[0][2], str(counters[0][0].target), False)
    node, chain, ignore_index = counters[0]
    return LabelCounts(chain, ignore_index, str(node.target), _scales_only(loss_node, node))


def _chain(gm: torch.fx.GraphModule, target: torch.fx.Node, user: list[str]) -> torch.fx.GraphModule | None:
    """A graph from the user inputs to ``target``, or None where ``target`` reads anything else."""
    needed = ancestors([target])
    if any(n.op == "placeholder" and n.name not in user or n.op not in ("placeholder", "call_function") for n in needed):
        return None
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for name in user:
        made = graph.placeholder(name)
        if placeholders[name] in needed:
            env[placeholders[name]] = made
    for n in gm.graph.nodes:
        if n in needed and n.op == "call_function":
            env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[target])
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _is_floating(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()  # class probabilities: no ignore_index


def _scales_only(loss: torch.fx.Node, mean: torch.fx.Node) -> bool:
    """Whether ``loss`` is ``mean`` (its first output) through ops that only scale it by constants."""
    node = loss
    while node is not mean:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            return not (node.args[0] is not mean or node.args[1] != 0)
        if node.target not in _KEEPS_MEAN:
            return False
        tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if len(tensors) != 1 or node.args[0] is not tensors[0] and node.target in (aten.div.Tensor, aten.div.Scalar):
            return False
        node = tensors[0]
    return True
