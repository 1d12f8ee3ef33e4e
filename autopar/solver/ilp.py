r"""The sharding ILP.

Sets
    N            free nodes (followers are not variables; see below)
    S_n          strategies of node n
    E            edges (u, j) → (v, i): output j of u feeds tensor input i of v
    O_e, I_e     distinct specs of u's output j, and of v's input i, over their strategies
    T_e ⊆ O_e×I_e  transitions that exist (none into Partial; none on a tensor written in place)

Variables
    x[n, s] ∈ {0, 1}      node n uses strategy s
    y[e, p, q] ∈ [0, 1]   edge e carries spec p out of u and spec q into v, for (p, q) ∈ T_e

    A follower f of producer u (getitem, views, elementwise ops; ``choices._mark_followers``)
    has no variables of its own: x[f, s] ≡ Σ_{t ∈ S_u : out_j(t) = in_0(s)} x[u, t].

Objective (seconds of one training step, forward and backward, no overlap assumed)
    min  Σ_n Σ_s c[n, s] · x[n, s]  +  Σ_e Σ_{(p,q) ∈ T_e} r[e, p, q] · y[e, p, q]
    c = compute (roofline) + backward gradient all-reduces of the strategy;
    r = the collectives of ``spec.transition_steps(p, q)`` and their backward duals.

Constraints
    pick[n]:           Σ_s x[n, s] = 1                                        ∀ n ∈ N
    edge_out[e, p]:    Σ_q y[e, p, q] = Σ_{s : out_j(s) = p} x[u, s]          ∀ e, p ∈ O_e
    edge_in[e, q]:     Σ_p y[e, p, q] = Σ_{s : in_i(s) = q} x[v, s]           ∀ e, q ∈ I_e
    memory:            Σ_n Σ_s m[n, s] · x[n, s] ≤ B                          (if a budget B)
    tie[a, b, s]:      x[a, s] = x[b, s]      for placeholders a, b naming one tensor (tied weights)

    Repeated layers (``choices.repeated_layers``) share variables outright: a node of layer k
    uses the x of its counterpart in the first layer, and an edge whose two ends share x with
    an earlier edge's ends (inside a layer, or from one layer into the next) uses that edge's y,
    whose constraints already stand. Costs and memory still count every layer, because the
    shared variables collect every layer's coefficients.

    The two edge families make y the joint distribution of the two endpoint choices, which is
    exact for 0/1 x and gives a tight LP relaxation. m counts parameters, gradients and
    optimizer state of each parameter spec, buffers, and the activations kept for backward:
    all of these are live together when backward starts, which is the training step's peak.

Every constraint is named ``<family>__<node>[__<detail>]`` so that an infeasible model or a
choice can be traced back to the family that forced it.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import pulp

from autopar.solver.choices import ChoiceGraph
from autopar.spec import Spec, format_spec


@dataclass(frozen=True, slots=True)
class Solution:
    choice: dict[str, int]  # node name → strategy index
    edge_specs: dict[int, tuple[Spec, Spec]]  # edge index → (src, dst) spec used
    status: str
    objective_s: float
    solve_time_s: float
    num_variables: int
    num_constraints: int


class ShardingILP:
    """Builds the formulation above from a ChoiceGraph and solves it with PuLP."""

    def __init__(self, graph: ChoiceGraph, memory_budget_bytes: float | None = None):
        # PuLP 3.x deprecates the 2.x construction API we use to stay compatible with both.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self._build(graph, memory_budget_bytes)

    def _build(self, graph: ChoiceGraph, memory_budget_bytes: float | None) -> None:
        self.graph = graph
        self.memory_budget_bytes = memory_budget_bytes
        self.problem = pulp.LpProblem("autopar_sharding", pulp.LpMinimize)
        self.x: dict[str, list[pulp.LpAffineExpression | pulp.LpVariable]] = {}
        self.y: dict[int, dict[tuple[Spec, Spec], pulp.LpVariable]] = {}
        self._node_ids = {name: i for i, name in enumerate(graph.order)}
        self.add_node_variables()
        self.add_pick_constraints()
        self.add_edge_constraints()
        self.add_memory_constraint()
        self.add_tie_constraints()
        self.set_objective()

    # -- variables ----------------------------------------------------------------------------
    def add_node_variables(self) -> None:
        for name in self.graph.order:
            choice = self.graph.choices[name]
            template = self.graph.layer_template.get(name)
            if template is not None:
                self.x[name] = self.x[template]
            elif choice.follower_of is not None:
                producer, out_index = choice.inputs[0]
                leader = self.graph.choices[producer]
                leader_x = self.x[producer]
                exprs = []
                for strategy in choice.strategies:
                    terms = [leader_x[t] for t, s in enumerate(leader.strategies) if s.outs[out_index] == strategy.ins[0]]
                    exprs.append(pulp.lpSum(terms))
                self.x[name] = exprs
            elif len(choice.strategies) == 1:
                self.x[name] = [pulp.LpAffineExpression(constant=1)]
            else:
                node_id = self._node_ids[name]
                self.x[name] = [
                    pulp.LpVariable(f"x_{node_id}_{s}", cat=pulp.LpBinary) for s in range(len(choice.strategies))
                ]

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
        first_edge: dict[tuple[str, int, str, int], int] = {}
        for e, edge in enumerate(self.graph.edges):
            consumer = self.graph.choices[edge.consumer]
            if consumer.follower_of == edge.producer:
                continue  # the follower's choice already equals its producer's output spec
            # Edges whose two ends share x variables (repeated layers) and whose prices agree
            # have identical marginals: one y serves them all, and its constraints stand once.
            key = (template.get(edge.producer, edge.producer), edge.out_index,
                   template.get(edge.consumer, edge.consumer), edge.in_index)
            twin = first_edge.setdefault(key, e)
            if twin != e and twin in self.y and self.graph.edges[twin].price == edge.price:
                self.y[e] = self.y[twin]
                continue
            producer = self.graph.choices[edge.producer]
            self.y[e] = {
                pair: pulp.LpVariable(f"y_{e}_{k}", lowBound=0, upBound=1)
                for k, pair in enumerate(sorted(edge.price, key=_pair_key))
            }
            by_src: dict[Spec, list] = {}
            by_dst: dict[Spec, list] = {}
            for (src, dst), var in self.y[e].items():
                by_src.setdefault(src, []).append(var)
                by_dst.setdefault(dst, []).append(var)
            picks_out: dict[Spec, list] = {}
            for s, st in enumerate(producer.strategies):
                picks_out.setdefault(st.outs[edge.out_index], []).append(self.x[edge.producer][s])
            picks_in: dict[Spec, list] = {}
            for s, st in enumerate(consumer.strategies):
                picks_in.setdefault(st.ins[edge.in_index], []).append(self.x[edge.consumer][s])
            for p in producer.out_specs(edge.out_index):
                lhs = pulp.lpSum(by_src.get(p, []))
                self.problem += lhs == pulp.lpSum(picks_out.get(p, [])), f"edge_out__{e}__{_spec_name(p)}"
            for q in consumer.in_specs(edge.in_index):
                lhs = pulp.lpSum(by_dst.get(q, []))
                self.problem += lhs == pulp.lpSum(picks_in.get(q, [])), f"edge_in__{e}__{_spec_name(q)}"

    def add_memory_constraint(self) -> None:
        if self.memory_budget_bytes is None:
            return
        self.problem += self.memory_expression() <= self.memory_budget_bytes, "memory__peak"

    def add_tie_constraints(self) -> None:
        for group in self.graph.ties:
            first = group[0]
            for other in group[1:]:
                for s, (a, b) in enumerate(zip(self.x[first], self.x[other])):
                    self.problem += a == b, f"tie__{self._node_ids[first]}__{self._node_ids[other]}__{s}"

    def memory_expression(self) -> pulp.LpAffineExpression:
        terms = []
        for name in self.graph.order:
            choice = self.graph.choices[name]
            terms.extend(m * x for m, x in zip(choice.memory_bytes, self.x[name]) if m)
        return pulp.lpSum(terms)

    def set_objective(self) -> None:
        terms = []
        for name in self.graph.order:
            choice = self.graph.choices[name]
            terms.extend(c * x for c, x in zip(choice.compute_s, self.x[name]) if c)
        for e, variables in self.y.items():
            price = self.graph.edges[e].price
            terms.extend(price[pair][0] * var for pair, var in variables.items() if price[pair][0])
        self.problem += pulp.lpSum(terms)

    # -- solving ------------------------------------------------------------------------------
    def solve(self, time_limit_s: float = 60.0) -> Solution:
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = pulp.PULP_CBC_CMD(
                msg=False, timeLimit=time_limit_s, threads=1, options=["randomSeed 1", "randomCbcSeed 1"]
            )
            self.problem.solve(solver)
        elapsed = time.perf_counter() - start
        status = pulp.LpStatus[self.problem.status]
        has_solution = self.problem.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        if not has_solution:
            return Solution({}, {}, status if status != "Optimal" else "Infeasible", float("inf"), elapsed, *self._size())
        choice = {name: self._chosen(name) for name in self.graph.order}
        edge_specs = {}
        for e, edge in enumerate(self.graph.edges):
            producer = self.graph.choices[edge.producer].strategies[choice[edge.producer]]
            consumer = self.graph.choices[edge.consumer].strategies[choice[edge.consumer]]
            edge_specs[e] = (producer.outs[edge.out_index], consumer.ins[edge.in_index])
        label = "Optimal" if self.problem.sol_status == pulp.LpSolutionOptimal else "Feasible (time limit)"
        return Solution(choice, edge_specs, label, float(pulp.value(self.problem.objective) or 0.0), elapsed, *self._size())

    def _chosen(self, name: str) -> int:
        values = [pulp.value(x) or 0.0 for x in self.x[name]]
        best = max(range(len(values)), key=lambda i: values[i])
        assert values[best] > 0.5, f"no strategy selected for {name}: {values}"
        return best

    def _size(self) -> tuple[int, int]:
        return len(self.problem.variables()), self.problem.numConstraints()


def _spec_name(spec: Spec) -> str:
    return "_".join(format_spec(spec)).replace("(", "").replace(")", "")


def _pair_key(pair: tuple[Spec, Spec]) -> tuple[list[str], list[str]]:
    return format_spec(pair[0]), format_spec(pair[1])

