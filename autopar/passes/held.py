"""The held-parameter pass of a pipeline: a parameter's collectives once a step, not per microbatch.

A pipelined step runs each stage's graph once per microbatch. Where a parameter is replicated on
a stage-mesh axis, its use reads ``allreduce_grad(param)`` (the precision policy's cast first,
where there is one): every microbatch's backward would all-reduce its gradient. This pass takes
such chains out of the graph (the nodes that compute from the parameter and constants alone:
casts, ``allreduce_grad``, a position table's lookup): each chain's last value becomes a new
placeholder, ``held_<node>``, and ``HeldChains`` keeps the chain as a small graph of its own,
which the runtime runs once a step (``runtime.pipeline``). Every microbatch reads one detached
leaf of it; their gradients sum in that leaf, and one backward through the chain at the end of
the step reduces the sum, as DDP's ``no_sync`` and torchtitan's pipeline stages do. The cost
model prices that sync once a step (``solver.planners.stage_costs``).

A parameter sharded on a stage-mesh axis (FSDP) is gathered by ``all_gather`` and its gradient
summed by ``allreduce_grad``: the pair becomes ``gather_param``, whose backward reduce-scatters
(half the bytes of an all-reduce and a chunk), or, under a precision policy, ``gather_cast_param``
(FSDP2's mixed precision: the master's cast gathered, the gradient reduced in ``reduce_dtype``);
gathered on several axes, each axis's pair alike. Under ``StagePlan.hold_gathered`` its chain (every
gather of it) is held too: gathered once a step and kept whole through every microbatch, its
gradient summed whole and reduce-scattered once (torchtitan's FSDP under a pipeline, which the stage planner prices and
chooses where it pays); otherwise it is gathered and reduced in each microbatch. A chain of casts
alone stays in the graph (holding its copy all step would cost memory nothing prices). Under ZBV,
whose schedule computes weight gradients for the stage module's parameters only, the pass is not
run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx

from autopar.ir.plan import Plan
from autopar.ops import collectives
from autopar.trace import is_param_cast

HELD_PREFIX = "held_"
_GATHERS = (collectives.gather_param, collectives.gather_cast_param)


@dataclass
class HeldChains:
    """What ``hold_param_collectives`` took out of the graph: for each new placeholder, the
    parameter placeholder it starts from and the chain's graph (one input, one output)."""

    params: frozenset[str]  # the names of the parameter placeholders the pass may hold
    gathers: bool = False  # hold gathered parameters too (``StagePlan.hold_gathered``)
    chains: dict[str, tuple[str, torch.fx.GraphModule]] = field(default_factory=dict)

    def collectives(self) -> tuple:
        """The collectives a held chain may run."""
        return (collectives.allreduce_grad, collectives.all_gather, *_GATHERS) if self.gathers else (collectives.allreduce_grad,)

    def source(self, name: str) -> str:
        """The parameter placeholder that held placeholder ``name`` is computed from (``name``
        itself where it is not held)."""
        return self.chains[name][0] if name in self.chains else name


class DirectSync(NamedTuple):
    """How a held chain's backward reduces its parameter's gradient, where that is all it does
    (``direct_sync``), in ``dtype`` (None: the summed gradient's): ``all_reduce`` over each of
    ``groups`` (bucketed with the others of the same groups), or ``scatter``: ``steps`` in
    order, each ``("reduce_scatter", group, dim)``, ``("chunk", group, dim, blocks)`` or
    ``("all_reduce", group)`` (the backward of a gather on several axes)."""

    kind: str
    groups: tuple[str, ...]
    dtype: torch.dtype | None
    steps: tuple[tuple, ...] = ()


_SUMS = (collectives.allreduce_grad, *_GATHERS)


