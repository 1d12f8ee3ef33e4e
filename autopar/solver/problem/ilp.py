r"""The sharding ILP.

Sets
    N            free nodes (followers are not variables; see below)
    S_n          strategies of node n
    E            edges (u, j) → (v, i): output j of u feeds tensor input i of v
    O_e, I_e     distinct specs of u's output j, and of v's input i, over their strategies
    T_e ⊆ O_e×I_e  transitions that exist (none into Partial; none on a tensor written in place);
                 on meshes of three or more axes, only the near ones (``edges.near_pairs``)
                 that the hub prices higher (``EdgePrices.direct_items``; all of them on the
                 edge of a parameter the runtime gathers whole: its memory rows weigh y)
    H_e          on those meshes: the hub of e, the transitions through the replicated spec ρ

Variables
    x[n, s] ∈ {0, 1}      node n uses strategy s
    y[e, p, q] ∈ [0, 1]   edge e carries spec p out of u and spec q into v, for (p, q) ∈ T_e
    h_out[e, p], h_in[e, q] ∈ [0, 1]   (e ∈ H) edge e carries p out of u and q into v by way of ρ:
                          any pair not in T_e, priced r[e, p, ρ] + r[e, ρ, q] (an upper bound of
                          r[e, p, q], which the plan reports); none for q Partial

    A follower f of producer u (getitem, views, elementwise ops; ``choices._mark_followers``)
    has no variables of its own: x[f, s] ≡ Σ_{t ∈ S_u : out_j(t) = in_0(s)} x[u, t].

Objective (seconds of one training step, forward and backward)
    min  Σ_n Σ_s c[n, s] · x[n, s]  +  Σ_e Σ_{(p,q) ∈ T_e} r[e, p, q] · y[e, p, q]
    c = compute (roofline) + backward gradient all-reduces of the strategy's activation inputs,
        one per use (a parameter's per-use all-reduces are taken out of c: see z);
    r = the collectives of ``spec.transition_steps(p, q)`` and their backward duals;
    + Σ_{e ∈ H} (Σ_p r[e, p, ρ] · h_out[e, p] + Σ_q r[e, ρ, q] · h_in[e, q]);
    + Σ_g P_g · z[g]: each parameter gradient reduction g (a parameter, a mesh axis, the spec it
      is held in; ``choices.param_sync_groups``) once, at its bucketed price P_g, however many
      uses need it, as the runtime runs it (``passes.schedule``).
    + Σ_{n param} Σ_s o[n, s] · x[n, s]: the optimizer step of the parameter's local shard, its
      gradient and state under strategy s (``solver.problem.optimizer_terms``), so that a layout
      that shards parameters or their state is paid back for the step it shards.
    + D · d: DTensor's dispatch in that step, where any parameter is sharded (d below; D = 0, and
      no d, on clusters that have not measured it).
    + E_f + E_b: communication as the runtime overlaps it, where it does (NCCL, a mesh of one or
      two axes larger than 1; ``solver.problem.gather_overlap``): a gathered parameter's
      first-use edge pays its flat-buffer copies in place of the gather r prices; E_f what the
      least forward compute F does not hide of FSDP's gathers as run, and E_b what the least
      backward compute B does not hide of the re-gathers and the gradient reductions, whose
      P_g · z[g] then leave the objective but for the last bucket's (rows below). Elsewhere
      (gloo, three axes, nothing gathered) z is paid whole. The compute is a constant there: a
      row over every x (E ≥ Σ (g − b)·x) made CBC miss optimality on a 3-layer LLaMA in 120 s.
    What backward hides of the buckets on the solved plan's own compute is priced after the
    solve (``solver.pricing.comm_schedule``, ``predicted.exposed_grad_sync_s``), as are one
    gather per parameter, FSDP's reduce-scatter and the buckets' whole latencies
    (``predicted.grad_schedule.post_solve_s``).

Constraints
    pick[n]:           Σ_s x[n, s] = 1                                        ∀ n ∈ N
    edge_out[e, p]:    Σ_q y[e, p, q] (+ h_out[e, p]) = Σ_{s : out_j(s) = p} x[u, s]   ∀ e, p ∈ O_e
    edge_in[e, q]:     Σ_p y[e, p, q] (+ h_in[e, q]) = Σ_{s : in_i(s) = q} x[v, s]     ∀ e, q ∈ I_e
                       (so Σ_p h_out[e, p] = Σ_q h_in[e, q]: what leaves by the hub arrives by it)
    memory[t]:         Σ_{(n, f) alive at t} f · Σ_s m[n, s] · x[n, s]
                       + Σ_{(g, f) alive at t} f · Σ_{(p,q)} G[g, p, q] · y[e_g, p, q] ≤ B   (if a budget B)
                       where g is a parameter the runtime gathers whole (``solver.problem.gathered``),
                       e_g its first use's edge, G its bytes when p → q is one all-gather
    tie[a, b, s]:      x[a, s] = x[b, s]      for placeholders a, b naming one tensor (tied weights)
    param_sync[g, v, i]: z[g] ≥ Σ_{s ∈ U} x[v, s]  for each use (v, i) of reduction g, U the
                       strategies of v that reduce input i's gradient so; z ∈ [0, 1] continuous
                       (at an optimum z is the max of its rows: 0 or 1 for integer x)
    dtensor_params[n]: d ≥ Σ_{s not replicated} x[n, s]   ∀ parameters n; d ∈ [0, 1] continuous
    exposed_gathers:   E_f ≥ Σ_g Σ_{(p,q)} a[g, p, q] · y[e_g, p, q] − F, and E_b the same over the
                       parameters whose layer gathers them again in backward, + Σ_g P_g · z[g],
                       less B; E ≥ 0 continuous (a: one gather as run, bytes and a share of its
                       group's latency)

    Repeated layers (``choices.repeated_layers``) share variables outright: a node of layer k
    uses the x of its counterpart in the first layer, and an edge whose two ends share x with
    an earlier edge's ends (inside a layer, or from one layer into the next) uses that edge's y,
    whose constraints already stand. Costs and memory still count every layer, because the
    shared variables collect every layer's coefficients. A layer's node that reads another
    layer's output (or the embedding, in the first) is never a follower
    (``choices._boundary_nodes``): the edge into it is a real one, shared by the layers.

    The two edge families make y the joint distribution of the two endpoint choices, which is
    exact for 0/1 x and gives a tight LP relaxation.

    On those meshes the y of a hub edge (not a gathered parameter's) are *held*
    (``solver.problem.columns``): columns of the HiGHS model of the LP relaxation, with their
    two edge rows and their objective coefficient, but no PuLP variable until a solution sets
    them above 0 (``generate``). The LP is the same; a MILP or another objective takes them all
    first (``generate_all``).

    Memory is the peak of a liveness walk (``autopar.cost.liveness``) over 2N times: forward
    after each node, then backward of each node in reverse. m[n, s] is the local bytes of n's
    outputs under strategy s; each stored tensor is an interval of times with a factor on the m
    of its owner (a parameter's shard, its gradient from its last use's backward to the end,
    its optimizer state; user inputs and buffers; each op's output from the op to its last
    forward use, or to the backward of the first op that saves it; the gradient of each op's
    output in backward). memory[t] is linear in x, so the peak ≤ B is one constraint per time.
    Rather than 2N constraints, ``memory[t]`` stands at a handful of times t: the end of
    forward and the highest local maxima of the curve when every node takes its leanest, or
    its largest, strategy. ``solve`` then checks the solution's whole curve and adds memory[t]
    at the time of any overshoot, and solves again (a cutting-plane loop; in practice zero or
    one extra round). With repeated layers the terms of all layers fall on the shared
    variables, so each memory[t] keeps the size of one layer's variables. The rows are written
    in GiB (``MEMORY_UNIT``). ``solver="auto"`` does not branch on them: ``solver.search.budget``
    relaxes them into the objective at the prices of their LP duals (Lagrangian relaxation) and
    rounds, and the MILP runs only where that leaves a gap above ``budget.MILP_GAP``.

Every constraint is named ``<family>__<node>[__<detail>]`` so that an infeasible model or a
choice can be traced back to the family that forced it.
"""

