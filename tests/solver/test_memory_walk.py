"""The memory planner's walk (autopar/solver/planners/memory_plan.py ``_Walk``): ``peak`` re-prices only the
intervals its decisions touch, and must equal the walk re-run over every interval."""

from __future__ import annotations

import functools
import itertools
import random

import pytest

from autopar.cost.cluster import get_cluster
from autopar.solver.planners.memory_plan import TRANSFERS, _Walk
from autopar.solver.problem.choices import build_choice_graph
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


@functools.cache
def _walk_of(name: str, cluster: str) -> _Walk:
    model = build_model(name, seed=0, n_layer=4)
    traced = trace(model, example_batch(name, 4, seed=1))
    graph = build_choice_graph(traced, (2, 2), get_cluster(cluster))
    # A mixed sharding (not the solved one), so that sizes differ from node to node.
    choice = {name: i % len(c.strategies) for i, (name, c) in enumerate(graph.choices.items())}
    return _Walk(traced, graph, graph.bytes_of(choice))  # gathered parameters too


@pytest.fixture(scope="module", params=["gpt", "llama"])
def walk(request) -> _Walk:
    return _walk_of(request.param, "cpu")


@pytest.fixture(scope="module", params=[("gpt", "cpu"), ("llama", "cpu"), ("llama", "h100-80g")])
def any_walk(request) -> _Walk:
    """``walk``, and one on a GPU cluster, whose timeline holds torch's foreach AdamW temporary
    (the step's spans, ``_Walk._step_spans``)."""
    return _walk_of(*request.param)


def _full_walk(walk: _Walk, decisions: set, prefetch: bool) -> tuple[float, int]:
    values = walk.curve(walk.intervals(decisions, prefetch))
    time = max(range(len(values)), key=lambda t: (values[t], -t))
    return values[time], time


def _decision_sets(walk: _Walk) -> list[set]:
    segments = [str(i) for i in range(len(walk.segments))]
    params = sorted(
        walk.timeline.intervals[k].node for k in range(len(walk.timeline.intervals)) if walk.timeline.intervals[k].kind == "param"
    )[:3]
    sets: list[set] = [set()]
    sets += [{("checkpoint", s)} for s in segments]
    sets += [{("checkpoint", a), ("checkpoint", b)} for a, b in itertools.combinations(segments, 2)]
    sets += [{("checkpoint", s) for s in segments}]
    sets += [{("selective", s)} for s in segments]
    sets += [{("selective", segments[0]), ("checkpoint", segments[1]), ("activations", segments[2])}]
    sets += [{("selective", s) for s in segments}]
    sets += [{("selective-op", s)} for s in segments]
    sets += [{("selective-op", segments[0]), ("selective", segments[1]), ("checkpoint", segments[2])}]
    sets += [{("selective-op", s) for s in segments}]
    sets += [{("activations", s)} for s in segments]
    sets += [{("activations", segments[0]), ("activations", segments[-1]), ("checkpoint", segments[1])}]
    sets += [{(kind, p)} for kind in TRANSFERS for p in params]
    sets += [{("param", params[0]), ("grad", params[1]), ("optimizer_state", params[2]), ("checkpoint", segments[0])}]
    return sets


def test_the_walk_has_segments_to_decide(walk):
    assert len(walk.segments) >= 4  # one per layer at least: the sets below exercise them


def test_a_gathered_copy_stays_one_instant_in_a_checkpointed_segment(walk):
    # The all-gather's buffer a group is copied out of lives one instant (``liveness.gathered_intervals``);
    # a checkpointed segment gathers again at its recompute, and the copy is there one instant, not
    # its whole backward (the parameters would count twice there).
    copies = [iv for iv in walk.timeline.intervals if iv.kind == "gathered" and iv.start == iv.end >= walk.num]
    assert copies
    moved = 0
    for segment in range(len(walk.segments)):
        context = walk._context({("checkpoint", str(segment))}, True)
        for iv in copies:
            spans = walk._spans(iv, context)
            assert all(start == end for _, _, start, end, _ in spans), (iv, spans)
            moved += spans != [(iv.node, iv.kind, iv.start, iv.end, iv.factor)]
    assert moved  # some copies lie in a checkpointed segment