def direct_sync(chain: torch.fx.GraphModule) -> DirectSync | None:
    """How ``chain``'s backward reduces its parameter's gradient where it does nothing else
    (``allreduce_grad`` over each group, or gathers with the sums of some of their axes, in one
    reduce dtype, with a precision policy's cast before or after): the runtime runs it on the
    step's summed gradient directly, without rounding the sum to the value's dtype first, the
    all-reduces in buckets (``runtime.pipeline``). None for any other chain."""
    calls = [n for n in chain.graph.nodes if n.op == "call_function"]
    if calls and is_param_cast(calls[0]):
        calls = calls[1:]
    elif calls and is_param_cast(calls[-1]):
        calls = calls[:-1]
    if not calls or any(n.target not in (*_SUMS, collectives.all_gather) for n in calls):
        return None
    dtypes = {_reduce_dtype(n) for n in calls if n.target in _SUMS}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    if all(n.target is collectives.allreduce_grad for n in calls):
        return DirectSync("all_reduce", tuple(n.args[1] for n in calls), dtype)
    steps = []
    for node in reversed(calls):  # the backward's order
        if node.target is collectives.allreduce_grad:
            steps.append(("all_reduce", node.args[1]))
        elif node.target is collectives.all_gather:
            steps.append(("chunk", node.args[2], node.args[1], node.args[3] if len(node.args) > 3 else 1))
        else:
            steps.append(("reduce_scatter", node.args[2], node.args[1]))
    return DirectSync("scatter", (), dtype, tuple(steps))


def _pure(node: torch.fx.Node, held: tuple = (collectives.allreduce_grad,)) -> bool:
    """A call that only computes one tensor (no random draw, no write to its inputs), or one of
    the ``held`` collectives."""
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        return (
            not schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags
            and [str(r.type) for r in schema.returns] == ["Tensor"]
        )
    return target in held


def _constant(node: torch.fx.Node, known: dict[torch.fx.Node, bool]) -> bool:
    """Whether ``node`` holds the same value in every microbatch without reading an input (an
    ``arange`` of positions, a tensor attribute)."""
    if node not in known:
        known[node] = node.op == "get_attr" or (_pure(node) and all(_constant(n, known) for n in node.all_input_nodes))
    return known[node]


def _chain(placeholder: torch.fx.Node, order: dict[torch.fx.Node, int], keep: set[str], held: tuple) -> list[torch.fx.Node]:
    """The nodes that compute from ``placeholder`` and constants alone (the precision policy's
    cast, ``allreduce_grad``, a position embedding's lookup), in graph order; none named in
    ``keep`` (the bounds of the memory plan's segments, which must stay in the graph)."""
    members: set[torch.fx.Node] = set()
    known: dict[torch.fx.Node, bool] = {}
    frontier = [placeholder]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user in members or user.name in keep or not _pure(user, held):
                continue
            if all(n is placeholder or n in members or _constant(n, known) for n in user.all_input_nodes):
                members.add(user)
                frontier.append(user)
    return sorted(members, key=order.__getitem__)


def _chain_module(
    gm: torch.fx.GraphModule, placeholder: torch.fx.Node, end: torch.fx.Node, order: dict[torch.fx.Node, int]
) -> torch.fx.GraphModule:
    """The graph that computes ``end`` from ``placeholder``: the nodes ``end`` reads, copied."""
    needed: set[torch.fx.Node] = set()
    stack = [end]
    while stack:
        node = stack.pop()
        if node is not placeholder and node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    graph = torch.fx.Graph()
    env = {placeholder: graph.placeholder(placeholder.name)}
    for node in sorted(needed, key=order.__getitem__):
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(env[end])
    return torch.fx.GraphModule(gm, graph)


