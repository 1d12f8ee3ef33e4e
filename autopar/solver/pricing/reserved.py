"""A solved plan's peak as PyTorch's caching allocator reserves it (``cost.step_memory``), run
once on the final plan: the ILP and the memory planner bound the tensors alive
(``peak_memory_bytes``), which is linear in their choices; the allocator's cache is not, and a
simulation per candidate would cost the solver's inner loop a walk of every allocation.

Streams. autopar's runtime allocates every tensor on the compute stream, collectives' outputs
included (c10d's async work runs on NCCL's stream, into tensors the caller allocated): one pool.
FSDP2 (``fully_shard``, as torchtitan runs it) allocates apart: a reduce-scattered parameter's
sharded gradient is carved out of the reduce-scatter's output, allocated on the reduce-scatter
stream, and an all-gather's flat buffer (the walk's one-time ``gathered`` span inside a longer
one: the buffer the group's parameters are copied out of) on the all-gather stream; a block
cached on one of those streams serves no other (``fsdp2_stream_of``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping

from autopar.cost.cluster import ClusterSpec
from autopar.cost.step_memory import Span, peaks_by_config
from autopar.solver.problem.gathered import PREFIX as GATHERED


def fsdp2_stream_of(spans: Iterable[Span]) -> Callable[[Span], str]:
    """The stream FSDP2 allocates each span of ``spans`` on (module docstring)."""
    spans = list(spans)
    scattered = {node.removeprefix(GATHERED) for node, kind, *_ in spans if kind == "comm_buffer"}
    gathered: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for node, kind, start, end, _ in spans:
        if kind == "gathered":
            gathered[node].append((start, end))

    def stream(span: Span) -> str:
        node, kind, start, end, _ = span
        if kind == "grad" and node in scattered:
            return "reduce_scatter"
        if kind == "gathered" and start == end:
            if any(s <= start <= e and e > s for s, e in gathered[node]):
                return "all_gather"
        return "compute"

    return stream


def allocator_peaks(
    spans: Iterable[Span],
    bytes_of: Callable[[str], float],
    num_times: int,
    cluster: ClusterSpec,
) -> Mapping[str, int] | None:
    """``Prediction.allocator_peak_bytes``: the steady state's allocated peak (every block
    rounded), its reserved peak as autopar's runtime
    allocates (one stream) under PyTorch's default allocator (``reserved``) and with expandable
    segments (``reserved_expandable``), and with expandable segments as FSDP2 allocates
    (``reserved_fsdp2_expandable``: torchtitan's setting; each run of the model costs about 0.06 s
    on Llama 3.1 8B, so the fourth combination is left out), on a device of
    ``cluster.memory_bytes``; ``short``, only
    where the runtime's default allocator runs out of that device even after giving back its
    cache, the most bytes a request lacked. None on a cluster of host devices
    (``ClusterSpec.gloo``), whose memory has no caching allocator. What the optimizer holds
    while it steps is among ``spans`` (the walk's last time)."""
    if cluster.gloo:
        return None
    spans = [tuple(span) for span in spans]
    runtime = peaks_by_config(spans, bytes_of, num_times, _compute_stream, cluster.memory_bytes)
    fsdp2_stream = fsdp2_stream_of(spans)
    fsdp2 = runtime["expandable"]
    if any(fsdp2_stream(span) != "compute" for span in spans):  # else FSDP2 allocates as the runtime does
        fsdp2 = peaks_by_config(spans, bytes_of, num_times, fsdp2_stream, cluster.memory_bytes, ("expandable",))
        fsdp2 = fsdp2["expandable"]
    default = runtime["segments"]
    out = {
        "allocated": default.allocated,
        "reserved": default.reserved,
        "reserved_expandable": runtime["expandable"].reserved,
        "reserved_fsdp2_expandable": fsdp2.reserved,
    }
    if default.num_ooms:
        out["short"] = default.short
    return out


def _compute_stream(span: Span) -> str:
    return "compute"


def allocator_budget(plan, memory_budget: float | None, asked: float | None = None) -> float | None:
    """The budget to plan again under where ``plan`` fits ``memory_budget`` on paper but the
    caching allocator runs out of the device; None where it does not. What the allocator reserves
    beyond the tensors is kept free of ``asked``, the budget the user asked for (default
    ``memory_budget``), not of a budget an earlier round already lowered, which would take each
    round's reserve off again; and it is lowered by at least what it lacks: a plan made under it
    that fragments as much fits, where lowering by the shortfall alone let the next plan fill the
    budget again and fall short by a little more, round after round.

    ``memory_budget`` bounds the tensors alive (allocated), not the allocator's reserve: where a
    new segment would not fit, the allocator gives its cached segments back and retries, so a
    reserve above the budget costs a synchronizing cache flush, not an error; what can fail is
    fragmentation inside segments that still hold live blocks."""
    peaks = plan.predicted.allocator_peak_bytes
    if memory_budget is None or not peaks or not peaks.get("short"):
        return None
    asked = memory_budget if asked is None else asked
    return min(memory_budget - peaks["short"], asked - max(peaks["short"], peaks["reserved"] - peaks["allocated"]))


def timeline_spans(timeline) -> list[Span]:
    """The walk's intervals (``cost.liveness.Timeline``) as spans."""
    return [(iv.node, iv.kind, iv.start, iv.end, iv.factor) for iv in timeline.intervals]


__all__ = ["allocator_budget", "allocator_peaks", "fsdp2_stream_of", "timeline_spans"]
