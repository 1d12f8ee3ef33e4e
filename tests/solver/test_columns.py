"""The y of hub edges as columns of the LP alone (``solver.problem.columns``): the same LP, the
same optimum, and a problem of record that holds every y a solution uses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from autopar.cost.cluster import get_cluster
from autopar.ir.spec import R, S
from autopar.solver.problem import choices, edges
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.problem.rows import RowTable
from autopar.solver.search import rounding
from autopar.solver.search.solving import solve_ilp
from autopar.trace import trace_repeated
from autopar.zoo.models import build_model, example_batch


def test_held_pairs_are_the_direct_items_by_position():
    shape, mesh = (8, 16), (2, 2, 2)
    pricer = edges.Pricer(mesh, get_cluster("h100-80g"))
    srcs = [(S(0), S(1), R), (R, R, R), (S(1), R, R)]
    dsts = [(R, R, R), (S(0), S(1), R), (S(0), R, R), (S(1), S(0), R)]
    edge = edges.Edge("a", 0, "b", 0, shape, torch.float32, True, False)
    prices = edges.price_table(edge, [(s, pricer.code(s)) for s in srcs], [(d, pricer.code(d)) for d in dsts], pricer, True)
    held = prices.held_pairs()
    direct = prices.direct_items()
    assert direct and (held.num_src, held.num_dst) == (len(srcs), len(dsts))
    assert [(srcs[i], dsts[j]) for i, j in zip(held.src, held.dst)] == [pair for pair, _ in direct]
    assert held.seconds.tolist() == [seconds for _, (seconds, _) in direct]
    assert prices.scaled(2.0).held_pairs().seconds.tolist() == [2.0 * seconds for _, (seconds, _) in direct]
    # A near pair is found before the table is a dict, at the price the table then holds.
    lazy = edges.price_table(edge, [(s, pricer.code(s)) for s in srcs], [(d, pricer.code(d)) for d in dsts], pricer, True)
    assert lazy.get(direct[0][0]) == direct[0][1] and dict(lazy.items()) == dict(prices.items())


@pytest.fixture(scope="module")
def llama_graph():
    kwargs = {"n_layer": 2}
    traced = trace_repeated(build_model("llama", seed=0, **kwargs), example_batch("llama", 4, **kwargs))
    return choices.build_choice_graph(traced, (2, 2, 2), get_cluster("h100-80g"))


def test_held_columns_reach_the_optimum_of_every_y(llama_graph):
    """The LP with the held y as HiGHS columns is the LP with every y a PuLP variable: the same
    plan, bound and optimum (2-layer LLaMA on (2, 2, 2), whose MILP optimum ``test_edges``
    pins), and the rounding check prices the plan by the problem of record."""
    held = ShardingILP(llama_graph, None)
    assert len(held.held) > 0 and held.size()[0] == len(held.variables()) + len(held.held)
    solution = solve_ilp(held, 600.0, "auto")
    every = ShardingILP(llama_graph, None)
    every.generate_all()
    assert not len(every.held) and every.size() == held.size()
    reference = solve_ilp(every, 600.0, "auto")
    assert solution.method == reference.method == "lp-rounding"
    # The same LP column for column, the objective's terms in the same order: the same plan, to the bit.
    assert solution.choice == reference.choice
    assert (solution.objective_s, solution.bound_s) == (reference.objective_s, reference.bound_s)
    assert solution.objective_s == pytest.approx(4.6831020895522404e-06, rel=1e-6)
    assert len(held.held) > 0  # most y never became PuLP variables
    assert rounding.check(held, solution.choice) == pytest.approx(solution.objective_s, rel=1e-9)


def test_generated_columns_join_the_row_table_as_a_fresh_read_finds_them(llama_graph):
    ilp = ShardingILP(llama_graph, None)
    table = ilp.row_table()
    ilp.generate(ilp.held.left()[::7])
    fresh = RowTable(ilp.problem)
    fresh.read()

    def terms(rows: RowTable) -> list[list[tuple[int, float]]]:
        ids = np.array([id(var) for var in rows.columns])
        per_row = [[] for _ in rows.rows]
        for row, column, coef in zip(rows.entry_rows, rows.entry_columns, rows.entry_coefs):
            per_row[row].append((ids[column], coef))
        return per_row

    assert ilp.row_table() is table and terms(table) == terms(fresh)


def test_held_columns_take_the_places_their_names_sort_to(llama_graph):
    """``HeldColumns.merged_order`` places the held y among the variables as sorting every name
    does (PuLP's column order, had every y been a variable), before and after some of them are
    generated (their names then sit among the variables'). The order decides which of tied
    optima the LP returns."""
    ilp = ShardingILP(llama_graph, None)
    for step in range(2):
        if step:
            ilp.generate(ilp.held.left()[::5])
        names, left = [var.name for var in ilp.variables()], ilp.held.left()
        every = np.array(names + ilp.held.names(left))
        place = np.empty(len(every), dtype=np.int64)
        place[np.argsort(every, kind="stable")] = np.arange(len(every))
        held, variables = ilp.held.merged_order(names, left)
        assert held.tolist() == place[len(names) :].tolist() and variables.tolist() == place[: len(names)].tolist()
        assert len({int(e) for e in np.array([g[0] for g in ilp.held.groups])[ilp.held.group[left]]}) > 10


def test_check_prices_a_choice_by_its_own_y_held_or_not(llama_graph):
    """A plan that uses a held y (a greedy one, unlike the LP's) is priced by that y, which
    becomes a variable, exactly as with every y a variable, not at the hub's upper bound."""
    held = ShardingILP(llama_graph, None)
    every = ShardingILP(llama_graph, None)
    every.generate_all()
    # The greedy plan of the same graph without the optimizer's terms uses such a y (with them,
    # greedy shards as the LP does, through y it already holds).
    choice = rounding.greedy(ShardingILP(dataclasses.replace(llama_graph, optimizer_s={}), None), 0.0)
    count = len(held.held)
    assert rounding.check(held, choice) == rounding.check(every, choice)
    assert len(held.held) < count


def test_a_solved_ilp_and_its_hub_tables_are_freed_without_the_garbage_collector(llama_graph):
    """No reference cycle keeps a solved problem alive (its relaxation holds it weakly) nor a hub
    table (its on-demand pricer holds no edge): planning holds full collections off
    (``solver.planners.quiet_gc``), so whatever a cycle held stayed from plan to plan."""
    import gc
    import weakref

    pricer = edges.Pricer((2, 2, 2), get_cluster("h100-80g"))
    edge = edges.Edge("a", 0, "b", 0, (8, 16), torch.float32, True, False)
    specs = [(s, pricer.code(s)) for s in [(S(0), S(1), R), (R, R, R), (S(1), R, R)]]
    edge.price = hub_table = edges.price_table(edge, specs, specs, pricer, True)
    assert hub_table.hub is not None and hub_table.get(((S(0), S(1), R), (S(1), R, R))) is not None
    ilp = ShardingILP(llama_graph, None)
    solve_ilp(ilp, 60)
    assert ilp.relaxation is not None and ilp.relaxation.ilp is ilp
    watched = [weakref.ref(ilp), weakref.ref(ilp.relaxation), weakref.ref(edge)]
    enabled = gc.isenabled()
    gc.disable()
    try:
        del ilp, hub_table, edge
        assert [ref() for ref in watched] == [None, None, None]
    finally:
        if enabled:
            gc.enable()