def _dead_aliases(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [user for user in node.users if not user.users and user.target is torch.ops.aten.alias.default]


def _gathers_then_sums(first: torch.fx.Node) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """The ``all_gather``s in a row from ``first`` (one live user each: a parameter gathered on
    several axes), then the ``allreduce_grad``s in a row after them."""
    gathers, node = [first], first
    while True:
        users = [user for user in node.users if user not in _dead_aliases(node)]
        if len(users) != 1:
            return gathers, []
        (node,) = users
        if node.target is not collectives.all_gather or len(node.args) != 3:
            break
        gathers.append(node)
    sums = []
    while node.target is collectives.allreduce_grad:
        sums.append(node)
        if len(node.users) != 1:
            break
        (node,) = node.users
    return gathers, sums


def _reduce_dtype(summed: torch.fx.Node):
    """The dtype the gradient of ``summed`` (``allreduce_grad`` or a gather's pair) is reduced in."""
    position = 2 if summed.target is collectives.allreduce_grad else 3
    return summed.args[position] if len(summed.args) > position else summed.kwargs.get("reduce_dtype")


def _pair_gathers(graph: torch.fx.Graph, params: frozenset[str], keep: set[str]) -> None:
    """A parameter's ``all_gather`` on an axis whose gradient is then summed on the same axis
    becomes ``gather_param``: the reduce-scatter FSDP runs in backward, where the pair all-reduced
    the whole gradient and kept this rank's chunk (twice the bytes); ``gather_cast_param`` where a
    precision policy's cast of the master follows the sums (the cast is gathered, half the bytes).
    On several axes each pair is made alike (a sum commutes with another axis's chunk), and a
    gather with no sum on its axis stays (its backward takes the chunk). Unused aliases of the
    gathers (the cast, moved past them) go with them, unless ``keep`` names them."""
    gone: set[torch.fx.Node] = set()  # the later gathers of a chain, paired with the first
    for node in list(graph.nodes):
        if node in gone or not (node.op == "call_function" and node.target is collectives.all_gather and len(node.args) == 3):
            continue
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and is_param_cast(source):
            source = source.all_input_nodes[0]
        if not (isinstance(source, torch.fx.Node) and source.op == "placeholder" and source.name in params):
            continue
        gathers, sums = _gathers_then_sums(node)
        by_group = {summed.args[1]: summed for summed in reversed(sums)}
        pairs = [(gather, by_group[gather.args[2]]) for gather in gathers if gather.args[2] in by_group]
        dead = [alias for gather in gathers for alias in _dead_aliases(gather)]
        if not pairs or len({_reduce_dtype(summed) for summed in sums}) != 1 or any(a.name in keep for a in dead):
            continue
        for alias in dead:
            graph.erase_node(alias)
        reduce_dtype = _reduce_dtype(sums[0])
        (cast,) = sums[-1].users if len(sums[-1].users) == 1 else (None,)
        # the cast goes before the gathers where its backward (into the master's dtype) stays the
        # last: one pair, the first gather's, and no other sum (each sums in its input's dtype)
        fuse = len(pairs) == len(sums) == 1 and pairs[0][0] is node and node.args[0] is source
        if not (fuse and cast is not None and is_param_cast(cast) and cast.name not in keep):
            cast = None
        for gather, summed in pairs:
            summed.replace_all_uses_with(summed.args[0])
            graph.erase_node(summed)
            with graph.inserting_before(gather):
                if cast is not None and gather is node:  # the master gathered, then cast: gather the cast (FSDP2's param_dtype)
                    paired = graph.call_function(
                        collectives.gather_cast_param, (*gather.args, reduce_dtype, cast.kwargs["dtype"])
                    )
                else:
                    paired = graph.call_function(collectives.gather_param, (*gather.args, reduce_dtype))
            paired.meta = {**gather.meta, **summed.meta}
            gather.replace_all_uses_with(paired)
            graph.erase_node(gather)
            gone.add(gather)
        if cast is not None:
            cast.replace_all_uses_with(cast.args[0])
            cast.args[0].meta = {key: value for key, value in cast.meta.items() if key != "autopar"}
            graph.erase_node(cast)


def hold_param_collectives(gm: torch.fx.GraphModule, plan: Plan, held: HeldChains) -> torch.fx.GraphModule:
    """Pair each parameter's gather with its gradient's sum (``_pair_gathers``), then replace
    each parameter's chain of casts and held collectives (one at least) by new placeholders for
    its ends, and record the chains in ``held`` (module docstring)."""
    graph = gm.graph
    segments = (*plan.memory.checkpoint, *plan.memory.offload_activations) if plan.memory is not None else ()
    keep = {name for segment in segments for name in (segment.first, segment.last)}
    _pair_gathers(graph, held.params, keep)
    order = {node: i for i, node in enumerate(graph.nodes)}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    for placeholder in placeholders:
        if placeholder.name not in held.params:
            continue
        members = _chain(placeholder, order, keep, held.collectives())
        if not any(node.target in held.collectives() for node in members):
            continue
        inside = set(members)
        for end in [node for node in members if any(user not in inside for user in node.users)]:
            with graph.inserting_after(last):
                new = graph.placeholder(HELD_PREFIX + end.name)
            new.meta = {key: value for key, value in end.meta.items() if key != "autopar"}
            held.chains[new.name] = (placeholder.name, _chain_module(gm, placeholder, end, order))
            end.replace_all_uses_with(new, delete_user_cb=lambda user, inside=inside: user not in inside)
            last = new
        for node in reversed(members):
            if not node.users:
                graph.erase_node(node)
    return gm
