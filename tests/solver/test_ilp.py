"""The ILP's rows built with numpy (``ShardingILP.weighted_memory``) against the plain Python
sums they replace: the same coefficients to the last bit, in the same order.

A 9-layer LLaMA on a (2, 2) mesh: repeated layers share variables (so a variable collects the
terms of every layer, more than the 8 that numpy's pairwise sums add in order), followers' x are
expressions, single-strategy nodes are constants, and sharded parameters are gathered whole (terms
on y)."""

from __future__ import annotations

import itertools
import random

import pulp
import pytest

from autopar.cost.cluster import get_cluster
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.ilp import MEMORY_UNIT, ShardingILP, weighted_sum
from autopar.solver.problem.terms import compute_coefficients
from autopar.trace import trace_repeated
from tests.conftest import meta_llama_and_batch


@pytest.fixture(scope="module")
def ilp():
    model, batch = meta_llama_and_batch(9)
    return ShardingILP(build_choice_graph(trace_repeated(model, batch), (2, 2), get_cluster("h100-80g")))


def _reference(ilp: ShardingILP, factors: dict[str, float], unit: float) -> pulp.LpAffineExpression:
    """``weighted_memory`` as a loop over every name's terms (the formulation, term by term)."""
    choices, gathered = ilp.graph.choices, ilp.graph.gathered
    return weighted_sum(
        itertools.chain(
            (
                (factor * m * unit, x)
                for name, factor in factors.items()
                if name in choices
                for m, x in zip(choices[name].priced.memory_bytes, ilp.x[name])
                if m
            ),
            (
                (factor * size * unit, ilp.y[gathered[name].edge][pair])
                for name, factor in factors.items()
                if name in gathered
                for pair, size in gathered[name].sizes.items()
                if size and pair in ilp.y.get(gathered[name].edge, {})
            ),
        )
    )


def _same(got: pulp.LpAffineExpression, want: pulp.LpAffineExpression) -> None:
    assert [(var.name, coef) for var, coef in got.items()] == [(var.name, coef) for var, coef in want.items()]
    assert all(a is b for a, b in zip(got, want))
    assert got.constant == want.constant


def test_memory_rows_equal_the_loop_over_alive_intervals(ilp):
    graph, timeline = ilp.graph, ilp.graph.timeline
    assert graph.gathered and graph.layer_template
    assert any(isinstance(x, pulp.LpAffineExpression) and x.constant for xs in ilp.x.values() for x in xs)
    assert any(isinstance(x, pulp.LpAffineExpression) and len(x) for xs in ilp.x.values() for x in xs)
    for time in range(0, timeline.num_times, 5):
        factors: dict[str, float] = {}
        alive = [iv for iv in timeline.intervals if iv.start <= time <= iv.end]
        assert timeline.alive_at(time) == alive
        for interval in alive:
            factors[interval.node] = factors.get(interval.node, 0.0) + interval.factor
        assert list(timeline.factors_at(time).items()) == list(factors.items())
        _same(ilp.memory_expression(time), _reference(ilp, factors, 1.0 / MEMORY_UNIT))


def test_weighted_memory_adds_in_order_with_irregular_factors(ilp):
    # Factors whose sums depend on the order of addition, names in a shuffled order, unknown names
    # skipped: the rows' coefficients still equal the loop's bit for bit.
    rng = random.Random(0)
    names = list(ilp.graph.choices) + list(ilp.graph.gathered) + ["not_a_name"]
    rng.shuffle(names)
    factors = {name: rng.uniform(0.1, 3.0) / 3.0 for name in names}
    _same(ilp.weighted_memory(factors), _reference(ilp, factors, 1.0))
    _same(ilp.weighted_memory(factors, 1.0 / MEMORY_UNIT), _reference(ilp, factors, 1.0 / MEMORY_UNIT))
    assert not ilp.weighted_memory({"not_a_name": 1.0})