@pytest.mark.parametrize("prefetch", [True, False])
def test_incremental_peak_equals_the_full_walk(any_walk, prefetch):
    walk = any_walk
    for decisions in _decision_sets(walk):
        peak, time = walk.peak(decisions, prefetch)
        assert walk.last_intervals() == walk.intervals(decisions, prefetch), decisions  # ``plan_memory``'s breakdown
        want_peak, want_time = _full_walk(walk, decisions, prefetch)
        assert peak == pytest.approx(want_peak, rel=1e-12, abs=1e-6), decisions
        assert time == want_time, decisions
        # Every time, not only the peak: a decision must re-price every interval it changes.
        want = walk.curve(walk.intervals(decisions, prefetch))
        assert walk.curve_under(decisions, prefetch).tolist() == pytest.approx(want, rel=1e-12, abs=1e-6), decisions


@pytest.mark.parametrize("prefetch", [True, False])
def test_no_checkpoints_bring_the_peak_under_the_kept_peak(walk, prefetch):
    """``plan_memory`` gives up at once when the tensors no checkpoint frees already peak over
    the budget: every set of checkpoints must peak at or above ``kept_peak``, at every time."""
    kept = walk.kept_peak()
    assert 0 < kept < walk.peak(set(), prefetch)[0]
    for decisions in _decision_sets(walk):
        if all(kind in ("checkpoint", "selective", "selective-op") for kind, _ in decisions):
            assert walk.peak(decisions, prefetch)[0] >= kept * (1 - 1e-12), decisions


def test_giving_up_early_says_what_the_greedy_said(monkeypatch):
    """Under a budget below ``kept_peak``, ``plan_memory`` raises the error the full greedy
    raises (same peak, same tensors), without walking its steps."""
    from autopar.errors import InfeasibleError
    from autopar.solver.planners import memory_plan as memory

    model = build_model("llama", seed=0, n_layer=4)
    traced = trace(model, example_batch("llama", 4, seed=1))
    cluster = get_cluster("cpu")
    graph = build_choice_graph(traced, (2, 2), cluster)
    choice = {name: 0 for name in graph.choices}
    budget = 0.99 * _Walk(traced, graph, graph.bytes_of(choice)).kept_peak()
    messages = []
    for kept_peak in (memory._kept_peak, lambda timeline, sizes: 0.0):  # the shortcut, then the greedy
        monkeypatch.setattr(memory, "_kept_peak", kept_peak)
        with pytest.raises(InfeasibleError) as error:
            memory.plan_memory(traced, graph, choice, cluster, budget, target=None)
        messages.append(str(error.value))
    assert messages[0] == messages[1]
    # A caller that only tries the sharding (``solve``'s candidates) gets the short error, and
    # the walk's shape is not built for it.
    monkeypatch.undo()
    graph.derived.pop("memory_walk", None)
    with pytest.raises(InfeasibleError, match="no plan of this sharding fits"):
        memory.plan_memory(traced, graph, choice, cluster, budget, target=None, explain=False)
    assert "memory_walk" not in graph.derived


def _every_key(walk: _Walk) -> list[tuple[str, str]]:
    """Every decision the greedy may take on ``walk``: each layer's four, each tensor's offload."""
    layer_kinds = ("checkpoint", "selective", "selective-op", "activations")
    keys = [(kind, str(i)) for i in range(len(walk.segments)) for kind in layer_kinds]
    keys += sorted({(iv.kind, iv.node) for iv in walk.timeline.intervals if iv.kind in TRANSFERS})
    return keys


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_pricing_along_random_decision_sequences(any_walk, prefetch, seed):
    """The greedy prices each step from the last one (``walk_changes.affected_keys``: the decision
    added or dropped, and the offloaded neighbours whose prefetch spans it bounds). Along random
    sequences of single additions and removals, of every kind and mixed, each curve must equal the
    walk re-run over every interval from nothing, at every time."""
    walk = any_walk
    rng = random.Random(seed)
    keys = _every_key(walk)
    assert {kind for kind, _ in keys} >= {"checkpoint", "activations", *TRANSFERS}
    decisions: set = set()
    longest = 0
    walk.peak(set(), prefetch, fresh=True)
    for step in range(60):
        # mostly additions early (long sets, many neighbours), then removals too
        if decisions and rng.random() < (0.2 if step < 30 else 0.6):
            decisions.discard(rng.choice(sorted(decisions)))
        else:
            decisions.add(rng.choice(keys))
        got = walk.curve_under(decisions, prefetch).tolist()
        want = walk.curve(walk.intervals(decisions, prefetch))
        assert got == pytest.approx(want, rel=1e-12, abs=1e-6), (step, sorted(decisions))
        # the spans each step keeps of the intervals it re-priced are every interval's, exactly
        assert walk.last_intervals() == walk.intervals(decisions, prefetch), (step, sorted(decisions))
        longest = max(longest, len(decisions))
    assert longest >= 10  # the sequence reached sets where neighbours matter
