"""The choice graph: every node's candidate strategies with their prices, and the edges between.

This is what the ILP is built from. It is computed once per (graph, mesh, cluster) and holds
no solver state, so that the formulation (``ilp.py``) and the reporting (``plan.py``) read the
same numbers.

- A *free* node chooses among its strategies: the rules' strategies less those its producers
  can never feed and those another of the same interface dominates (``pruning``: exact, both).
- A *follower* (getitem always; otherwise a node with one tensor input whose rule maps each of
  its producer's output specs to exactly one strategy, such as views and elementwise ops) takes
  the strategy that matches its producer's choice, so it never reshards its input.
- An *edge* joins output ``out_index`` of a producer to tensor input ``in_index`` of a consumer.
  Its price table gives the cost of each (producer spec → consumer spec) transition; missing
  entries are impossible transitions (into Partial, or any change on a tensor mutated in place,
  or into a follower, which takes its producer's spec as it is).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard

from autopar.cost import compute, liveness, memory
from autopar.cost.cluster import ClusterSpec
from autopar.cost.optimizer import step_temporary
from autopar.errors import ConfigError, InfeasibleError
from autopar.ir import spec as spec_module
from autopar.ir.options import DEFAULT_OPTIMIZER, CommOptions
from autopar.ir.spec import SS, Spec, is_valid, padded_axis, replicated
from autopar.rules import op_info
from autopar.rules.registry import (
    OpInfo,
    Strategy,
    offering_strided,
    split_blocks,
    strided_blocks,
    tensor_input_nodes,
    tensor_meta,
)
from autopar.solver.problem import pruning
from autopar.solver.problem.edges import Edge, flatten, mutated_inputs, price_edges, reduce_dtype
from autopar.solver.problem.gather_overlap import GatherOverlap, gather_overlap
from autopar.solver.problem.gathered import GatheredSize, gathered_parameters
from autopar.solver.problem.op_prices import price_strategies
from autopar.solver.problem.optimizer_terms import dtensor_price, step_prices
from autopar.solver.problem.padded_casts import padded_cast_strategies
from autopar.solver.problem.priced import PricedStrategy, PriceTable
from autopar.trace import TracedModel, requires_grad
from autopar.trace.attention import EXAMPLE_MASK


@dataclass
class Choice:
    """One graph node's decision: its strategies, each with its prices (``priced``)."""

    name: str
    kind: str  # "param" | "buffer" | "constant" | "user" | "op" | "output"
    priced: PriceTable  # one record per strategy, in order (shared by identical ops)
    inputs: list[tuple[str, int]]  # (producer, output index) per tensor input
    out_shapes: tuple[tuple[int, ...], ...] = ()
    out_dtypes: tuple[torch.dtype, ...] = ()
    requires_grad: bool = False
    follower_of: str | None = None
    fqn: str | None = None
    info: OpInfo | None = None
    # Per tensor input: the dtype its gradient all-reduces run in, where not the input's own
    # (the cast of a parameter under a precision policy carries its ``reduce_dtype``).
    sync_dtypes: tuple[torch.dtype | None, ...] = ()

    @property
    def strategies(self) -> tuple[Strategy, ...]:
        """The strategies alone, in order: a view of ``priced`` (the same object while it is)."""
        return self.priced.strategies

    def out_specs(self, index: int) -> list[Spec]:
        """Distinct specs of output ``index`` over the strategies, in first-seen order."""
        return distinct_specs(s.outs[index] for s in self.strategies)

    def in_specs(self, index: int) -> list[Spec]:
        return distinct_specs(s.ins[index] for s in self.strategies)


def distinct_specs(specs: Iterable[Spec]) -> list[Spec]:
    """The distinct ``specs`` in first-seen order. Each object is hashed by value once: the rules
    give an op's equal specs as one object (``registry.expand_rows``), and hashing a spec hashes
    each of its placements in Python. The caller holds the objects, so no id is reused."""
    return list(dict.fromkeys({id(spec): spec for spec in specs}.values()))


