"""What one pipeline stage costs: layers, intra-stage plan candidates, and per-layer prices.

Layers (``cluster_layers``). The graph's op nodes are cut into units in graph order: ``pre``
(everything before the first repeated block: embeddings, rotary tables), one unit per block of
the model's longest ``ModuleList`` of repeated blocks (the transformer layers), and ``post``
(everything after the last block: final norm, head, loss). The planner's *layers* are the
blocks; a stage holding block 0 also runs ``pre``, and the one holding the last block runs
``post``. Units follow graph order, so a stage only reads values of earlier stages. A model with
no repeated blocks is cut into up to ``FALLBACK_LAYERS`` units of balanced FLOPs.

Candidates (``solve_candidates``). For one stage mesh, the sharding ILP of ``autopar.solver``
is solved on the whole traced graph (repeated blocks share variables, so its size does not
grow with depth) with each op priced per *step* of ``M`` microbatches: compute and resharding
run once per microbatch (× M), gradient synchronisation of parameters once per step (× 1).
Then, where memory binds, again with memory priced into the objective at a few
rates, which gives leaner plans (``CandidateSolver``). Each solution is a *candidate* intra-stage plan; a stage takes the fastest
candidate that fits its memory. So the ILP is solved a handful of times per stage mesh, never
per layer range: identical layer ranges share one solution. Where memory binds, the stage
planner adds a second ILP that prices a parameter's resharding once a step too, and the fastest
plans with FSDP laid over them (``fsdp_overlay``): candidates for stages that hold their
gathered parameters (``StagePlan.hold_gathered``; ``unit_costs(..., hold=True)`` prices them).

Per-layer prices (``unit_costs``). Under a candidate every unit gets, in seconds per
microbatch: ``own`` (its ops' forward and backward, and the resharding between its own ops and
from parameters), ``prev`` (resharding of values coming from the previous block) and
``pre`` (of values coming from ``pre``); ``fwd`` (the forward part of ``own``, paid again when
the stage recomputes activations); ``sync`` (the per-step gradient reductions of its
parameters, each parameter once at its bucketed price, as the ILP prices them), the gradient
bytes those reductions carry (their buckets), the optimizer step of its parameters
(``cost.optimizer.tensor_step_s``; a tied parameter in every stage that uses it), and the seconds
a microbatch takes to add its parameters' gradients into the step's sums (``accumulate``, which
a stage pays in all but its first microbatch). Bytes per device: ``static`` (its parameters, their gradients and optimizer
state, and user inputs), ``saved`` (activations alive at the end of forward, kept per microbatch
in flight), ``transient`` (the peak of its own activations and gradients above ``saved``),
``stash`` (its input activations: what a recomputing stage keeps per microbatch), and the
bytes of the values it receives from the previous block and from ``pre`` (what crosses a stage
boundary). A stage's figures are sums of its units' (``autopar.solver.planners.stages``). Time is exact
for a fixed plan: every op and every edge belongs to exactly one unit. Memory is the usual
pipeline model: static + k · saved + the largest transient.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass

import numpy as np
from torch.distributed.tensor import Replicate, Shard

from autopar.cost import comm, compute, memory
from autopar.cost import optimizer as step_cost
from autopar.cost.cluster import ClusterSpec
from autopar.errors import ConfigError
from autopar.ir.options import DEFAULT_OPTIMIZER, CommOptions
from autopar.rules import op_info
from autopar.solver.problem.choices import Choice, ChoiceGraph, Offers, build_choice_graph, layer_key
from autopar.solver.problem.edges import EdgePrices
from autopar.solver.problem.gathered import PREFIX as GATHERED
from autopar.solver.problem.gathered import cast_of_param
from autopar.solver.problem.ilp import ShardingILP, Solution
from autopar.solver.problem.op_prices import grad_sync_axes, grad_sync_cost
from autopar.solver.problem.priced import PriceTable
from autopar.solver.search.solving import peak_memory, solve_ilp, solve_within_budget
from autopar.trace import TracedModel

log = logging.getLogger("autopar")

PRE, POST = "pre", "post"
FALLBACK_LAYERS = 8
# Weights of memory against time in the leaner candidates (``CandidateSolver``), and the
# memory budgets of ``mode="budget"``, as fractions of the way from the leanest to the fastest.
LADDER = (0.1, 1.0, 10.0, 100.0)
BUDGET_LADDER = (0.5, 0.25, 0.1)
CANDIDATE_MODES = ("lagrangian", "budget", "both")
_STATIC_KINDS = ("param", "optimizer_state", "grad", "input")


@dataclass(frozen=True)
class Layers:
    """The units of a graph: ``unit[name]`` is -1 (pre), a block index, or ``num_blocks`` (post)
    for every op node; ``names[u + 1]`` lists unit u's op nodes in graph order."""

    unit: dict[str, int]
    num_blocks: int
    names: tuple[tuple[str, ...], ...]  # pre, block 0 .. block L-1, post
    repeated: bool  # blocks come from a ModuleList of identical layers
    list_path: str = ""

    def nodes_of(self, first: int, last: int) -> list[str]:
        """Op nodes of units first..last-1 (unit -1 is pre, num_blocks is post), graph order."""
        return [n for u in range(first, last) for n in self.names[u + 1]]


