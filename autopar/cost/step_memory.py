"""The allocations of training steps in the liveness walk's order, through the caching
allocator model (``cost.allocator``): a plan's reserved peak beside its allocated one.

The walk (``cost.liveness``) gives each stored tensor as a span ``(node, kind, start, end,
factor)`` of times ``0 .. num_times - 1``. One step allocates, at each time, the spans that
start there, after freeing those that ended at the time before (the walk counts both ends
alive; a span that ends before it starts holds nothing). Around that, as a training loop runs
them:

* parameters and inputs that live the whole step are allocated once, before the first step;
* the optimizer state (AdamW's moments) is allocated by the first optimizer step, at the
  walk's last time (the step), before what the step holds beyond it (the walk's
  "optimizer_temporary" spans: torch's foreach AdamW's ``_foreach_sqrt`` of every second moment),
  where the first backward's activations are cached (torch's lazy state);
* gradients that live to the end of the step stay until the optimizer has stepped, then go
  (``zero_grad(set_to_none=True)``); their blocks stay cached for the next step.

Steps repeat (``steps``, 2 by default): what one step leaves in the cache is what the next
allocates from, so the reserved peak is the steady state's (a third step reserved nothing more
for Llama 3.1 8B's FSDP jobs, under either allocator). Each span runs on the stream
``stream_of`` gives it (per-stream pools).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence

from autopar.cost.allocator import AllocatorPeak, simulate

Span = tuple[str, str, int, int, float]  # (node, kind, start, end, factor), as the walk gives them
WHOLE_STEP_KINDS = ("param", "input")


def step_events(
    spans: Sequence[Span],
    bytes_of: Callable[[str], float],
    num_times: int,
    stream_of: Callable[[Span], str] = lambda span: "compute",
    steps: int = 2,
) -> Iterator[tuple[str, object, float, str]]:
    """The allocator events (``cost.allocator.simulate``) of ``steps`` training steps of
    ``spans`` (module docstring)."""
    last = num_times - 1
    whole = [k for k, s in enumerate(spans) if s[1] in WHOLE_STEP_KINDS and s[2] == 0 and s[3] == last]
    state = [k for k, s in enumerate(spans) if s[1] == "optimizer_state" and s[2] == 0 and s[3] == last]
    held = {k for k, s in enumerate(spans) if s[1] == "grad" and s[3] == last}  # freed by zero_grad
    kept = set(whole) | set(state)
    starts: dict[int, list[int]] = defaultdict(list)
    ends: dict[int, list[int]] = defaultdict(list)
    for k, (_, _, start, end, _) in enumerate(spans):
        if k not in kept and start <= end:  # a span that ends before it starts holds nothing
            starts[start].append(k)
            if k not in held:
                ends[end].append(k)

    def size(k: int) -> float:
        node, _, _, _, factor = spans[k]
        return factor * bytes_of(node)

    for k in whole:
        yield "malloc", k, size(k), stream_of(spans[k])
    for step in range(steps):
        for time in range(num_times):
            for k in ends.get(time - 1, ()):
                yield "free", (step, k), 0.0, ""
            if step == 0 and time == last:
                for k in state:
                    yield "malloc", k, size(k), stream_of(spans[k])
            for k in starts.get(time, ()):
                yield "malloc", (step, k), size(k), stream_of(spans[k])
        for k in ends.get(last, ()):
            yield "free", (step, k), 0.0, ""
        for k in sorted(held):
            yield "free", (step, k), 0.0, ""


def reserved_peak(
    spans: Sequence[Span],
    bytes_of: Callable[[str], float],
    num_times: int,
    stream_of: Callable[[Span], str] = lambda span: "compute",
    expandable_segments: bool = False,
    steps: int = 2,
    capacity: float = math.inf,
) -> AllocatorPeak:
    """The allocator's peaks over ``steps`` training steps of ``spans`` (``step_events``) on a
    device of ``capacity`` bytes."""
    events = step_events(spans, bytes_of, num_times, stream_of, steps)
    return simulate(events, expandable_segments, capacity)


def peaks_by_config(
    spans: Sequence[Span],
    bytes_of: Callable[[str], float],
    num_times: int,
    stream_of: Callable[[Span], str],
    capacity: float = math.inf,
    configs: Sequence[str] = ("segments", "expandable"),
) -> Mapping[str, AllocatorPeak]:
    """The peaks under PyTorch's default allocator (``"segments"``) and with
    ``expandable_segments:True`` (``"expandable"``), those of ``configs``; ``bytes_of`` and
    ``stream_of`` are asked once per node and span."""
    streams = {span: stream_of(span) for span in dict.fromkeys(spans)}
    sizes = {node: bytes_of(node) for node in dict.fromkeys(span[0] for span in spans)}
    return {
        name: reserved_peak(spans, sizes.__getitem__, num_times, streams.__getitem__, name == "expandable", capacity=capacity)
        for name in configs
    }


__all__ = ["Span", "step_events", "reserved_peak", "peaks_by_config"]