from __future__ import annotations

import inspect
import itertools
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from autopar.ir.spec import Spec, format_spec
from autopar.solver.problem.choices import ChoiceGraph, strategies_by_spec
from autopar.solver.problem.columns import HeldColumns
from autopar.solver.problem.rows import RowTable, rows_by_name
from autopar.solver.problem.terms import compute_coefficients

# Memory rows are written in GiB: in bytes their coefficients (up to 1e10) next to the 0/1
# variables made HiGHS call a feasible peak-minimisation infeasible.
MEMORY_UNIT = 2**30


@dataclass(frozen=True, slots=True)
class Solution:
    choice: dict[str, int]  # node name → strategy index
    edge_specs: dict[int, tuple[Spec, Spec]]  # edge index → (src, dst) spec used
    status: str
    objective_s: float
    solve_time_s: float
    num_variables: int
    num_constraints: int
    method: str = "milp"  # "milp" | "lp-rounding" | "greedy" (see ``solving``)
    backend: str = "cbc"  # "highs" | "cbc": the solver that produced it
    bound_s: float | None = None  # best proven lower bound on the optimum
    gap: float | None = None  # (objective_s - bound_s) / objective_s


class ShardingILP:
    """Builds the formulation above from a ChoiceGraph and solves it with PuLP."""

    def __init__(self, graph: ChoiceGraph, memory_budget_bytes: float | None = None):
        # PuLP 3.x deprecates the 2.x construction API we use to stay compatible with both.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self._build(graph, memory_budget_bytes)

    def _build(self, graph: ChoiceGraph, memory_budget_bytes: float | None) -> None:
        self.graph = graph
        self.problem = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
        self.x: dict[str, list[pulp.LpAffineExpression | pulp.LpVariable]] = {}
        self.y: dict[int, dict[tuple[Spec, Spec], pulp.LpVariable]] = {}
        self._y_seconds: dict[int, list[float]] = {}  # r[e, p, q] of each y[e], in its order
        # Edge → (h_out by src spec, h_in by dst spec), where its prices have a hub (``_add_hub``).
        self.hub: dict[int, tuple[dict[Spec, pulp.LpVariable], dict[Spec, pulp.LpVariable]]] = {}
        self._node_ids = {name: i for i, name in enumerate(graph.order)}
        self.memory_times: set[int] = set()  # timeline times with a memory[t] constraint
        self.relaxation = None  # the HiGHS model of the LP relaxation, kept between solves (``solver.search.relaxation``)
        self._variables: tuple | None = None  # ``variables``: (rows read, objective, variables, their ids)
        self._memory_terms: _MemoryTerms | None = None  # ``weighted_memory``'s table, built on first use
        self._rows: RowTable | None = None  # ``row_table``, grown as rows are added
        self.held = HeldColumns()  # the y of hub edges, columns of the LP alone (``columns``)
        self.generated: list[tuple[pulp.LpVariable, int]] = []  # y taken from ``held``: (var, its position there)
        self.add_node_variables()
        self.add_pick_constraints()
        self.add_edge_constraints()
        if memory_budget_bytes is not None:
            self.add_memory_constraint(memory_budget_bytes)
        self.add_tie_constraints()
        self.add_param_sync_variables()
        self.add_dtensor_variable()
        self.add_exposed_gathers()
        self.set_objective()

    # -- variables ----------------------------------------------------------------------------
    def add_node_variables(self) -> None:
        by_spec: dict[tuple[str, int], dict[Spec, list]] = {}  # the last leader's x by output spec
        for name in self.graph.order:
            choice = self.graph.choices[name]
            template = self.graph.layer_template.get(name)
            if template is not None:
                self.x[name] = self.x[template]
            elif choice.follower_of is not None:
                producer, out_index = choice.inputs[0]
                key = (producer, out_index)
                if key not in by_spec:  # the leader's x by output spec, once per leader
                    by_spec.clear()
                    by_spec[key] = grouped = {}
                    for t, s in enumerate(self.graph.choices[producer].strategies):
                        grouped.setdefault(s.outs[out_index], []).append(self.x[producer][t])
                grouped = by_spec[key]
                self.x[name] = [pulp.lpSum(grouped.get(strategy.ins[0], [])) for strategy in choice.strategies]
            elif len(choice.strategies) == 1:
                self.x[name] = [pulp.LpAffineExpression(constant=1)]
            else:
                node_id = self._node_ids[name]
                self.x[name] = [pulp.LpVariable(f"x_{node_id}_{s}", cat=pulp.LpBinary) for s in range(len(choice.strategies))]

    # -- constraint families ------------------------------------------------------------------
    def add_pick_constraints(self) -> None:
        for name in self.graph.order:
            choice = self.graph.choices[name]
            if name in self.graph.layer_template:
                continue
            if choice.follower_of is None and len(choice.strategies) > 1:
                self.problem += pulp.lpSum(self.x[name]) == 1, f"pick__{self._node_ids[name]}"

    def add_edge_constraints(self) -> None:
        template = self.graph.layer_template
        first_edge: dict[tuple, int] = {}
        names: dict[int, tuple[Spec, str]] = {}  # by the spec's identity (the spec kept alive with it)
        by_spec: dict[Spec, str] = {}  # then by the spec (equal specs held by other objects)

        def spec_name(spec: Spec) -> str:
            found = names.get(id(spec))
            if found is None:
                name = by_spec.get(spec)
                if name is None:
                    name = by_spec[spec] = _spec_name(spec)
                found = names[id(spec)] = (spec, name)
            return found[1]

        # A gathered parameter's edge keeps a y for every pair: its memory rows weigh them
        # (``_MemoryTerms``), which a pair routed through the hub would not be.
        gathered = {item.edge for item in self.graph.gathered.values()}
        groups: dict[tuple, tuple] = {}  # ``_spec_groups``'
        for e, edge in enumerate(self.graph.edges):
            consumer = self.graph.choices[edge.consumer]
            if consumer.follower_of == edge.producer:
                continue  # the follower's choice already equals its producer's output spec
            # Edges whose two ends share x variables (repeated layers) and whose prices agree
            # have identical marginals: one y serves them all, and its constraints stand once.
            key = (
                template.get(edge.producer, edge.producer),
                edge.out_index,
                template.get(edge.consumer, edge.consumer),
                edge.in_index,
                None if getattr(edge.price, "hub", None) is None else e in gathered,
            )
            twin = first_edge.setdefault(key, e)
            twin_price = self.graph.edges[twin].price
            if twin != e and twin in self.y and (twin_price is edge.price or twin_price == edge.price):
                self.y[e] = self.y[twin]
                self._y_seconds[e] = self._y_seconds[twin]
                if twin in self.hub:
                    self.hub[e] = self.hub[twin]
                continue
            producer = self.graph.choices[edge.producer]
            # In spec order, which is deterministic; pairs the hub prices as low have none, and
            # a hub edge's others are held as columns of the LP alone (``columns``).
            held = getattr(edge.price, "held_pairs", lambda: None)() if e not in gathered else None
            items = () if held is not None else edge.price.items()
            self.y[e] = {pair: _variable(f"y_{e}_{k}") for k, (pair, _) in enumerate(items)}
            self._y_seconds[e] = [seconds for _, (seconds, _) in items]
            # Group once, so each family is linear in the number of y and x terms.
            y_out, y_in = _by_spec(self.y[e])
            self._add_hub(e, edge, y_out, y_in)
            x_out, x_in = self.x[edge.producer], self.x[edge.consumer]
            out_groups = _spec_groups(producer.strategies, True, edge.out_index, groups)
            in_groups = _spec_groups(consumer.strategies, False, edge.in_index, groups)
            row = len(self.rows_by_name())
            srcs, dsts = list(out_groups), list(in_groups)
            for p, at in out_groups.items():
                x_p = [x_out[s] for s in at]
                self.problem += _difference(y_out.get(p, []), x_p) == 0, f"edge_out__{e}__{spec_name(p)}"
            for q, at in in_groups.items():
                x_q = [x_in[s] for s in at]
                self.problem += _difference(y_in.get(q, []), x_q) == 0, f"edge_in__{e}__{spec_name(q)}"
            if held is not None:
                self.held.hold(e, self.y[e], self._y_seconds[e], (list(srcs), list(dsts)), held, row)

    def _add_hub(self, e: int, edge, y_out: dict[Spec, list], y_in: dict[Spec, list]) -> None:
        """h_out[e, p], h_in[e, q]: the flow of edge e through the replicated spec, where its
        price table has a hub (``edges.EdgePrices``: meshes of three or more axes). They join
        the marginals as y does; Σ_p h_out = Σ_q h_in follows from them."""
        hub = getattr(edge.price, "hub", None)
        if hub is None:
            return
        outs = {spec: _variable(f"h_{e}_o{k}") for k, spec in enumerate(hub[0])}
        ins = {spec: _variable(f"h_{e}_i{k}") for k, spec in enumerate(hub[1])}
        self.hub[e] = (outs, ins)
        for spec, var in outs.items():
            y_out.setdefault(spec, []).append(var)
        for spec, var in ins.items():
            y_in.setdefault(spec, []).append(var)

    def add_memory_constraint(self, budget: float) -> None:
        """memory[t] <= B at the checkpoint times (``Timeline.checkpoints``), B = ``budget`` bytes."""
        timeline = self.graph.timeline
        for time in timeline.checkpoints([self.graph.bytes_bound(largest=False), self.graph.bytes_bound(largest=True)]):
            self.add_memory_constraint_at(time, budget)

    def add_memory_constraint_at(self, time: int, budget: float) -> None:
        """memory[t] <= B at one more time t (the solve adds the times a solution overshoots)."""
        if time not in self.memory_times:
            self.memory_times.add(time)
            self.problem += (self.memory_expression(time) <= budget / MEMORY_UNIT, self.memory_constraint_name(time))

    def move_memory_bound(self, budget: float) -> None:
        """Put every memory[t] row at B = ``budget`` bytes, adding the rows the first time."""
        if not self.memory_times:
            self.add_memory_constraint(budget)
        rows = self.rows_by_name()
        for time in self.memory_times:
            rows[self.memory_constraint_name(time)].changeRHS(budget / MEMORY_UNIT)

    def rows_by_name(self) -> dict[str, pulp.LpConstraint]:
        """The problem's rows by name, in the order they were added (``rows_by_name``)."""
        return rows_by_name(self.problem)

    def memory_constraint_name(self, time: int) -> str:
        num = len(self.graph.order)
        node_id = time if time < num else 2 * num - 1 - time
        return f"memory__{'fwd' if time < num else 'bwd'}__{node_id}"

    def memory_expression(self, time: int) -> pulp.LpAffineExpression:
        """Memory alive per device at timeline time ``time``, in ``MEMORY_UNIT`` bytes:
        Σ factor · m[n, s] · x[n, s] over the liveness intervals alive then."""
        return self.weighted_memory(self.graph.timeline.factors_at(time), 1.0 / MEMORY_UNIT)

    def weighted_memory(self, factors: dict[str, float], unit: float = 1.0) -> pulp.LpAffineExpression:
        """Σ factor · bytes over timeline names: a node's m[n, s] · x[n, s]; a gathered
        parameter's bytes per (p, q) of its edge times y[e, p, q] (``solver.problem.gathered``).

        ``weighted_sum`` of the terms (factor · m · unit, x) of every name in ``factors`` (nodes,
        then gathered parameters, in ``factors``' order), with numpy on ``_MemoryTerms``: the
        same products, summed per variable in the same order (``np.add.at``), the variables in
        order of their first term. Repeated layers share variables, so a row has the size of one
        layer's variables while its terms count every layer's: in Python that took seconds."""
        if self._memory_terms is None:
            self._memory_terms = _MemoryTerms(self)
        return self._memory_terms.weighted(factors, unit)

    def minimize_peak_memory(self, times: list[int]) -> None:
        """Replace the objective by the peak of memory[t] over ``times`` (``solve`` uses it to
        say how much memory the leanest plan needs)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            peak = pulp.LpVariable("peak_memory_bytes", lowBound=0)
        for time in times:
            self.problem += self.memory_expression(time) <= peak, f"peak_{self.memory_constraint_name(time)}"
        self.problem.setObjective(pulp.LpAffineExpression(peak))

    def add_tie_constraints(self) -> None:
        for group in self.graph.ties:
            first = group[0]
            for other in group[1:]:
                for s, (a, b) in enumerate(zip(self.x[first], self.x[other])):
                    self.problem += a == b, f"tie__{self._node_ids[first]}__{self._node_ids[other]}__{s}"

    def add_param_sync_variables(self) -> None:
        """z[g] ≥ Σ_{s ∈ U} x[v, s] for each use (v, i) of a parameter reduction g
        (``choices.param_sync_groups``: one parameter, mesh axis and held spec), where U are the
        strategies of v that all-reduce input i's gradient that way.

        The runtime reduces a parameter's gradient once, in a bucket, however many uses it has
        (``passes.schedule``); z is 1 when any use needs that reduction, and the objective pays
        the bucketed price once per parameter of the group instead of an all-reduce per use."""
        groups, self.per_use_refund = self.graph.param_sync_groups()
        self.z: dict[tuple, pulp.LpVariable] = {}
        self._z_uses: dict[tuple, list[pulp.LpAffineExpression]] = {}  # every lower bound of z
        self._z_price: dict[tuple, float] = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            for g, (key, group) in enumerate(groups.items()):
                self.z[key] = z = pulp.LpVariable(f"z_{g}", lowBound=0, upBound=1)
                self._z_price[key] = group.total_s
                self._z_uses[key] = []
                for (consumer, index), strategies in group.uses.items():
                    lower = pulp.lpSum([self.x[consumer][s] for s in sorted(strategies)])
                    self._z_uses[key].append(lower)
                    self.problem += _difference([z], [lower]) >= 0, f"param_sync__{g}__{self._node_ids[consumer]}__{index}"

    def add_dtensor_variable(self) -> None:
        """d ≥ Σ_{s not replicated} x[n, s] for each parameter n, priced D = ``graph.dtensor_step_s``
        (``solver.problem.optimizer_terms``): where any parameter is sharded the runtime holds them
        all as DTensors, and the optimizer step pays DTensor's dispatch once for the plan. d joins
        the z family (``z``, its price, its lower bounds), whose objective terms and values at an
        integer x (``param_sync_values``) it shares."""
        price = self.graph.dtensor_step_s
        if not price:
            return
        key = ("dtensor_params",)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.z[key] = d = pulp.LpVariable("d_dtensor_params", lowBound=0, upBound=1)
        self._z_price[key] = price
        self._z_uses[key] = []
        seen: set[int] = set()
        for name in self.graph.order:
            choice = self.graph.choices[name]
            if choice.kind != "param" or id(self.x[name]) in seen:
                continue
            seen.add(id(self.x[name]))  # repeated layers and tied weights share their x
            sharded = [x for s, x in zip(choice.strategies, self.x[name]) if not all(p.is_replicate() for p in s.outs[0])]
            if sharded:
                lower = pulp.lpSum(sharded)
                self._z_uses[key].append(lower)
                self.problem += _difference([d], [lower]) >= 0, f"dtensor_params__{self._node_ids[name]}"

    def add_exposed_gathers(self) -> None:
        """E_f ≥ Σ run · y − F and E_b ≥ Σ_{regathered} run · y + Σ P · z − B, E ≥ 0, over the
        gathered parameters' first-use edges: FSDP's gathers in forward (and again in backward,
        where the layer reshards, beside the gradient reductions z) as the runtime runs them,
        less the compute that hides them; the objective pays E_f + E_b, each gather's copies in
        place of the edge's price of the gather, and z nothing of its own
        (``solver.problem.gather_overlap``; none where nothing overlaps: gloo, three axes)."""
        # (E, its row's y and z → seconds, the seconds hidden, the unit E counts in)
        self.exposed_gathers: list[tuple[pulp.LpVariable, dict, float, float]] = []
        self._hidden_z: dict[tuple, float] = {}  # z → the seconds of its price that E_b holds
        self._gather_adjust: dict[pulp.LpVariable, float] = {}  # y → its objective coefficient's change
        overlap = self.graph.overlap
        if overlap is None:
            return
        forward: dict[pulp.LpVariable, float] = {}
        backward: dict[pulp.LpVariable, float] = {}
        for item in overlap.items:
            variables = self.y.get(item.edge, {})
            for pair, (priced, run, copies) in item.pairs.items():
                var = variables.get(pair)
                if var is not None:
                    self._gather_adjust[var] = self._gather_adjust.get(var, 0.0) + copies - priced
                    forward[var] = forward.get(var, 0.0) + run
                    if item.regathered:
                        backward[var] = backward.get(var, 0.0) + run
        # The gradient reductions run on the backward stream, beside the re-gathers, behind
        # backward compute: E_b holds them, and the objective pays z nothing of its own.
        # (The last bucket's, reduced when backward has nothing left to hide them, stay paid whole.)
        groups, _ = self.graph.param_sync_groups()
        self._hidden_z = {key: overlap.hidden_s(group) for key, group in groups.items() if key in self.z}
        for key, seconds in self._hidden_z.items():
            if seconds:
                backward[self.z[key]] = backward.get(self.z[key], 0.0) + seconds
        for side, runs, hidden in (("forward", forward, overlap.forward_s), ("backward", backward, overlap.backward_s)):
            if not runs:
                continue
            # E in units of the row's own size, so that E, its bound and its row are O(1): in
            # seconds (10^-6 on a small model) they would sit below the solvers' tolerances.
            unit = max(hidden, sum(runs.values())) or 1.0
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                exposed = pulp.LpVariable(f"e_exposed_gathers_{side}", lowBound=0)
            self.exposed_gathers.append((exposed, runs, hidden, unit))
            row = pulp.LpAffineExpression({exposed: 1.0, **{var: -seconds / unit for var, seconds in runs.items()}})
            self.problem += row >= -hidden / unit, f"exposed_gathers__{side}"

    def exposed_gathers_values(self) -> list[tuple[pulp.LpVariable, float]]:
        """Each E and the value it takes at the current y and z: the least its row allows (in its unit)."""
        return [
            (exposed, max(0.0, sum(seconds * float(var.varValue or 0.0) for var, seconds in runs.items()) - hidden) / unit)
            for exposed, runs, hidden, unit in self.exposed_gathers
        ]

    def param_sync_values(self) -> dict[tuple, float]:
        """The value each z takes at the current x: the largest of its lower bounds
        (``rounding.check`` sets them for an integer assignment)."""
        return {key: max((float(pulp.value(e) or 0.0) for e in exprs), default=0.0) for key, exprs in self._z_uses.items()}

    def set_objective(self) -> None:
        refund, order = self.per_use_refund, self.graph.order
        compute_s = {name: self.graph.objective_s(name) for name in order}  # a parameter's with its optimizer step
        # The same sum as the terms below, added with numpy (``terms``); one by one where it cannot.
        compute = compute_coefficients(order, compute_s, self.x, refund)
        compute_terms = (
            (c - (refund[name][s] if name in refund else 0.0), x)
            for name in (order if compute is None else ())
            for s, (c, x) in enumerate(zip(compute_s[name], self.x[name]))
            if c - (refund[name][s] if name in refund else 0.0)
        )
        sync_terms = (
            (self._z_price[key] - self._hidden_z.get(key, 0.0), z)
            for key, z in self.z.items()
            if self._z_price[key] - self._hidden_z.get(key, 0.0)
        )
        # Edges that share y (repeated layers) have equal prices: count each shared y once,
        # weighted by how many edges use it, at the prices y was built with (``_y_seconds``).
        shared: dict[int, list] = {}
        for e, variables in self.y.items():
            entry = shared.setdefault(id(variables), [variables, self._y_seconds[e], 0])
            entry[2] += 1
        # Per shared y, its terms' count; a held group's (``columns``) ("held", its index): where
        # ``_order_objective`` puts the y it generates.
        held_groups = {id(group[1]): g for g, group in enumerate(self.held.groups)}
        reshard_terms, layout = [], []
        adjust = self._gather_adjust
        for variables, prices, count in shared.values():
            terms = [
                (count * seconds + adjust.get(var, 0.0), var)
                for seconds, var in zip(prices, variables.values())
                if count * seconds + adjust.get(var, 0.0)
            ]
            reshard_terms += terms
            layout.append(("held", held_groups[id(variables)]) if id(variables) in held_groups else ("terms", len(terms)))
        hubs: dict[int, list] = {}
        for e, (outs, ins) in self.hub.items():
            entry = hubs.setdefault(id(outs), [outs, ins, self.graph.edges[e].price.hub, 0])
            entry[3] += 1
        hub_terms = [
            (count * seconds[spec], var)
            for outs, ins, hub, count in hubs.values()
            for variables, seconds in ((outs, hub[0]), (ins, hub[1]))
            for spec, var in variables.items()
            if seconds[spec]
        ]
        sync_terms = list(sync_terms)
        sync_terms += [(unit, exposed) for exposed, _, _, unit in self.exposed_gathers]
        # y, h, z and E are in no other term, each once (shared y and hubs are counted once above).
        distinct = itertools.chain(reshard_terms, hub_terms, sync_terms)
        self.problem += weighted_sum(compute_terms, distinct=distinct, start=compute)
        self.time_objective = self.problem.objective  # the objective the held y are priced in
        size = len(self.time_objective)
        self._objective_layout = (size - len(reshard_terms) - len(hub_terms) - len(sync_terms), layout, size)
        self._generated_terms: dict[int, list[tuple[int, pulp.LpVariable, float]]] = {}  # by held group
        self.held.weigh({key: count for key, (_, _, count) in shared.items()})

    def _order_objective(self) -> None:
        """The time objective with the generated y where ``set_objective`` would have put them had
        they been variables then (each held group's at its place, by position): a sum over it
        adds the same terms in the same order, as the y left held are 0."""
        compute, layout, size = self._objective_layout
        old = self.time_objective
        items = list(old.items())
        ordered, at = items[:compute], compute
        for kind, value in layout:
            if kind == "held":
                ordered += [(var, coef) for _, var, coef in sorted(self._generated_terms.get(value, ()), key=lambda t: t[0])]
            else:
                ordered += items[at : at + value]
                at += value
        ordered += items[at:size]
        self.time_objective = pulp.LpAffineExpression(dict(ordered), constant=old.constant)
        if self.problem.objective is old:
            self.problem.objective = self.time_objective

    def generate(self, held: np.ndarray, values: np.ndarray | None = None) -> None:
        """Make the held y at positions ``held`` (``columns.HeldColumns``) PuLP variables: in
        their y dict (shared by the edges of repeated layers), their two edge rows and the
        objective, at the weight ``set_objective`` gives the y it builds; ``values``: theirs."""
        if not len(held):
            return
        columns = self.held
        rows = list(self.rows_by_name().values())
        new = []
        for k, value in zip(held.tolist(), values.tolist() if values is not None else itertools.repeat(None)):
            pair, seconds, e = columns.pair(k)
            var = _variable(columns.name(k))
            var.varValue = value
            self.y[e][pair] = var
            self._y_seconds[e].append(seconds)
            rows[columns.out_row[k]].expr[var] = 1.0
            rows[columns.in_row[k]].expr[var] = 1.0
            if seconds:
                group = int(columns.group[k])
                self._generated_terms.setdefault(group, []).append((int(columns.position[k]), var, 0.0 + float(columns.cost[k])))
            new.append((var, k))
        columns.taken[held] = True
        self._order_objective()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.problem.addVariables([var for var, _ in new])
        self.generated += new
        self._variables = None
        if self._rows is not None:
            self._rows.add_columns([(var, int(columns.out_row[k]), int(columns.in_row[k])) for var, k in new])

    def generate_all(self) -> None:
        """Every held y a PuLP variable: a MILP, or an LP under another objective, sees them all."""
        if len(self.held):
            self.generate(self.held.left())

    def size(self) -> tuple[int, int]:
        """(variables, rows): the held y count (``columns``)."""
        return len(self.variables()) + len(self.held), self.problem.numConstraints()

    def variables(self) -> list[pulp.LpVariable]:
        """``problem.variables()``, kept while the objective is the same object: PuLP walks every
        row's terms for it (tens of milliseconds on a 70B LLaMA), and ``rounding.check`` asks
        once per plan it checks. Rows are only ever added, with coefficients fixed once added
        (as ``solver.search.relaxation`` takes them), so a row added since is all there is to read."""
        constraints, objective = self.rows_by_name(), self.problem.objective
        kept = self._variables
        if kept is None or kept[1] is not objective or kept[0] > len(constraints):
            # The objective is kept with them, so that its id is not another object's later.
            variables = _problem_variables(self.problem)
            self._variables = (len(constraints), objective, variables, {id(var) for var in variables})
        elif kept[0] < len(constraints):
            rows, _, variables, known = kept
            new = [
                var
                for row in itertools.islice(constraints.values(), rows, None)
                for var in row
                if id(var) not in known and not known.add(id(var))
            ]
            if new:  # in PuLP's order: by name
                variables = sorted(variables + new, key=lambda var: var.name)
            self._variables = (len(constraints), objective, variables, known)
        return self._variables[2]

    def rows_hold(self, tolerance: float) -> bool:
        """Whether every row of the problem holds at its variables' values (all set), each to
        ``tolerance`` · max(1, |its constant|): PuLP's ``LpConstraint.valid`` row by row, with
        numpy over ``row_table`` (``rounding.check`` asks once per plan)."""
        return self.row_table().hold(tolerance)

    def row_table(self) -> RowTable:
        """Every row's terms as flat arrays, read up to the problem's last row (``RowTable``):
        ``rows_hold`` and the HiGHS model of the LP relaxation (``solver.search.relaxation``) share it."""
        if self._rows is None or len(self.rows_by_name()) < len(self._rows.rows):
            self._rows = RowTable(self.problem)  # a row removed (no caller does): read them all again
        self._rows.read()
        return self._rows


def _problem_variables(problem: pulp.LpProblem) -> list[pulp.LpVariable]:
    """``problem.variables()`` without its walk over every row's terms (10^6 on a 3-axis mesh):
    PuLP registers a row's variables as the row is added, so what the walk adds is the
    objective's; then it sorts them by name. Where this PuLP keeps no such registry, its walk."""
    registered, ids = getattr(problem, "_variables", None), getattr(problem, "_variable_ids", None)
    if not isinstance(registered, list) or not isinstance(ids, dict):
        return list(problem.variables())
    variables, added = list(registered), set()
    for var in problem.objective.keys() if problem.objective else ():
        if var.hash not in ids and var.hash not in added:
            added.add(var.hash)
            variables.append(var)
    variables.sort(key=lambda var: var.name)
    return variables


class _MemoryTerms:
    """The terms that each timeline name's bytes put in a memory row, as flat arrays: each a
    (slot, bytes, coefficient), weighing factor · bytes · unit · coefficient on the variable in
    its slot (slot 0: the constant); name k's are the ``counts[k]`` from ``starts[k]``. A node's
    terms are m[n, s] on x[n, s] (a variable, coefficient 1; or a follower's expression, one
    term per variable, and its constant), for each s with bytes; a gathered parameter's are its
    bytes per (p, q) on y[e, p, q]. Nodes of repeated layers share their x and their price
    tables (``choices.repeated_layers``), and their gathered parameters their y and their sizes
    (``gathered.gathered_parameters``), hence their terms: those are stored once. The
    variables are fixed once the ILP is built, so the table is built once."""

    def __init__(self, ilp: ShardingILP):
        choices, gathered = ilp.graph.choices, ilp.graph.gathered
        self.variables: list = [None]  # by slot
        slot_of: dict[int, int] = {}  # by the variable's id (pulp variables compare into constraints)
        self.position: dict[str, int] = {}  # timeline name -> k
        self.is_node: list[bool] = []
        starts, counts, slots, sizes, coefs = [], [], [], [], []
        blocks: dict[tuple, tuple[int, int]] = {}  # (id of x, id of bytes), or a gathered key -> (start, count)

        def add(var, size: float, coef: float) -> None:
            slot = 0 if var is None else slot_of.get(id(var))
            if slot is None:
                slot = slot_of[id(var)] = len(self.variables)
                self.variables.append(var)
            slots.append(slot)
            sizes.append(size)
            coefs.append(coef)

        def place(name: str, is_node: bool, block: tuple[int, int]) -> None:
            self.position[name] = len(self.is_node)
            self.is_node.append(is_node)
            starts.append(block[0])
            counts.append(block[1])

        for name, choice in choices.items():
            key = (id(ilp.x[name]), id(choice.priced))
            if key not in blocks:
                first = len(slots)
                for m, x in zip(choice.priced.memory_bytes, ilp.x[name]):
                    if not m:
                        continue
                    if isinstance(x, pulp.LpVariable):
                        add(x, m, 1.0)
                        continue
                    for var, coef in x.items():
                        add(var, m, coef)
                    if x.constant:
                        add(None, m, x.constant)
                blocks[key] = (first, len(slots) - first)
            place(name, True, blocks[key])
        for name, item in gathered.items():
            variables = ilp.y.get(item.edge)
            if not variables:
                place(name, False, (len(slots), 0))
                continue
            key = ("gathered", id(variables), id(item.sizes))  # a repeated layer's are the first layer's
            if key not in blocks:
                first = len(slots)
                for pair, size in item.sizes.items():
                    if size and pair in variables:
                        add(variables[pair], size, 1.0)
                blocks[key] = (first, len(slots) - first)
            place(name, False, blocks[key])
        self.starts = np.array(starts, dtype=np.intp)
        self.counts = np.array(counts, dtype=np.intp)
        self.slots = np.array(slots, dtype=np.intp)
        self.sizes = np.array(sizes, dtype=float)
        self.coefs = np.array(coefs, dtype=float)

    def weighted(self, factors: dict[str, float], unit: float) -> pulp.LpAffineExpression:
        """``weighted_sum`` of ((factor · m) · unit) · coefficient over the terms of the names in
        ``factors``: nodes first, then gathered parameters (as ``weighted_memory`` chains them)."""
        position, is_node = self.position, self.is_node
        named = [(position[name], factor) for name, factor in factors.items() if name in position]
        ordered = [item for item in named if is_node[item[0]]] + [item for item in named if not is_node[item[0]]]
        if not ordered:
            return pulp.LpAffineExpression({}, constant=0.0)
        names = np.array([k for k, _ in ordered], dtype=np.intp)
        counts = self.counts[names]
        # The terms of the names in order: each name's range of the table, one after another.
        offsets = np.repeat(self.starts[names] - (np.cumsum(counts) - counts), counts)
        terms = offsets + np.arange(offsets.size)
        weights = np.repeat(np.array([factor for _, factor in ordered], dtype=float), counts)
        values = ((weights * self.sizes[terms]) * unit) * self.coefs[terms]
        slots = self.slots[terms]
        total = np.zeros(len(self.variables))
        np.add.at(total, slots, values)
        unique, first = np.unique(slots, return_index=True)
        used = unique[np.argsort(first)]
        used = used[used != 0]
        coefs = dict(zip([self.variables[slot] for slot in used], total[used].tolist()))
        return pulp.LpAffineExpression(coefs, constant=float(total[0]))


def _spec_groups(strategies: list, outs: bool, index: int, cache: dict) -> dict[Spec, list[int]]:
    """``choices.strategies_by_spec`` once per strategy list (repeated layers and identical ops
    share theirs)."""
    key = (id(strategies), outs, index)
    found = cache.get(key)
    if found is None:  # the list held, so that its id stays its own
        found = cache[key] = (strategies_by_spec(strategies, outs, index), strategies)
    return found[0]


def _by_spec(y: dict[tuple[Spec, Spec], pulp.LpVariable]) -> tuple[dict[Spec, list], dict[Spec, list]]:
    """y's variables grouped by src spec and by dst spec, each group in y's order. Hashing a spec
    hashes each of its placements in Python (torch's ``__hash__``): done per y, a fifth of the edge
    rows' time on LLaMA-3-8B (8, 2, 4). The pairs are grouped by the identity of their spec
    objects first (the price tables reuse a handful), and those groups merged by spec."""
    out_ids: dict[int, tuple[Spec, list]] = {}
    in_ids: dict[int, tuple[Spec, list]] = {}
    for (src, dst), var in y.items():
        found = out_ids.get(id(src))
        if found is None:
            found = out_ids[id(src)] = (src, [])
        found[1].append(var)
        found = in_ids.get(id(dst))
        if found is None:
            found = in_ids[id(dst)] = (dst, [])
        found[1].append(var)
    return _merged(out_ids.values(), y), _merged(in_ids.values(), y)


def _merged(groups, y: dict) -> dict[Spec, list]:
    merged: dict[Spec, list] = {}
    split: set[Spec] = set()
    for spec, variables in groups:
        if spec in merged:
            merged[spec] += variables
            split.add(spec)
        else:
            merged[spec] = variables
    if split:  # equal specs held by other objects: back into y's order, as the rows were always written
        position = {id(var): k for k, var in enumerate(y.values())}
        for spec in split:
            merged[spec].sort(key=lambda var: position[id(var)])
    return merged


# PuLP 3 warns once per variable built with ``LpVariable(...)`` (deprecated for PuLP 4); where it
# takes ``_skip_v4_deprecation`` the warning (muted here anyway) is not built for each of 10^5 y.
_QUIET = {"_skip_v4_deprecation": True} if "_skip_v4_deprecation" in inspect.signature(pulp.LpVariable).parameters else {}


def _built_variable(name: str) -> pulp.LpVariable:
    return pulp.LpVariable(name, lowBound=0, upBound=1, **_QUIET)


def _copier():
    """A function that makes a continuous [0, 1] variable by copying the attributes of one that
    PuLP built (about 7x faster than its constructor, which checks the name and the bounds: the
    edges of a 3-axis mesh make 10^5 of them); None where this PuLP lays its variables out
    otherwise (then each is built by the constructor)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        reference = _built_variable("v_0")
    state = dict(getattr(reference, "__dict__", {}))
    if state.get("_LpElement__name") != "v_0" or state.get("hash") != id(reference):
        return None
    new, cls = object.__new__, pulp.LpVariable

    def copy(name: str) -> pulp.LpVariable:
        var = new(cls)
        attributes = var.__dict__
        attributes.update(state)
        attributes["_LpElement__name"] = name
        attributes["hash"] = id(var)
        return var

    copied = copy("v_1")
    expected = {**state, "_LpElement__name": "v_1", "hash": id(copied)}
    if copied.name != "v_1" or hash(copied) != id(copied) or copied.__dict__ != expected:
        return None
    return copy


_COPY = _copier()


def _variable(name: str) -> pulp.LpVariable:
    """A continuous variable in [0, 1]. ``name`` has only letters, digits and underscores (PuLP
    would replace others)."""
    return _COPY(name) if _COPY is not None else _built_variable(name)


def _linear(terms) -> dict:
    """Sum variables and affine expressions into one coefficient map (the constant under None),
    in one pass: ``pulp.lpSum`` copies expressions as it goes, which is quadratic here."""
    total: dict = {}
    for term in terms:
        if isinstance(term, pulp.LpVariable):
            total[term] = total.get(term, 0.0) + 1.0
        else:
            for var, coef in term.items():
                total[var] = total.get(var, 0.0) + coef
            if term.constant:
                total[None] = total.get(None, 0.0) + term.constant
    return total


def weighted_sum(terms, distinct=(), start: dict | None = None) -> pulp.LpAffineExpression:
    """Σ coefficient · term over (coefficient, variable or affine expression) pairs; then over
    ``distinct``, (coefficient, variable) pairs of variables in no other term and each once: the
    same sum, without looking each up (10^5 of them on a 3-axis mesh). ``start``: a coefficient
    map (the constant under None) the sum starts from, as if its terms came first."""
    coefs: dict = dict(start) if start else {}
    for weight, term in terms:
        if isinstance(term, pulp.LpVariable):
            coefs[term] = coefs.get(term, 0.0) + weight
        else:
            for var, coef in term.items():
                coefs[var] = coefs.get(var, 0.0) + weight * coef
            if term.constant:
                coefs[None] = coefs.get(None, 0.0) + weight * term.constant
    constant = coefs.pop(None, 0.0)
    size, distinct = len(coefs), [(var, 0.0 + weight) for weight, var in distinct]  # 0.0 + w: as the loop adds
    coefs.update(distinct)
    if len(coefs) != size + len(distinct):
        raise AssertionError("weighted_sum: a 'distinct' variable is repeated or in another term; this is a bug in autopar")
    return pulp.LpAffineExpression(coefs, constant=constant)


def _difference(plus, minus) -> pulp.LpAffineExpression:
    """Σ plus − Σ minus as one affine expression."""
    variable = pulp.LpVariable
    if all(type(term) is variable for term in plus) and all(type(term) is variable for term in minus):
        # Distinct variables (an edge row's y and x), the coefficients ``_linear`` would sum: 1, −1.
        coefs = dict.fromkeys(plus, 1.0)
        coefs.update(dict.fromkeys(minus, -1.0))
        if len(coefs) == len(plus) + len(minus):
            return pulp.LpAffineExpression(coefs, constant=0.0)
    coefs = _linear(plus)
    for var, coef in _linear(minus).items():
        coefs[var] = coefs.get(var, 0.0) - coef
    constant = coefs.pop(None, 0.0)
    return pulp.LpAffineExpression({v: c for v, c in coefs.items() if c}, constant=constant)


def _spec_name(spec: Spec) -> str:
    return "_".join(format_spec(spec)).replace("(", "").replace(")", "")