def cluster_layers(traced: TracedModel) -> Layers:
    """Cut ``traced``'s op nodes into pre, the repeated blocks and post (module docstring)."""
    fqns = {i.name: i.fqn for i in traced.inputs}
    ops = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    keys = {n.name: layer_key(n, fqns.get(n.name)) for n in ops}
    counts: dict[str, set[int]] = {}
    for key in keys.values():
        if key is not None:
            counts.setdefault(key[0], set()).add(key[1])
    if counts:
        path = max(counts, key=lambda p: (len(counts[p]), p))
        indices = sorted(counts[path])
    if not counts or len(indices) < 2:
        return _balanced_layers(ops)
    position = {index: i for i, index in enumerate(indices)}
    block = {n.name: position[keys[n.name][1]] for n in ops if keys[n.name] and keys[n.name][0] == path}
    first = next(i for i, n in enumerate(ops) if n.name in block)
    last = max(i for i, n in enumerate(ops) if n.name in block)
    unit: dict[str, int] = {}
    running = 0
    for i, node in enumerate(ops):
        if i < first:
            unit[node.name] = -1
        elif i > last:
            unit[node.name] = len(indices)
        else:
            running = max(running, block.get(node.name, running))
            unit[node.name] = running
    return _layers(unit, len(indices), ops, True, path)


def _layers(unit: dict[str, int], num_blocks: int, ops, repeated: bool, path: str = "") -> Layers:
    names: list[list[str]] = [[] for _ in range(num_blocks + 2)]
    for node in ops:
        names[unit[node.name] + 1].append(node.name)
    return Layers(unit, num_blocks, tuple(tuple(n) for n in names), repeated, path)


def _balanced_layers(ops) -> Layers:
    """No repeated blocks: up to FALLBACK_LAYERS units of about equal forward FLOPs."""
    flops = []
    for node in ops:
        try:
            flops.append(compute.node_flops(op_info(node)))
        except Exception:  # an op the FLOP counter does not know weighs nothing
            flops.append(0.0)
    num = max(1, min(FALLBACK_LAYERS, len(ops)))
    total = sum(flops) or 1.0
    unit: dict[str, int] = {}
    running = 0.0
    for node, weight in zip(ops, flops):
        index = min(num - 1, int(running / total * num))
        unit[node.name] = index
        running += weight
    used = sorted(set(unit.values()))  # drop empty units so that every layer has ops
    renumber = {u: i for i, u in enumerate(used)}
    unit = {name: renumber[u] for name, u in unit.items()}
    return _layers(unit, len(used), ops, False)


# -- candidates --------------------------------------------------------------------------------


@dataclass
class Candidate:
    """One intra-stage plan on a stage mesh: a strategy per node of the traced graph."""

    solution: Solution
    memory_weight: float | None  # the fraction f of ``CandidateSolver`` (None: the fastest plan)
    units: UnitCosts | None = None
    held_units: UnitCosts | None = None  # its stages holding their gathered parameters (None: it gathers none)


