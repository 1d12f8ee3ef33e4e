"""Training steps through the allocator model (``autopar.cost.step_memory``): hand-worked spans,
sizes in MiB."""

from __future__ import annotations

from autopar.cost.step_memory import reserved_peak, step_events

MIB = 2**20
SIZES = {"p": 20 * MIB, "a": 40 * MIB, "b": 40 * MIB, "g": 20 * MIB}


def _peak(spans, num_times, streams=None, expandable=False):
    stream_of = (lambda span: streams.get(span[0], "compute")) if streams else (lambda span: "compute")
    return reserved_peak(spans, SIZES.__getitem__, num_times, stream_of, expandable)


def test_a_step_that_reuses_its_blocks_reserves_what_it_allocates():
    # a parameter all step, two activations one after the other, step after step
    spans = [("p", "param", 0, 3, 1.0), ("a", "activation", 0, 1, 1.0), ("b", "activation", 2, 3, 1.0)]
    peak = _peak(spans, 4)
    assert peak.allocated == peak.reserved == 60 * MIB


def test_events_free_before_they_allocate_and_keep_gradients_to_the_optimizer():
    spans = [("a", "activation", 0, 0, 1.0), ("g", "grad", 1, 1, 1.0), ("b", "activation", 1, 1, 1.0)]
    events = list(step_events(spans, SIZES.__getitem__, 2, steps=1))
    assert [(e[0], e[1]) for e in events] == [
        ("malloc", (0, 0)),
        ("free", (0, 0)),  # a ends at time 0: freed before time 1 allocates
        ("malloc", (0, 1)),
        ("malloc", (0, 2)),
        ("free", (0, 2)),
        ("free", (0, 1)),  # the gradient goes last, after the optimizer step (zero_grad)
    ]
    # a span that ends before it starts (a planner's empty piece) holds nothing
    assert list(step_events([("a", "activation", 1, 0, 1.0)], SIZES.__getitem__, 2, steps=1)) == []


def test_gradients_on_the_reduce_scatter_stream_stay_reserved_there():
    # The gradient (reduce-scattered: its stream) is freed by zero_grad; the next step's
    # activation, on the compute stream, cannot take its cached block.
    spans = [("a", "activation", 0, 1, 1.0), ("g", "grad", 2, 3, 1.0)]
    split = _peak(spans, 4, streams={"g": "reduce_scatter"})
    assert split.allocated == 40 * MIB and split.reserved == 60 * MIB
    assert split.reserved_by_stream == {"compute": 40 * MIB, "reduce_scatter": 20 * MIB}
    one = _peak(spans, 4)  # one stream: the 40 MiB block serves both
    assert one.reserved == 40 * MIB


def test_the_optimizer_state_and_its_temporary_take_the_cached_activations():
    # AdamW's state (2 x 20 MiB, one 40 MiB span here) is allocated by the first step into the
    # activation's cached 40 MiB segment; the foreach temporary (half of it) needs a segment of
    # its own, and the next step's activation one more: 20 + 40 + 20 + 40 reserved, where at
    # most 20 + 40 + 40 MiB are ever allocated.
    spans = [("p", "param", 0, 3, 1.0), ("p", "optimizer_state", 0, 3, 2.0), ("a", "activation", 0, 1, 1.0)]
    temporary = ("p", "optimizer_temporary", 3, 3, 1.0)  # the walk's, at its last time: the step
    peak = _peak(spans + [temporary], 4)
    assert peak.allocated == 100 * MIB and peak.reserved == 120 * MIB
    # without the temporary the state's segment is the activation's, and the next step's
    # activation reserves a second: reserved equals allocated
    assert _peak(spans, 4).reserved == 100 * MIB
    # the first step allocates the state before the temporary, and frees the temporary after it
    events = [(e[0], e[1]) for e in step_events(spans + [temporary], SIZES.__getitem__, 4, steps=1)]
    assert events.index(("malloc", 1)) < events.index(("malloc", (0, 3))) < events.index(("free", (0, 3)))