@dataclass
class ChoiceGraph:
    mesh_shape: tuple[int, ...]
    choices: dict[str, Choice]
    edges: list[Edge]
    order: list[str]  # node names in graph order
    # Placeholders that are one tensor under several names (tied weights): each group must
    # take one spec. Export lifts a tied weight once per name, and may route every use to one.
    ties: list[list[str]] = field(default_factory=list)
    # Repeated layers: node → the node at the same place in the first layer of its ModuleList,
    # whose strategy it shares (see ``repeated_layers``).
    layer_template: dict[str, str] = field(default_factory=dict)
    # When each node's bytes are alive over forward and backward (``autopar.cost.liveness``).
    timeline: liveness.Timeline | None = None
    # The parameters the runtime gathers whole (``solver.problem.gathered``): timeline names beside the
    # nodes', sized by the specs of an edge.
    gathered: dict[str, GatheredSize] = field(default_factory=dict)
    # The communication schedule priced (``ir.options.CommOptions``; the runtime's default).
    comm: CommOptions = field(default_factory=CommOptions)
    # How many strategies of op nodes were enumerated, and how many of them ``solver.problem.pruning``
    # cut before pricing edges (impossible) or after pricing the node (dominated).
    pruned: Pruned = field(default_factory=lambda: Pruned())
    # Per parameter the optimizer steps: the seconds of its step under each strategy, which the
    # ILP's objective adds to its compute (``solver.problem.optimizer_terms``).
    optimizer_s: dict[str, list[float]] = field(default_factory=dict)
    # The seconds DTensor's dispatch adds to that step where some parameter is not replicated
    # (the runtime then holds them all as DTensors; ``optimizer_terms.dtensor_price``).
    dtensor_step_s: float = 0.0
    # The optimizer the step is priced for (``ir.options.PlanOptions.optimizer``).
    optimizer: str = DEFAULT_OPTIMIZER
    # FSDP's gathers in the ILP's objective as the runtime overlaps them (``gather_overlap``;
    # None where they do not overlap: gloo, a pipeline stage's per-step graph).
    overlap: GatherOverlap | None = None
    # What later stages compute from this graph alone (the memory planner's walk: see
    # ``solver.planners.memory_plan``), kept so that one solve computes it once however many plans it tries.
    # Not an argument: a graph made by ``dataclasses.replace`` (other prices, other choices)
    # starts with its own, empty.
    derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def objective_s(self, name: str) -> list[float]:
        """Node ``name``'s seconds per strategy in the ILP's objective: its ``compute_s``, and for a
        parameter the optimizer step of its shard (``optimizer_s``)."""
        compute_s = self.choices[name].priced.compute_s
        step_s = self.optimizer_s.get(name)
        return compute_s if step_s is None else [c + o for c, o in zip(compute_s, step_s)]

    def bytes_of(self, assignment: Mapping[str, int]) -> Callable[[str], float]:
        """Timeline name -> bytes under ``assignment`` (every node's strategy): a node's outputs
        under its strategy, a gathered parameter's under its edge's two specs."""

        def size(name: str) -> float:
            choice = self.choices.get(name)
            if choice is not None:
                return choice.priced[assignment[name]].memory_bytes
            gathered = self.gathered[name]
            edge = self.edges[gathered.edge]
            src = self.choices[edge.producer].strategies[assignment[edge.producer]].outs[edge.out_index]
            dst = self.choices[edge.consumer].strategies[assignment[edge.consumer]].ins[edge.in_index]
            return gathered.bytes_for(src, dst)

        return size

    def peak(self, assignment: Mapping[str, int]) -> tuple[float, int]:
        """``timeline.peak(bytes_of(assignment))``: (peak bytes, the first time it is reached),
        walked once per assignment: a budgeted solve asks it of one plan several times (its
        rounding, whether it fits, whether the memory planner must shrink it)."""
        peaks = self.derived.setdefault("peaks", {})
        key = tuple(assignment.get(name) for name in self.choices)
        found = peaks.get(key)
        if found is None:
            found = peaks[key] = self.timeline.peak(self.bytes_of(assignment))
        return found

    def bytes_bound(self, largest: bool) -> Callable[[str], float]:
        """Timeline name -> its least (or ``largest``) bytes over the strategies: references for
        the times where the peak may lie (``Timeline.checkpoints``)."""
        pick = max if largest else min

        def size(name: str) -> float:
            choice = self.choices.get(name)
            if choice is not None:
                return pick(choice.priced.memory_bytes, default=0.0)
            return pick(self.gathered[name].sizes.values(), default=0.0) if largest else 0.0

        return size

    def free(self) -> list[Choice]:
        return [self.choices[n] for n in self.order if self.choices[n].follower_of is None]

    def param_sync_groups(self) -> tuple[dict[tuple, ParamSyncGroup], dict[str, list[float]]]:
        """(the merged parameter reductions, and per node the per-use seconds of parameter
        reductions in each strategy's ``compute_s``); see ``param_sync_groups``. Cached."""
        cached = self.__dict__.get("_param_sync_groups")
        if cached is None:
            cached = self.__dict__["_param_sync_groups"] = param_sync_groups(self)
        return cached


@dataclass
class Pruned:
    """Strategies of op nodes, counted node by node (repeated layers count every copy): as the
    rules enumerate them, and those ``solver.problem.pruning`` cut as impossible or dominated."""

    enumerated: int = 0
    impossible: int = 0
    dominated: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"enumerated": self.enumerated, "impossible": self.impossible, "dominated": self.dominated}


@dataclass
class ParamSyncGroup:
    """One gradient reduction of a parameter (on one mesh axis, the parameter held as one spec)
    that the runtime runs once however many uses need it (``passes.schedule``): priced once, at
    ``price_s`` (bucketed) per parameter, for ``count`` parameters (repeated layers share one
    group), when any use takes one of its strategies that needs it."""

    price_s: float
    params: set[str]
    uses: dict[tuple[str, int], set[int]]  # (consumer, input index) → strategies that reduce

    def needed(self, assignment: Mapping[str, int]) -> bool:
        return any(assignment[consumer] in strategies for (consumer, _), strategies in self.uses.items())

    @property
    def total_s(self) -> float:
        return self.price_s * len(self.params)