def per_step_graph(graph: ChoiceGraph, split: OpSplit, num_microbatches: int, hold: bool = False) -> ChoiceGraph:
    """``graph`` priced per step of M microbatches: compute and resharding × M, parameter
    gradient synchronisation × 1 (see the module docstring). ``hold``: a parameter's resharding
    × 1 too, as a stage that holds its gathered parameters runs it (``StagePlan.hold_gathered``)."""
    m = float(num_microbatches)
    choices = {}
    # Identical ops share their tables and their sync lists (``split_op_costs``): reprice each
    # distinct pair once, and share the result as they shared theirs. Both are held by their owners.
    repriced: dict[tuple[int, int], PriceTable] = {}
    for name, choice in graph.choices.items():
        sync = split.sync.get(name)
        table = repriced.get((id(choice.priced), id(sync)))
        if table is None:
            compute_s = choice.priced.compute_s
            costs = [m * c for c in compute_s] if sync is None else [m * (c - s) + s for c, s in zip(compute_s, sync)]
            table = repriced[(id(choice.priced), id(sync))] = choice.priced.repriced(costs)
        choices[name] = dataclasses.replace(choice, priced=table)
    scaled: dict[int, dict] = {}
    edges = []
    for edge in graph.edges:
        if hold and cast_of_param(graph.choices, edge.producer) is not None:
            edges.append(edge)
            continue
        table = scaled.get(id(edge.price))
        if table is None:
            price = edge.price
            table = scaled[id(price)] = (
                price.scaled(m) if isinstance(price, EdgePrices) else {k: (m * s, b) for k, (s, b) in price.items()}
            )
        edges.append(dataclasses.replace(edge, price=table))
    # Each microbatch but the first adds its gradients into the step's sums: a parameter's price,
    # by its placement, beside its optimizer step.
    steps = dict(graph.optimizer_s)
    for name, seconds in split.accumulate.items():
        steps[name] = [o + (m - 1) * a for o, a in zip(steps.get(name, [0.0] * len(seconds)), seconds)]
    # A stage's gathers are not scheduled across microbatches as one step's are: priced per edge.
    return dataclasses.replace(graph, choices=choices, edges=edges, overlap=None, optimizer_s=steps)


@dataclass
class OpSplit:
    """Per node and strategy: seconds of parameter-gradient all-reduces (once per step) and of
    the forward pass (paid again under recomputation); per parameter the optimizer steps and its
    strategy, the seconds a microbatch's gradient takes to add into the step's sum
    (``cost.optimizer.accumulate_s``: in each microbatch but the first)."""

    sync: dict[str, list[float]]
    forward: dict[str, list[float]]
    accumulate: dict[str, list[float]] = dataclasses.field(default_factory=dict)


def split_op_costs(graph: ChoiceGraph, cluster: ClusterSpec) -> OpSplit:
    mesh = graph.mesh_shape
    rooted: dict[str, bool] = {}

    def param_rooted(name: str) -> bool:
        # a parameter, an op that follows one (a view), or a precision policy's cast of one: its
        # gradient's sync is the parameter's, once a step (``passes.held`` runs it so)
        if name not in rooted:
            choice = graph.choices[name]
            rooted[name] = (
                choice.kind == "param"
                or cast_of_param(graph.choices, name) is not None
                or (
                    choice.kind == "op"
                    and choice.follower_of is not None
                    and len(choice.inputs) == 1
                    and param_rooted(choice.inputs[0][0])
                )
            )
        return rooted[name]

    sync: dict[str, list[float]] = {}
    forward: dict[str, list[float]] = {}
    cache: dict[tuple, tuple[list[float], list[float]]] = {}
    for name in graph.order:
        choice = graph.choices[name]
        if choice.info is None:
            continue
        grads = tuple(graph.choices[p].requires_grad for p, _ in choice.inputs)
        params = tuple(param_rooted(p) for p, _ in choice.inputs)
        key = (id(choice.strategies), grads, params, choice.requires_grad)
        if key not in cache:
            cache[key] = _split(
                choice, grads, params, mesh, cluster, tuple(graph.choices[p].kind == "param" for p, _ in choice.inputs)
            )
        sync[name], forward[name] = cache[key]
    return OpSplit(sync, forward, _accumulate(graph, cluster))