def test_copied_variables_are_what_pulps_constructor_builds():
    """``ilp._variable`` copies a built variable's attributes (10^5 y on a 3-axis mesh)."""
    from autopar.solver.problem import ilp as ilp_module

    made, built = ilp_module._variable("y_3_4"), ilp_module._built_variable("y_3_4")
    assert {**vars(made), "hash": 0} == {**vars(built), "hash": 0}
    assert made.name == "y_3_4" and (made.lowBound, made.upBound, made.cat) == (0, 1, pulp.LpContinuous)
    other = ilp_module._variable("y_3_5")
    assert hash(made) == id(made) and hash(other) == id(other) and made.name != other.name
    assert ilp_module._COPY is not None  # this PuLP's layout is the one copied


def _compute_terms(ilp: ShardingILP):
    """The objective's compute terms as ``set_objective`` wrote them before ``terms``: one by one."""
    refund, graph = ilp.per_use_refund, ilp.graph
    for name in graph.order:
        for s, (c, x) in enumerate(zip(graph.objective_s(name), ilp.x[name])):
            weight = c - (refund[name][s] if name in refund else 0.0)
            if weight:
                yield weight, x


def test_compute_coefficients_equal_the_terms_summed_one_by_one(ilp):
    """``terms.compute_coefficients`` gives the objective's compute part as summing its terms one
    by one does: the same variables in the same order, the same floats, the same constant. The
    fixture has every kind of term: shared x of repeated layers, followers' expressions,
    constants of single-strategy nodes, and per-use refunds of parameter reductions."""
    kinds = {type(x) for name in ilp.graph.order for x in ilp.x[name]}
    assert kinds == {pulp.LpVariable, pulp.LpAffineExpression} and ilp.per_use_refund
    assert any(name in ilp.graph.layer_template for name in ilp.graph.order)
    order, refund = ilp.graph.order, ilp.per_use_refund
    assert ilp.graph.optimizer_s, "parameters carry their optimizer step"
    got = compute_coefficients(order, {name: ilp.graph.objective_s(name) for name in order}, ilp.x, refund)
    want = weighted_sum(_compute_terms(ilp))
    assert got is not None and None in got  # the constants of single-strategy nodes
    _same(weighted_sum((), start=got), want)
    # And the objective the ILP holds starts with them, as it did.
    objective = list(ilp.time_objective.items())[: len(want)]
    assert [var for var, _ in objective] == list(want.keys())
    assert [coef.hex() for _, coef in objective] == [coef.hex() for coef in want.values()]


def test_compute_coefficients_leave_an_unknown_variable_to_the_caller(ilp):
    """An expression over a variable outside the ILP's x lists: None, so that the caller sums the
    terms one by one."""
    stranger = pulp.LpVariable("stranger")
    x = dict(ilp.x)
    name = ilp.graph.order[-2]
    x[name] = [pulp.LpAffineExpression({stranger: 1.0})] * len(x[name])
    order = ilp.graph.order
    assert compute_coefficients(order, {n: ilp.graph.choices[n].priced.compute_s for n in order}, x, ilp.per_use_refund) is None


def test_compute_coefficients_keep_the_order_variables_are_first_met():
    """A variable first met in an expression (its own node's terms all zero) takes its place in
    the expression's order, not in its list's; a shared list adds each node's terms in turn."""
    v = [pulp.LpVariable(f"v{i}") for i in range(3)]
    x = {
        "a": v,
        "b": [pulp.LpAffineExpression({v[2]: 1.0, v[0]: 2.0}), pulp.LpAffineExpression({v[1]: 1.0}, constant=1.0)],
        "c": v,
    }
    compute_s = {"a": [0.0, 0.0, 0.0], "b": [0.5, 0.25], "c": [0.1, 0.2, 0.3]}
    refund = {"c": [0.0, 0.2, 0.0]}
    got = compute_coefficients(["a", "b", "c"], compute_s, x, refund)
    want = weighted_sum(
        (c - (refund.get(n, [0.0] * 3)[s]), x[n][s])
        for n in "abc"
        for s, c in enumerate(compute_s[n])
        if c - (refund.get(n, [0.0] * 3)[s])
    )
    _same(weighted_sum((), start=got), want)
    assert [var.name for var in want] == ["v2", "v0", "v1"]