def param_sync_groups(graph: ChoiceGraph) -> tuple[dict[tuple, ParamSyncGroup], dict[str, list[float]]]:
    """Group the parameter-gradient reductions of every strategy (``PricedStrategy.param_syncs``) by
    (parameter, axis, spec). A parameter of a repeated layer shares the group of its first-layer
    counterpart when its consumer shares that layer's strategy too; a cast of a parameter counts
    as the parameter (``synced_param``). Also returns, per node, the per-use seconds of those
    reductions in each strategy's ``compute_s``, which the merged price replaces."""
    template = graph.layer_template
    groups: dict[tuple, ParamSyncGroup] = {}
    refunds: dict[str, list[float]] = {}
    # Identical ops share their tables (``_op_choice``), as do repeated layers: each distinct table
    # is read once into its refunds (shared, read-only) and its terms by (input, axis, held
    # spec), in order of first appearance, with their strategies in order and their largest
    # bucketed price. Each node then joins one group per such entry, in the order, and with the
    # strategies, that a walk over its terms one by one would give.
    terms_of: dict[int, tuple[list[float], dict[tuple, list]]] = {}  # by id of a table (held by the graph)
    # The groups by (owner, axis, spec object): the specs of ``terms_of``'s entries, which the
    # graph holds, recur node after node, and hashing a spec hashes each of its placements.
    by_object: dict[tuple, ParamSyncGroup] = {}
    for name in graph.order:
        choice = graph.choices[name]
        if not any(priced.param_syncs for priced in choice.priced):
            continue
        key = id(choice.priced)
        if key not in terms_of:
            refund = [sum(term[2] for term in priced.param_syncs) for priced in choice.priced]
            terms_of[key] = (refund, _terms_by_spec(choice))
        refunds[name], by_spec = terms_of[key]
        consumer = template.get(name, name)
        for (index, axis, spec), (price_s, strategies) in by_spec.items():
            param = synced_param(graph.choices, choice.inputs[index][0])
            shared = name in template and param in template
            owner = template[param] if shared else param
            group = by_object.get((owner, axis, id(spec)))
            if group is None:
                group = groups.get((owner, axis, spec))
                if group is None:
                    group = groups[(owner, axis, spec)] = ParamSyncGroup(0.0, set(), {})
                by_object[(owner, axis, id(spec))] = group
            group.price_s = max(group.price_s, price_s)
            group.params.add(param)
            group.uses.setdefault((consumer, index), set()).update(strategies)
    return groups, refunds


def _terms_by_spec(choice: Choice) -> dict[tuple, list]:
    """(input, axis, held spec) -> [largest bucketed price, strategies] of ``choice``'s parameter
    reductions, in order of first appearance; each spec object hashed once (``distinct_specs``)."""
    by_object: dict[tuple, list] = {}  # (input, axis, id(spec)) -> [spec, price, strategies]
    for s, priced in enumerate(choice.priced):
        for index, axis, _, bucketed_s in priced.param_syncs:
            spec = priced.strategy.ins[index]
            entry = by_object.get((index, axis, id(spec)))
            if entry is None:
                entry = by_object[(index, axis, id(spec))] = [spec, 0.0, []]
            entry[1] = max(entry[1], bucketed_s)
            entry[2].append(s)
    by_spec: dict[tuple, list] = {}
    for (index, axis, _), (spec, price_s, strategies) in by_object.items():
        entry = by_spec.setdefault((index, axis, spec), [0.0, []])
        entry[0] = max(entry[0], price_s)
        entry[1].extend(strategies)
    return by_spec


def param_sync_adjustment_s(graph: ChoiceGraph, assignment: Mapping[str, int]) -> float:
    """What the ILP objective adds to Σ compute_s for ``assignment`` (every node's strategy): each
    needed parameter reduction once, bucketed, in place of the per-use prices."""
    groups, refunds = graph.param_sync_groups()
    merged = sum(group.total_s for group in groups.values() if group.needed(assignment))
    return merged - sum(refund[assignment[name]] for name, refund in refunds.items())


def optimizer_objective_s(graph: ChoiceGraph, assignment: Mapping[str, int]) -> float:
    """What the ILP objective adds to Σ compute_s for ``assignment`` for the optimizer step: each
    parameter's at its strategy, and DTensor's dispatch where some parameter is sharded
    (``solver.problem.optimizer_terms``)."""
    seconds = sum(step[assignment[name]] for name, step in graph.optimizer_s.items())
    if graph.dtensor_step_s and any(
        not all(p.is_replicate() for p in choice.strategies[assignment[name]].outs[0])
        for name, choice in graph.choices.items()
        if choice.kind == "param"
    ):
        seconds += graph.dtensor_step_s
    return seconds


@dataclass(frozen=True)
class Offers:
    """What the runtime carries beyond the ops' rules, which the choices offer: parameters held
    as padded shards (``padded``: FSDP2's layout; a pipeline stage holds plain ones), and graph
    outputs that leave split along dim 0, each rank its own rows (``rows_out``, by producer name:
    the batched outputs under ``batch="per_rank"``, ``solver.planners.data``)."""

    padded: bool = True
    rows_out: frozenset[str] = frozenset()