def _accumulate(graph: ChoiceGraph, cluster: ClusterSpec) -> dict[str, list[float]]:
    """``OpSplit.accumulate``: each stepped parameter's gradient bytes (its local bytes times its
    "grad" intervals' factors) under each strategy, added in place."""
    factor: dict[str, float] = {}
    for iv in graph.timeline.intervals:
        if iv.kind == "grad":
            factor[iv.node] = factor.get(iv.node, 0.0) + iv.factor
    return {
        name: [step_cost.accumulate_s(f * p.memory_bytes, cluster, graph.mesh_shape) for p in graph.choices[name].priced]
        for name, f in factor.items()
        if name in graph.choices
    }


def _split(choice: Choice, grads, params, mesh, cluster, placeholders) -> tuple[list[float], list[float]]:
    factor = 1.0 + compute.backward_factor(choice.info) if choice.requires_grad else 1.0
    syncs, forwards = [], []
    for index, strategy in enumerate(choice.strategies):
        param_s = other_s = 0.0
        for position, arg in enumerate(choice.info.inputs):
            if not grads[position]:
                continue
            for axis in grad_sync_axes(strategy, position):
                cost = grad_sync_cost(arg, strategy.ins[position], axis, placeholders[position], mesh, cluster)
                if params[position]:
                    param_s += cost.backward_s
                else:
                    other_s += cost.backward_s
        syncs.append(param_s)
        forwards.append(max(choice.priced[index].compute_s - param_s - other_s, 0.0) / factor)
    return syncs, forwards


class CandidateSolver:
    """The candidates of one stage mesh: ``fastest()`` first, ``leaner()`` on demand.

    One ILP serves them all. The leaner candidates are Lagrangian: the objective becomes
    time + λ · memory, where memory = Σ_n w_n · m[n, s] · x[n, s] weighs each node's bytes by
    how much of the step they are alive in its liveness intervals (a parameter counts with its
    gradient and optimizer state), and λ_j = f_j · (time / memory of the fastest plan) for the
    fractions f_j of ``LADDER``. Each rung is a point of the time-memory Pareto front, and with
    no memory rows the LP relaxation stays tight, so a rung costs one LP solve, where a
    memory-budget rung would run a MILP. ``mode="budget"`` runs those MILPs instead
    (``_budgeted``): slower, and it finds plans between the Pareto front's convex-hull points;
    ``mode="both"`` takes the candidates of both."""

    def __init__(
        self,
        graph: ChoiceGraph,
        split: OpSplit,
        num_microbatches: int,
        time_limit_s: float,
        solver: str,
        ladder: tuple[float, ...] = LADDER,
        mode: str = "lagrangian",
        hold: bool = False,
    ):
        if mode not in CANDIDATE_MODES:
            raise ConfigError(f"candidates must be one of {CANDIDATE_MODES}, got {mode!r}")
        self.graph, self.time_limit_s, self.solver, self.ladder = graph, time_limit_s, solver, ladder
        self.mode = mode
        self.ilp = ShardingILP(per_step_graph(graph, split, num_microbatches, hold), None)
        self.solves = 0
        self.laddered = False

    def fastest(self) -> list[Candidate]:
        self.solves += 1
        first = solve_ilp(self.ilp, self.time_limit_s, self.solver)
        return [Candidate(first, None)] if first.choice else []

    def leaner(self, fastest: Candidate) -> list[Candidate]:
        self.laddered = True
        found = self._budgeted(fastest) if self.mode in ("budget", "both") else []
        if self.mode in ("lagrangian", "both"):
            found += self._lagrangian(fastest)
        unique, seen = [], {tuple(sorted(fastest.solution.choice.items()))}
        for candidate in found:
            key = tuple(sorted(candidate.solution.choice.items()))
            if key not in seen:
                seen.add(key)
                unique.append(candidate)
        return unique

    def _lagrangian(self, fastest: Candidate) -> list[Candidate]:
        weight: dict[str, float] = {}
        for interval in self.graph.timeline.intervals:
            weight[interval.node] = weight.get(interval.node, 0.0) + interval.factor
        bytes_of = self.graph.bytes_of(fastest.solution.choice)
        memory_value = sum(w * bytes_of(n) for n, w in weight.items())
        time_value = fastest.solution.objective_s
        if memory_value <= 0 or time_value <= 0:
            return []
        memory = self.ilp.weighted_memory(weight)
        self.ilp.generate_all()  # every y in the objective this one is built from (``solver.problem.columns``)
        time_objective = self.ilp.problem.objective
        seen = {tuple(sorted(fastest.solution.choice.items()))}
        found = []
        try:
            for fraction in self.ladder:
                multiplier = fraction * time_value / memory_value
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self.ilp.problem.setObjective(time_objective + multiplier * memory)
                self.solves += 1
                solution = solve_ilp(self.ilp, self.time_limit_s, self.solver)
                key = tuple(sorted(solution.choice.items()))
                if solution.choice and key not in seen:
                    seen.add(key)
                    found.append(Candidate(solution, fraction))
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self.ilp.problem.setObjective(time_objective)
        return found

    def _budgeted(self, fastest: Candidate) -> list[Candidate]:
        """``mode="budget"``: the MILP under memory budgets lean + f · (fast − lean) of the
        whole traced graph's peak, f in ``BUDGET_LADDER`` (lean: every node at its leanest
        strategy, a lower bound). Reaches plans off the convex hull that the Lagrangian rungs
        miss, at a MILP per rung."""
        graph, ilp = self.graph, self.ilp
        fast = peak_memory(graph, fastest.solution).bytes
        lean = graph.timeline.peak(graph.bytes_bound(largest=False))[0]
        found = []
        for fraction in BUDGET_LADDER:
            budget = lean + fraction * (fast - lean)
            ilp.move_memory_bound(budget)
            self.solves += 1
            solution, _ = solve_within_budget(ilp, budget, self.time_limit_s, self.solver)
            if solution.choice:
                found.append(Candidate(solution, fraction))
        ilp.move_memory_bound(_NO_BOUND)  # the memory rows stay, with no effective bound
        return found


