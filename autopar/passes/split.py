"""The split pass: cut the rewritten graph into the plan's pipeline stages.

``split_into_stages(gm, plan, stages=...)`` carries out ``StagePlan.stage_of()`` with
``torch.fx.passes.split_module``: the result calls ``submod_0`` ... ``submod_{S-1}`` in order,
each a GraphModule that takes the original placeholders it uses (parameters, user inputs) and
the values of earlier stages it reads, under their original node names. Nodes a pass inserted
(collectives) go with the node that consumes them. It chooses nothing.
"""

from __future__ import annotations

import torch.fx
import torch.utils._pytree
from torch.fx.passes.split_module import split_module

from autopar.errors import InternalError
from autopar.ir.pipeline import StagePlan, stage_of_nodes
from autopar.ir.plan import Plan


def return_only(gm: torch.fx.GraphModule, plan: Plan, position: int) -> torch.fx.GraphModule:
    """Return only flat output ``position`` (the loss), and drop what only the other outputs read
    (a Hugging Face model's logits gathered whole): a pipelined call returns the loss."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(output.args[0])
    output.args = ((leaves[position],),)
    gm.graph.eliminate_dead_code()
    return gm


def split_into_stages(gm: torch.fx.GraphModule, plan: Plan, stages: StagePlan) -> torch.fx.GraphModule:
    stage = stage_of_nodes(stages, gm)
    missing = [i for i in range(stages.num_model_stages) if i not in set(stage.values())]
    if missing:
        raise InternalError(f"pipeline stages {missing} hold no node of the graph")
    split = split_module(
        gm,
        gm,
        lambda node: stage[node.name],
        keep_original_node_name=True,
        tuple_return=True,
    )
    return split


def stage_submodule(split: torch.fx.GraphModule, index: int) -> torch.fx.GraphModule:
    return getattr(split, f"submod_{index}")


def stage_io(split: torch.fx.GraphModule, index: int) -> tuple[list[str], list[str]]:
    """(input names, output names) of stage ``index``'s submodule: original node names."""
    sub = stage_submodule(split, index)
    inputs = [str(n.target) for n in sub.graph.nodes if n.op == "placeholder"]
    output = next(n for n in sub.graph.nodes if n.op == "output")
    values = output.args[0]
    values = values if isinstance(values, (tuple, list)) else (values,)
    return inputs, [v.name for v in values]


def stage_wiring(split: torch.fx.GraphModule, graph_inputs: set[str], loss: str, num_stages: int) -> list[list[str]]:
    """What each stage sends to the next: the names (original node names, in graph order) that
    a later stage reads and this stage made or received. Stages only talk to their neighbours,
    so a value read two stages on passes through the stage in between. The last stage sends
    nothing; it returns ``loss``, which it may have to receive."""
    io = [stage_io(split, index) for index in range(num_stages)]
    origin = {name: index for index, (_, outputs) in enumerate(io) for name in outputs}
    sent: list[list[str]] = [[] for _ in range(num_stages)]
    for index, (inputs, outputs) in enumerate(io):
        needed = [name for name in inputs if name not in graph_inputs]
        if index == num_stages - 1 and loss not in outputs:
            needed.append(loss)
        for name in needed:
            for between in range(origin[name], index):
                if name not in sent[between]:
                    sent[between].append(name)
    # Graph order: by the producing stage, then by its outputs' order (split_module keeps it).
    rank = {name: position for position, name in enumerate(origin)}
    return [sorted(names, key=rank.__getitem__) for names in sent]