def build_choice_graph(
    traced: TracedModel,
    mesh_shape: Sequence[int],
    cluster: ClusterSpec,
    *,
    optimizer: str = DEFAULT_OPTIMIZER,
    forced: dict[str, Spec | str] | None = None,
    share_layers: bool = True,
    zero_stage: int = 0,
    optimizer_dtype: torch.dtype | None = None,
    comm: CommOptions | None = None,
    offers: Offers = Offers(),
) -> ChoiceGraph:
    """Enumerate strategies and prices for every node of ``traced``.

    ``forced`` pins the output spec of named nodes (tests use it for hand plans), or, given a
    kernel's name instead of a spec, the node's strategies to those that run that kernel.
    ``share_layers`` ties repeated layers to one choice (``repeated_layers``).
    Strided shards are offered for the block counts of the graph's equal splits.
    ``zero_stage`` (1 or 2) prices parameter state as ZeRO does over a DDP layout: every rank
    holds every parameter whole, and the optimizer state (stage 1) and the gradients (stage 2)
    are split among all ranks. So it needs every parameter pinned replicated by ``forced``.
    ``optimizer_dtype`` is the optimizer state's (a precision policy's ``optimizer_dtype``; None:
    each parameter's own dtype, as torch's optimizers keep their state). ``optimizer`` is the one
    the step is priced for (``PlanOptions.optimizer``).
    ``comm`` is the communication schedule the runtime will run (``CommOptions()``, its default,
    when None): how it gathers and frees sharded parameters decides their memory.
    ``offers.padded`` False offers no padded parameter shards (``padded_param_specs``) where the
    runtime would not carry them (a pipeline stage), whatever the flag says; ``offers.rows_out``
    are the outputs offered split along dim 0 (``Offers``).
    """
    comm = comm or CommOptions()
    # Only the scheduled gather pads, and not the compiled mode's traced one (runtime.padded): a plan
    # priced for inductor (``autopar.plan(compiler=...)`` as ``compile``'s) offers none.
    padded = offers.padded and comm.enabled and cluster.executor != "inductor"
    with offering_strided(split_blocks(traced.gm)):
        return _build_choice_graph(
            traced,
            mesh_shape,
            cluster,
            optimizer,
            forced,
            share_layers,
            zero_stage,
            optimizer_dtype,
            comm,
            dataclasses.replace(offers, padded=padded),
        )


def _build_choice_graph(
    traced, mesh_shape, cluster, optimizer, forced, share_layers, zero_stage, optimizer_dtype, comm, offers: Offers
) -> ChoiceGraph:
    mesh_shape = tuple(mesh_shape)
    kinds = {i.name: i for i in traced.inputs}
    choices: dict[str, Choice] = {}
    order: list[str] = []
    cache: dict[tuple, tuple] = {}
    infos: dict[tuple, tuple] = {}
    placeholder_cache: dict[tuple, tuple] = {}
    pruned = Pruned()
    for node in traced.gm.graph.nodes:
        order.append(node.name)
        impossible_before = pruned.impossible
        if node.op == "placeholder":
            graph_input = kinds[node.name]
            pinned = forced.get(node.name) if forced else None
            choices[node.name] = _placeholder_choice(
                node,
                graph_input.kind,
                graph_input.fqn,
                mesh_shape,
                placeholder_cache,
                pinned if isinstance(pinned, tuple) else None,
                offers.padded,
            )
        elif node.op == "output":
            choices[node.name] = _output_choice(node, mesh_shape, offers.rows_out)
        elif node.op == "call_function":
            choices[node.name] = _op_choice(node, choices, mesh_shape, cluster, cache, infos, pruned)
        else:
            raise NotImplementedError(f"autopar cannot plan a {node.op} node yet: {node.format_node()}")
        if forced and node.name in forced:
            choice, want = choices[node.name], forced[node.name]
            if isinstance(want, str):  # a kernel's name: the strategies that run it
                keep = [i for i, s in enumerate(choice.strategies) if s.kernel == want]
            else:
                keep = [i for i, s in enumerate(choice.strategies) if s.outs and s.outs[0] == want]
            if not keep:
                what = f"forced {'kernel' if isinstance(want, str) else 'spec'} {want}"
                if pruned.impossible > impossible_before:
                    # The rules offer it, but its inputs cannot arrive as it needs them (a Partial
                    # input from producers that never leave it Partial, forced ones included).
                    raise InfeasibleError(
                        f"{what} of {node.format_node()} needs inputs that its producers, as "
                        "planned or forced, cannot deliver: force a compatible spec, or none"
                    )
                raise ConfigError(
                    f"{what} is not a strategy of {node.format_node()}: force one that its rule offers "
                    "(`autopar explain` lists them), or leave the node to the solver"
                )
            choice.priced = choice.priced.keep(keep)
    layers = _layers(traced.gm, choices, traced) if share_layers else {}
    _mark_followers(choices, order, _boundary_nodes(layers, choices))
    # After the followers: an edge into a follower only ever carries its producer's spec as it
    # is, so only those transitions are priced (the ILP gives such an edge no variables).
    edges = price_edges(traced.gm, choices, mesh_shape, cluster)
    templates = repeated_layers(layers, choices)
    ties = _tie_groups(traced, choices)
    if zero_stage:
        _check_zero_layout(choices, zero_stage)
    zero_ways = math.prod(mesh_shape) if zero_stage else 1
    nodes = live_nodes(traced.gm, choices)
    temporary = step_temporary(cluster, optimizer)
    timeline = liveness.build_timeline(nodes, optimizer, ties, zero_stage, zero_ways, optimizer_dtype, temporary)
    fqns = {i.name: traced.ties.get(i.fqn, i.fqn) for i in traced.inputs if i.kind == "param"}
    gathered, intervals, rows = gathered_parameters(choices, edges, order, nodes, mesh_shape, fqns, ties, comm, cluster.gloo)
    timeline = liveness.Timeline(timeline.names, timeline.intervals + tuple(intervals))
    bytes_per_strategy = {name: choice.priced.memory_bytes for name, choice in choices.items()}
    steps = step_prices(bytes_per_strategy, timeline, cluster, mesh_shape, optimizer)
    dispatch = dtensor_price(timeline, cluster, mesh_shape)
    graph = ChoiceGraph(
        mesh_shape, choices, edges, order, ties, templates, timeline, gathered, comm, pruned, steps, dispatch, optimizer
    )
    graph.overlap = gather_overlap(graph, cluster)
    graph.derived["live_nodes"] = (traced.gm, nodes)  # the memory planner's walk reads them again
    graph.derived["gather_rows"] = (rows, cluster.gloo)  # for the layers kept gathered (``planners.kept_layers``)
    return graph