def fsdp_overlay(graph: ChoiceGraph, choice: dict[str, int], axis: int) -> dict[str, int] | None:
    """``choice`` with each trainable parameter it replicates on mesh ``axis`` sharded there (on
    its first dim that can be, a precision policy's cast following), its uses unchanged: FSDP laid
    over a plan, as torchtitan lays it over tensor parallelism. A parameter stays as it was where
    no strategy shards it so, where an edge to a use prices no gather to what the use takes, and
    where it is tied to another. None when no parameter changes."""
    followers: dict[str, list[str]] = {}
    out_edges: dict[str, list] = {}
    for name in graph.order:
        producer = graph.choices[name].follower_of
        if producer is not None:
            followers.setdefault(producer, []).append(name)
    for edge in graph.edges:
        out_edges.setdefault(edge.producer, []).append(edge)
    overlaid = dict(choice)
    tied = {name for names in graph.ties for name in names}  # one tensor, one placement: left as they are
    for name in graph.order:
        param = graph.choices[name]
        if param.kind != "param" or not param.requires_grad or not param.out_shapes or name in tied:
            continue
        spec = param.strategies[choice[name]].outs[0]
        if not isinstance(spec[axis], Replicate):
            continue
        for dim in range(len(param.out_shapes[0])):
            want = tuple(Shard(dim) if a == axis else p for a, p in enumerate(spec))
            picked = _overlaid(graph, name, want, overlaid, followers, out_edges)
            if picked is not None:
                overlaid.update(picked)
                break
    return overlaid if overlaid != choice else None


def _overlaid(graph: ChoiceGraph, name: str, want, choice: dict[str, int], followers, out_edges) -> dict[str, int] | None:
    """The strategies that give parameter ``name`` the spec ``want``, and its followers theirs,
    where every edge out of them prices the move to what its use takes; else None."""
    index = next((i for i, s in enumerate(graph.choices[name].strategies) if s.outs[0] == want), None)
    if index is None:
        return None
    picked = {name: index}
    stack = [name]
    while stack:
        producer = stack.pop()
        outs = graph.choices[producer].strategies[picked[producer]].outs
        for follower in followers.get(producer, ()):
            node = graph.choices[follower]
            spec = outs[node.inputs[0][1]]
            found = next((i for i, s in enumerate(node.strategies) if s.ins[0] == spec), None)
            if found is None:
                return None
            picked[follower] = found
            stack.append(follower)
    for producer, index in picked.items():
        outs = graph.choices[producer].strategies[index].outs
        for edge in out_edges.get(producer, ()):
            if edge.consumer in picked:
                continue
            src = outs[edge.out_index]
            dst = graph.choices[edge.consumer].strategies[choice[edge.consumer]].ins[edge.in_index]
            if src != dst and edge.price.get((src, dst)) is None:
                return None
    return picked


# A memory bound no plan reaches (solvers read 1e30 as infinite).
_NO_BOUND = 1e30


# -- per-unit prices ---------------------------------------------------------------------------


@dataclass
class UnitCosts:
    """Arrays over units (index u + 1: pre, blocks, post); see the module docstring."""

    own: np.ndarray
    prev: np.ndarray
    pre: np.ndarray
    fwd: np.ndarray
    sync: np.ndarray
    static: np.ndarray  # parameters used by this unit only, and user inputs
    saved: np.ndarray
    transient: np.ndarray
    stash: np.ndarray
    prev_bytes: np.ndarray  # (forward, backward) global bytes received from the previous block
    pre_bytes: np.ndarray  # (forward, backward) global bytes received from pre
    shared: list[tuple[float, frozenset[int]]]  # (bytes, units) of parameters several units use
    # The parameters' step (``_steps``): per unit, the optimizer's seconds and count of the
    # parameters it steps alone, the seconds a microbatch's gradients take to add into the step's
    # sum, and the gradient bytes it syncs; (optimizer s, adding s, units) of those several use.
    optimizer: np.ndarray
    optimizer_tensors: np.ndarray
    accumulate: np.ndarray
    synced_bytes: np.ndarray
    shared_steps: list[tuple[float, float, frozenset[int]]]


def _held_gather(graph: ChoiceGraph, edge, src, dst) -> bool:
    """Whether ``edge`` gathers a parameter (or its cast) on some axes and changes nothing else:
    what a pipeline that holds its gathered parameters (``StagePlan.hold_gathered``) runs once a step."""
    if cast_of_param(graph.choices, edge.producer) is None:
        return False
    return all(s == d or (isinstance(s, Shard) and isinstance(d, Replicate)) for s, d in zip(src, dst))