def _check_zero_layout(choices: dict[str, Choice], zero_stage: int) -> None:
    for choice in choices.values():
        if choice.kind == "param" and any(not spec.is_replicate() for s in choice.strategies for spec in s.outs[0]):
            raise ConfigError(
                f"zero_stage={zero_stage} prices ZeRO over a DDP layout, but parameter {choice.fqn} may be "
                "sharded: pin every parameter replicated (forced=...), as autopar.hand_plan('zero1') does"
            )


def live_nodes(gm: torch.fx.GraphModule, choices: dict[str, Choice]) -> list[liveness.LiveNode]:
    """What the liveness walk needs of each node (views and getitems alias their input)."""
    nodes = []
    for node in gm.graph.nodes:
        choice = choices[node.name]
        kind = choice.kind
        target = node.target if node.op == "call_function" else None
        if kind == "op" and (target is operator.getitem or compute.is_view(target)):
            kind = "alias"
        inputs = tuple(producer for producer, _ in choice.inputs)
        itemsize = choice.out_dtypes[0].itemsize if choice.out_dtypes else 4
        internal = memory.internal_saved_factor(target, choice.info.kw) if choice.info is not None else 0.0
        nodes.append(
            liveness.LiveNode(
                node.name,
                kind,
                inputs,
                target,
                choice.requires_grad,
                tuple(choices[p].requires_grad for p in inputs),
                itemsize,
                internal,
            )
        )
    return nodes


_LAYER_RE = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def layer_key(node: torch.fx.Node, fqn: str | None) -> tuple[str, int] | None:
    """(ModuleList path, index) of the first numbered module on the node's module path."""
    path = fqn
    if path is None:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            return None
        path = next(reversed(stack.values()))[0]
    return _path_layer(path or "")


@functools.lru_cache(maxsize=4096)
def _path_layer(path: str) -> tuple[str, int] | None:
    """``layer_key`` of a module path (many nodes share one)."""
    match = _LAYER_RE.match(path)
    return (match.group(1), int(match.group(2))) if match else None


def _layers(gm: torch.fx.GraphModule, choices: dict[str, Choice], traced: TracedModel) -> dict[str, list[list[str]]]:
    """ModuleList path -> the node names of each of its layers, in index order (parameters
    and ops; ``layer_key`` says which layer a node belongs to)."""
    fqns = {i.name: i.fqn for i in traced.inputs}
    layers: dict[tuple[str, int], list[str]] = {}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function"):
            continue
        if node.op == "placeholder" and choices[node.name].kind != "param":
            continue
        key = layer_key(node, fqns.get(node.name))
        if key is not None:
            layers.setdefault(key, []).append(node.name)
    by_list: dict[str, list[list[str]]] = {}
    for prefix, index in sorted(layers):
        by_list.setdefault(prefix, []).append(layers[(prefix, index)])
    return by_list


def _boundary_nodes(layers: dict[str, list[list[str]]], choices: dict[str, Choice]) -> set[str]:
    """Nodes that must not follow their producer, so that their layers can be tied.

    A follower has no variables: its x is its producer's. A layer's first node often reads the
    previous layer's output, while the first layer's reads something else (the embedding),
    whose specs differ (on mesh (128, 8) a Hugging Face LLaMA's embedding cannot be (P, P), its
    residual add can): the follower lists then differ and no layer matched the first. Tying such
    a follower would also be wrong: its x would be an expression of the *first* layer's
    producer, and the edge from its real producer would be dropped unpriced. So a position
    whose one producer is not the same position of the same layer, or one node outside the
    layers, in every layer is left free: its strategy list is its op's (the same in every
    layer), and the edge from its producer is a real one, whose y repeated layers share."""
    boundary: set[str] = set()
    for lists in layers.values():
        if len(lists) < 2 or any(len(names) != len(lists[0]) for names in lists):
            continue
        positions = [{name: i for i, name in enumerate(names)} for names in lists]
        for i in range(len(lists[0])):
            producers = set()
            for names, position in zip(lists, positions):
                inputs = choices[names[i]].inputs
                if len(inputs) != 1:
                    break
                producer = inputs[0][0]
                producers.add(("layer", position[producer]) if producer in position else ("outside", producer))
            if len(producers) > 1:
                boundary.update(names[i] for names in lists)
    return boundary


def repeated_layers(layers: dict[str, list[list[str]]], choices: dict[str, Choice]) -> dict[str, str]:
    """Map each node of a repeated layer to its counterpart in the first layer of its list.

    A layer is tied only if it matches the first one node for node: the same op, the same
    output shapes, and the same strategies with the same prices. Then choosing the same
    strategy for every layer is a restriction of the ILP, not an approximation of its costs.
    """
    templates: dict[str, str] = {}
    for lists in layers.values():
        first = lists[0]
        for names in lists[1:]:
            if len(names) == len(first) and all(_same_choice(choices[a], choices[b]) for a, b in zip(names, first)):
                templates.update(zip(names, first))
    return templates


def _same_choice(a: Choice, b: Choice) -> bool:
    same_info = (a.info is None) == (b.info is None) and (a.info is None or a.info.target == b.info.target)
    return (
        same_info
        and a.kind == b.kind
        and a.out_shapes == b.out_shapes
        and (a.follower_of is None) == (b.follower_of is None)
        and a.strategies == b.strategies
        and a.priced.compute_s == b.priced.compute_s
        and a.priced.memory_bytes == b.priced.memory_bytes
    )


def _tie_groups(traced: TracedModel, choices: dict[str, Choice]) -> list[list[str]]:
    """Groups of parameter placeholders holding one tensor. Members share the first one's
    strategy list, and only the first carries the memory of the shared state."""
    by_canonical: dict[str, list[str]] = {}
    for graph_input in traced.placeholders("param"):
        canonical = traced.ties.get(graph_input.fqn, graph_input.fqn)
        by_canonical.setdefault(canonical, []).append(graph_input.name)
    groups = [names for names in by_canonical.values() if len(names) > 1]
    for names in groups:
        first = choices[names[0]]
        for name in names[1:]:
            member = choices[name]
            assert [s.outs for s in member.strategies] == [s.outs for s in first.strategies], names
    return groups


def _all_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], padded: bool = False) -> list[Spec]:
    """Every R/S spec with even shards (Partial is never a placeholder's placement), and the
    strided shards that the graph's splits can use (``registry.strided_blocks``); with
    ``padded`` (a parameter, ``padded_param_specs``), FSDP2's padded shards of dim 0 too."""
    per_axis = [Replicate()] + [Shard(d) for d in range(len(shape))]
    per_axis += [SS(d, n) for n in strided_blocks() for d in range(len(shape))]
    specs = [spec for spec in itertools.product(per_axis, repeat=len(mesh_shape)) if is_valid(shape, spec, mesh_shape)]
    if padded:  # Shard(0) on one axis, R or a plain shard of another dim on the others
        specs += [
            spec
            for spec in itertools.product(per_axis[: len(shape) + 1], repeat=len(mesh_shape))
            if padded_axis(shape, spec, mesh_shape) is not None
        ]
    return specs