def unit_costs(
    graph: ChoiceGraph, layers: Layers, split: OpSplit, choice: dict[str, int], cluster: ClusterSpec, hold: bool = False
) -> UnitCosts:
    """Per-unit seconds and bytes of the plan ``choice`` on ``graph`` (module docstring).
    ``hold``: the stage gathers its parameters once a step and holds them, with their summed
    gradients, through every microbatch (``StagePlan.hold_gathered``): their gathers and
    reduce-scatters move from ``own`` (per microbatch) to ``sync`` (per step), and their whole
    bytes from the microbatches' activations to ``static``."""
    num = layers.num_blocks + 2
    mesh = graph.mesh_shape
    zeros = lambda: np.zeros(num)  # noqa: E731
    own, prev, pre, fwd, sync = zeros(), zeros(), zeros(), zeros(), zeros()
    prev_bytes, pre_bytes = np.zeros((num, 2)), np.zeros((num, 2))
    stash = zeros()
    consumers: dict[str, set[int]] = {}
    output_unit = layers.num_blocks  # the loss goes out of post

    def unit_of(name: str) -> int:
        if name in layers.unit:
            return layers.unit[name]
        return output_unit if graph.choices[name].kind == "output" else -2  # -2: a placeholder

    groups, per_use = graph.param_sync_groups()
    synced = {param for group in groups.values() if group.needed(choice) for param in group.params}
    for name in graph.order:
        u = unit_of(name)
        if u == -2:
            continue
        index = choice[name]
        if name in split.sync:
            own[u + 1] += graph.choices[name].priced[index].compute_s - split.sync[name][index]
            # the parameter reductions the runtime buckets are charged below, once per parameter
            sync[u + 1] += max(split.sync[name][index] - (per_use[name][index] if name in per_use else 0.0), 0.0)
            fwd[u + 1] += split.forward[name][index]
    received: dict[tuple[int, str, int], tuple[float, float]] = {}
    for edge in graph.edges:
        cu, pu = unit_of(edge.consumer), unit_of(edge.producer)
        producer, consumer = graph.choices[edge.producer], graph.choices[edge.consumer]
        src = producer.strategies[choice[edge.producer]].outs[edge.out_index]
        dst = consumer.strategies[choice[edge.consumer]].ins[edge.in_index]
        seconds = edge.price.get((src, dst), (0.0, 0.0))[0] if src != dst else 0.0
        if pu == -2:
            consumers.setdefault(edge.producer, set()).add(cu)
        if pu == -2 or pu == cu:
            if hold and seconds and _held_gather(graph, edge, src, dst):
                sync[cu + 1] += seconds
                synced.add(cast_of_param(graph.choices, edge.producer))
                continue
            own[cu + 1] += seconds
            if seconds:
                cost = comm.transition_cost(src, dst, edge.shape, edge.dtype, mesh, cluster, edge.requires_grad, edge.grad_dtype)
                fwd[cu + 1] += cost.forward_s if cost is not None else 0.0
            continue
        (pre if pu == -1 else prev)[cu + 1] += seconds
        whole = float(memory.tensor_bytes(edge.shape, edge.dtype))
        received[(cu, edge.producer, edge.out_index)] = (whole, whole if edge.requires_grad else 0.0)
    # Each parameter's gradient is reduced once per step, in a bucket, at the price the ILP pays
    # (``choices.param_sync_groups``), in the unit of its first consumer.
    for group in groups.values():
        if group.needed(choice):
            for param in group.params:
                sync[min(consumers.get(param) or {-1}) + 1] += group.price_s
    for (cu, producer_name, out_index), (fwd_bytes, bwd_bytes) in received.items():
        target = pre_bytes if layers.unit.get(producer_name, -2) == -1 else prev_bytes
        target[cu + 1] += (fwd_bytes, bwd_bytes)
        producer = graph.choices[producer_name]
        spec = producer.strategies[choice[producer_name]].outs[out_index]
        stash[cu + 1] += memory.local_bytes(producer.out_shapes[out_index], producer.out_dtypes[out_index], spec, mesh)
    static, saved, transient, shared = _memory(graph, layers, choice, consumers, unit_of, num, hold)
    steps = _steps(graph, split, choice, consumers, synced, cluster, num)
    return UnitCosts(own, prev, pre, fwd, sync, static, saved, transient, stash, prev_bytes, pre_bytes, shared, *steps)


def _steps(
    graph: ChoiceGraph,
    split: OpSplit,
    choice: dict[str, int],
    consumers: dict[str, set[int]],
    synced: set[str],
    cluster: ClusterSpec,
    num: int,
):
    """``UnitCosts``' step fields. Each parameter the optimizer steps costs its
    ``cost.optimizer.tensor_step_s`` in the unit of its consumers (in every stage holding one of
    them, where several units use it: a tied embedding), and each microbatch but the first adds
    its gradient into the step's sum there (``OpSplit.accumulate``). Its gradient's bytes count
    towards the buckets of its first consumer's unit where it is synced (``synced``), as ``sync``."""
    implementation = step_cost.implementation(cluster, graph.optimizer)
    leader = {member: names[0] for names in graph.ties for member in names}
    used: dict[str, set[int]] = {}
    for name, units in consumers.items():
        used.setdefault(leader.get(name, name), set()).update(units)
    optimizer, tensors, accumulate, synced_bytes = np.zeros(num), np.zeros(num), np.zeros(num), np.zeros(num)
    shared: list[tuple[float, float, frozenset[int]]] = []
    synced = {leader.get(name, name) for name in synced}  # a tied parameter's sync is its first name's
    for name, (fused, grad) in step_cost.stepped_params(graph.timeline.intervals, graph.bytes_of(choice)).items():
        if leader.get(name, name) != name:
            continue  # a tied parameter is stepped once, as its first name
        seconds = step_cost.tensor_step_s(fused, cluster, implementation, graph.mesh_shape)
        adding = split.accumulate[name][choice[name]] if name in split.accumulate else 0.0
        units = used.get(name) or {-1}
        if name in synced:
            synced_bytes[min(units) + 1] += grad
        if len(units) == 1:
            optimizer[min(units) + 1] += seconds
            tensors[min(units) + 1] += 1
            accumulate[min(units) + 1] += adding
        else:
            shared.append((seconds, adding, frozenset(units)))
    return optimizer, tensors, accumulate, synced_bytes, shared


def _memory(graph: ChoiceGraph, layers: Layers, choice: dict[str, int], consumers, unit_of, num: int, hold: bool = False):
    timeline = graph.timeline
    end = len(timeline.names) - 1  # the end of forward
    static_of: dict[str, float] = {}
    held: dict[str, dict[str, float]] = {}  # under ``hold``: gathered parameter → its largest size by kind
    curves = np.zeros((num, timeline.num_times + 1))
    bytes_of = graph.bytes_of(choice)
    for interval in timeline.intervals:
        size = interval.factor * bytes_of(interval.node)
        if interval.kind in _STATIC_KINDS:
            static_of[interval.node] = static_of.get(interval.node, 0.0) + size
            continue
        owner = interval.node.removeprefix(GATHERED)  # a gathered parameter: its placeholder's
        if hold and owner != interval.node:
            sizes = held.setdefault(owner, {})
            sizes[interval.kind] = max(sizes.get(interval.kind, 0.0), size)
            continue
        u = unit_of(owner)
        if u == -2:  # a placeholder's activation gradient (or a gathered one): charge its first consumer
            u = min(consumers.get(owner, {0}))
        curves[u + 1, interval.start] += size
        curves[u + 1, interval.end + 1] -= size
    for owner, sizes in held.items():  # held all step: the whole parameter, and its summed gradient
        whole = sizes.get("gathered", 0.0)
        static_of[owner] = static_of.get(owner, 0.0) + whole + sizes.get("comm_buffer", whole)
    curves = np.cumsum(curves, axis=1)[:, :-1]
    saved = curves[:, end].copy()
    transient = np.maximum(curves.max(axis=1) - saved, 0.0)
    static = np.zeros(num)
    shared: list[tuple[float, frozenset[int]]] = []
    for name, size in static_of.items():
        units = consumers.get(name) or {-1}
        if len(units) == 1:
            static[min(units) + 1] += size
        else:
            shared.append((size, frozenset(units)))
    return static, saved, transient, shared


def build_stage_graph(
    traced: TracedModel,
    stage_mesh: tuple[int, ...],
    cluster: ClusterSpec,
    optimizer_dtype=None,
    forced=None,
    optimizer: str = DEFAULT_OPTIMIZER,
) -> ChoiceGraph:
    """The choice graph of one stage mesh (``optimizer_dtype``: a precision policy's, fp32 by default;
    ``forced``: node name → spec a hand plan fixes, as ``solver.solve``'s; ``optimizer``: the one
    the step is priced for)."""
    start = time.perf_counter()
    dtype = {} if optimizer_dtype is None else {"optimizer_dtype": optimizer_dtype}
    # padded=False: a pipeline stage holds plain, equal shards (runtime.padded). Its graph gathers a
    # parameter where a use needs it, and autograd keeps the gathered tensor for that microbatch's
    # backward (``passes.held``): no reshard after forward, so each microbatch in flight holds one.
    graph = build_choice_graph(
        traced,
        stage_mesh,
        cluster,
        forced=forced,
        optimizer=optimizer,
        offers=Offers(padded=False),
        comm=CommOptions(reshard_after_forward=False),
        **dtype,
    )
    log.debug("stage mesh %s: choice graph in %.2f s", stage_mesh, time.perf_counter() - start)
    # A pipeline stage holds its parameters as plain shards: its optimizer step pays no DTensor dispatch.
    return dataclasses.replace(graph, dtensor_step_s=0.0)


__all__ = [
    "Layers",
    "cluster_layers",
    "Candidate",
    "CandidateSolver",
    "OpSplit",
    "split_op_costs",
    "UnitCosts",
    "unit_costs",
    "build_stage_graph",
    "per_step_graph",
    "fsdp_overlay",
    "PRE",
    "POST",
]