def unsplit_axes(choice: Choice, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh axes larger than 1 on which no strategy of ``choice`` (a parameter's) splits it:
    none of its dims divides by the axis size (``ir.spec.is_valid``), and no padded shard is offered
    there (``padded_param_specs``). On such an axis the parameter, its gradient and its optimizer
    state are whole on every rank."""
    return tuple(
        axis
        for axis, size in enumerate(mesh_shape)
        if size > 1 and all(s.outs and s.outs[0][axis].is_replicate() for s in choice.strategies)
    )


def mesh_hint(graph: ChoiceGraph, names: Sequence[str]) -> str:
    """A line for an InfeasibleError whose largest tensors (``names``: parameter FQNs or node names)
    include parameters that some mesh axis cannot split (``unsplit_axes``), naming the axes and the
    fix; "" where every one of them can be split on every axis."""
    by_name = {c.fqn or c.name: c for c in graph.choices.values() if c.kind == "param"}
    stuck = {}
    for name in names:
        choice = by_name.get(name)
        axes = unsplit_axes(choice, graph.mesh_shape) if choice is not None else ()
        if axes:
            stuck.setdefault(axes, []).append(name)
    if not stuck:
        return ""
    axes, fqns = max(stuck.items(), key=lambda item: len(item[1]))
    sizes = ", ".join(f"axis {axis} ({graph.mesh_shape[axis]} ranks)" for axis in axes)
    return (
        f"\n  Mesh {sizes} divides no dim of {', '.join(fqns[:3])}{' ...' if len(fqns) > 3 else ''}: a parameter is "
        "split only on an axis whose size divides one of its dims, or padded along dim 0 (FSDP2's layout) where "
        "the plan runs eagerly with the communication schedule on, so these stay whole on every rank there. A mesh "
        "whose axis sizes divide the model's widths (powers of two, say), or an eager plan, lets them shard."
    )


def padded_choice(choice: Choice, index: int, mesh_shape: tuple[int, ...]) -> bool:
    """Whether strategy ``index`` of ``choice`` holds a parameter as a padded shard."""
    return choice.kind == "param" and padded_axis(choice.out_shapes[0], choice.strategies[index].outs[0], mesh_shape) is not None


def padded_param_specs(mesh_shape: tuple[int, ...]) -> bool:
    """Whether parameters may be planned as padded shards (``ir.spec.padded_axis``) on this mesh:
    where ``ir.spec.PADDED_PARAM_SHARDS`` allows them and some axis larger than 1 exists (the
    runtime gathers a padded shard on its axis, FSDP's pattern, and reduces its gradient there
    first, then over the axes it is replicated on)."""
    return spec_module.PADDED_PARAM_SHARDS and any(size > 1 for size in mesh_shape)


def _placeholder_choice(node, kind, fqn, mesh_shape, cache: dict, pinned: Spec | None = None, offered: bool = True) -> Choice:
    """A graph input's choice; ``pinned``: the spec ``forced`` gives it (a padded shard is then
    offered whatever ``padded_param_specs`` says: a plan that holds one is carried out as given);
    ``offered`` False: no padded shard unless pinned."""
    meta = tensor_meta(node.meta.get("val"))
    num_axes = len(mesh_shape)
    if meta is None:
        return Choice(node.name, kind, PriceTable([PricedStrategy(Strategy((), ()))]), [], fqn=fqn)
    shape, dtype = meta
    # A buffer that the graph never reads is kept whole: sharding it saves next to nothing, and
    # the model's own code may still read it outside the graph (a replicated plan's local eval,
    # ``generate``; HF's ``rotary_emb.original_inv_freq``).
    unread_buffer = kind == "buffer" and not node.users
    # Placeholders of one shape, dtype and kind (every layer's weights) share one table.
    padded = kind == "param" and (  # (a buffer is read whole by its ops)
        offered and padded_param_specs(mesh_shape) or pinned is not None and padded_axis(shape, pinned, mesh_shape) is not None
    )
    key = (kind in ("param", "buffer"), unread_buffer, shape, dtype, padded)
    if key not in cache:
        if kind in ("param", "buffer") and not unread_buffer:
            specs = _all_specs(shape, mesh_shape, padded)
        else:
            # User inputs arrive whole on every rank and constants are whole: the first consumer
            # decides how to cut them (a local chunk, free of communication).
            specs = [replicated(num_axes)]
        cache[key] = PriceTable(
            PricedStrategy(
                Strategy((), (spec,), source="placeholder"),
                memory_bytes=float(memory.local_bytes(shape, dtype, spec, mesh_shape)),
            )
            for spec in specs
        )
    return Choice(node.name, kind, cache[key], [], (shape,), (dtype,), requires_grad(node), fqn=fqn)


def _output_choice(node: torch.fx.Node, mesh_shape: tuple[int, ...], rows_out: frozenset[str]) -> Choice:
    """Outputs come back whole on every rank; those of ``rows_out`` may leave split along dim 0
    on any set of mesh axes, as the batch's rows are dealt (``Offers``): a split batch then costs
    no gather of them."""
    nodes = [n for n in flatten(node.args) if isinstance(n, torch.fx.Node) and tensor_meta(n.meta.get("val"))]
    inputs = [(n.name, 0) for n in nodes]
    whole = replicated(len(mesh_shape))
    strategies = [Strategy(tuple(whole for _ in nodes), (), source="output")]
    if rows_out.intersection(name for name, _ in inputs):
        split_axes = [axis for axis, size in enumerate(mesh_shape) if size > 1]
        for count in range(1, len(split_axes) + 1):
            for axes in itertools.combinations(split_axes, count):
                rows = tuple(Shard(0) if axis in axes else Replicate() for axis in range(len(mesh_shape)))
                ins = tuple(
                    rows if n.name in rows_out and is_valid(tuple(n.meta["val"].shape), rows, mesh_shape) else whole
                    for n in nodes
                )
                strategies.append(Strategy(ins, (), source="output"))
    return Choice(node.name, "output", PriceTable([PricedStrategy(s) for s in strategies]), inputs)


def _op_choice(node, choices, mesh_shape, cluster, cache: dict, infos: dict, pruned: Pruned) -> Choice:
    val = node.meta.get("val")
    needs_grad = requires_grad(node)
    if node.target is operator.getitem:
        return _getitem_choice(node, choices, needs_grad, cache)
    info, input_nodes, kw_text = _op_info(node, infos)
    inputs = [(n.name, 0) for n in input_nodes]
    out_dtypes = tuple(v.dtype for v in flatten(val) if isinstance(v, torch.Tensor))
    # Identical ops (same arguments and shapes, as in repeated layers) get identical strategies
    # and prices: enumerate and price each distinct one once. What their producers can deliver
    # (``pruning.Reachable``) is part of the key: it decides which strategies are possible.
    sync_dtypes = tuple(reduce_dtype(n) for n in input_nodes)
    mutated = mutated_inputs(node)
    reachable = tuple(_reachable(choices[n.name], i in mutated, cache) for i, n in enumerate(input_nodes))
    padded = _padded_cast(node, choices, input_nodes, mesh_shape)
    key = (
        info.target,
        kw_text,
        info.example_mask,
        info.out_shapes,
        out_dtypes,
        needs_grad,
        tuple((choices[n.name].requires_grad, choices[n.name].kind == "param") for n in input_nodes),
        sync_dtypes,
        reachable,
        padded,
    )
    if key not in cache:
        cache[key] = price_strategies(
            info, val, choices, input_nodes, mesh_shape, cluster, needs_grad, sync_dtypes, reachable, padded
        )
    priced, counts = cache[key]
    pruned.enumerated += counts[0]
    pruned.impossible += counts[1]
    pruned.dominated += counts[2]
    return Choice(node.name, "op", priced, inputs, info.out_shapes, out_dtypes, needs_grad, info=info, sync_dtypes=sync_dtypes)


def _padded_cast(node, choices, input_nodes, mesh_shape) -> tuple[Strategy, ...]:
    """A policy's cast of a parameter offered padded shards takes and gives the padded piece
    (``padded_casts``); nothing for any other node."""
    if len(input_nodes) != 1:
        return ()
    producer = choices[input_nodes[0].name]
    if producer.kind != "param" or not producer.out_shapes:
        return ()
    return padded_cast_strategies(node, producer.kind, producer.out_shapes[0], producer.out_specs(0), mesh_shape)


def _op_info(node: torch.fx.Node, seen: dict) -> tuple[OpInfo, list[torch.fx.Node], str]:
    """``op_info(node)``, ``tensor_input_nodes(node)`` and the text of the info's arguments.

    The copies of a repeated layer (``trace.repeat``) hold the very objects of the layer they
    copy: the values (FakeTensors) of their results and arguments, and their other arguments.
    A node whose target and arguments are those objects of a node seen before, in the same
    structure and with the same nodes repeated at the same places, has that node's info (under
    its own name) and its tensor inputs at the same places. ``seen`` is keyed by identity: the
    graph holds every object in a key while the choices are built."""
    places: dict[torch.fx.Node, int] = {}  # each distinct argument node -> its place
    key = (node.target, _structure(node.args, places), _structure(node.kwargs, places), id(node.meta.get("val")))
    key += (node.meta.get(EXAMPLE_MASK),)
    hit = seen.get(key)
    if hit is None:
        info, input_nodes = op_info(node), tensor_input_nodes(node)
        seen[key] = (info, [places[n] for n in input_nodes], repr(info.kw))
        return info, input_nodes, seen[key][2]
    info, at, kw_text = hit
    arguments = list(places)
    return dataclasses.replace(info, name=node.name), [arguments[i] for i in at], kw_text


def _structure(value: Any, places: dict) -> Any:
    """``_op_info``'s key of an argument: its nodes by their values' identity and their places
    (numbered in ``places`` as met), containers by type, anything else by identity. A module
    function: a closure that calls itself is a reference cycle, left to full collections."""
    if isinstance(value, torch.fx.Node):
        return ("node", id(value.meta.get("val")), places.setdefault(value, len(places)))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_structure(v, places) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _structure(v, places)) for k, v in value.items()))
    return id(value)


def _reachable(producer: Choice, pinned: bool, cache: dict) -> pruning.Reachable:
    """What ``producer``'s output 0 can deliver (``pruning.Reachable``), once per strategy list.
    The list is held in the entry, so that no id in a key is reused while this runs."""
    key = ("reachable", id(producer.strategies), pinned)
    if key not in cache:
        cache[key] = (pruning.Reachable.of(producer.out_specs(0), pinned), producer.strategies)
    return cache[key][0]


def synced_param(choices: dict[str, Choice], name: str) -> str:
    """The parameter whose gradient a sync of ``name``'s gradient reduces: ``name`` itself, or
    the parameter a cast (a precision policy's, one per use) reads."""
    choice = choices[name]
    if choice.kind != "param" and len(choice.inputs) == 1 and choices[choice.inputs[0][0]].kind == "param":
        return choice.inputs[0][0]
    return name


def _getitem_choice(node, choices, needs_grad, cache: dict) -> Choice:
    producer, index = node.args
    source = choices[producer.name]
    # The getitems of one output of identical ops share their tables, as identical ops do, so
    # that their followers' tables are shared too (``_mark_followers`` cuts each once). The
    # source's table is held in the entry, so that no id in a key is reused while this runs.
    key = ("getitem", id(source.priced), index)
    if key not in cache:
        follows = PriceTable(PricedStrategy(Strategy((spec,), (spec,), source="follow")) for spec in source.out_specs(index))
        cache[key] = (follows, source.priced)
    return Choice(
        node.name,
        "op",
        cache[key][0],
        [(producer.name, index)],
        (source.out_shapes[index],),
        (source.out_dtypes[index],),
        needs_grad,
    )


def _mark_followers(choices: dict[str, Choice], order: list[str], exclude: set[str] = frozenset()) -> None:
    """Mark nodes whose choice is a function of their single producer's choice (not those in
    ``exclude``: ``_boundary_nodes``).

    Identical ops share their tables (``_op_choice``), as do the nodes of repeated layers: each
    distinct (table, producer's table) is decided and cut once, and its followers share the cut
    table, so that the next follower down the chain hits again."""
    seen: dict[tuple, tuple] = {}
    for name in order:
        choice = choices[name]
        if choice.kind != "op" or len(choice.inputs) != 1 or name in exclude:
            continue
        producer, out_index = choice.inputs[0]
        source = choices[producer]
        key = (id(choice.priced), id(source.priced), out_index)
        hit = seen.get(key)
        if hit is None:
            source_specs = source.out_specs(out_index)
            by_in = strategies_by_spec(choice.strategies, False, 0, plain_only=True)
            cut = None
            if all(len(by_in.get(spec, ())) == 1 for spec in source_specs):
                cut = choice.priced.keep(by_in[spec][0] for spec in source_specs)
            # The key's objects are held here, so that no id in it is reused while this runs.
            hit = seen[key] = (choice.priced, source.priced, cut)
        if hit[2] is not None:
            choice.priced = hit[2]
            choice.follower_of = producer


def strategies_by_spec(strategies: Sequence[Strategy], outs: bool, index: int, plain_only: bool = False) -> dict[Spec, list[int]]:
    """The spec of output (``outs``) or input ``index`` -> the indices, in order, of the
    strategies that have it (``plain_only``: those without a kernel), specs in first-seen order
    (``Choice.out_specs``); each spec object hashed once (``distinct_specs``)."""
    by_object: dict[int, list] = {}  # id(spec) -> [spec, its strategies]
    for i, strategy in enumerate(strategies):
        if not (plain_only and strategy.kernel is not None):
            spec = (strategy.outs if outs else strategy.ins)[index]
            entry = by_object.get(id(spec))
            if entry is None:
                entry = by_object[id(spec)] = [spec, []]
            entry[1].append(i)
    by_spec: dict[Spec, list[int]] = {}
    for spec, indices in by_object.values():
        found = by_spec.setdefault(spec, indices)
        if found is not indices:  # equal specs, two objects: their strategies merged in order
            found.extend(indices)
            found.sort()
    return by_spec
