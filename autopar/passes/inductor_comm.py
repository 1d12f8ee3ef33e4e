"""The compiled mode's bucketing of functional collectives: an inductor post-grad pass.

Inductor's own FX bucketing (``bucket_all_reduces_fx`` and its siblings, torch 2.13) sizes every
bucket of a run of collectives with the cap of bucket 0 only (``greedy_bucket_collective_by_mb``
reads its size determinator once), and drops a collective that depends on the bucket being
filled from bucketing altogether. Under DDP's caps (1 MiB first, 25 MiB after) that made every
bucket 1 MiB and left each 1 MiB weight gradient all-reduced alone: 25 all-reduces per step of
the benchmark's GPT (4 with this pass). ``BucketCollectives`` does the grouping with the caps of
``CommOptions`` bucket by bucket, and merges each bucket with inductor's own merge functions.
All-gathers are bucketed one layer at a time (the layer that ``ops.collectives.gather_param``
annotates), as ``ir.gathers`` groups the eager schedule's, so that a layer resharded after
forward is gathered again in backward just before its own backward, not with every other layer.

On gloo it then runs each (merged) reduce-scatter as one all-to-all and a local sum of the
pieces received, as the eager runtime does (``ops.collectives._sums_exchanged``: gloo's own
reduce-scatter takes 1.6-2.1 times as long).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable

import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes import bucketing
from torch._inductor.pattern_matcher import stable_topological_sort

from autopar.ir.options import CommOptions
from autopar.ops.collectives import LAYER_ANNOTATION

_C10D = torch.ops._c10d_functional
# (is this node the collective, its bucketing key, merge one bucket)
KINDS: dict[str, tuple[Callable[[torch.fx.Node], bool], Callable[[torch.fx.Node], tuple], Callable]] = {
    "all_reduce": (
        bucketing.is_all_reduce_tensor,
        lambda n: (n.args[2], n.args[1], n.meta["val"].dtype),
        lambda graph, nodes: bucketing.merge_all_reduce_bucket(graph, nodes, "default"),
    ),
    "reduce_scatter": (
        bucketing.is_reduce_scatter_tensor,
        lambda n: (n.args[3], n.args[1], n.args[2], n.meta["val"].dtype),
        lambda graph, nodes: bucketing.merge_reduce_scatter_bucket(graph, nodes, "default"),
    ),
    # one layer per bucket, as ir.gathers groups the eager gathers (forward, and backward's again
    # where the layer reshards after forward): the layer is annotated on the gather's nodes
    "all_gather": (
        bucketing.is_all_gather_into_tensor,
        lambda n: (n.args[2], n.args[1], n.meta["val"].dtype, n.meta.get("custom", {}).get(LAYER_ANNOTATION)),
        lambda graph, nodes: bucketing.merge_all_gather_bucket(graph, nodes, "default"),
    ),
}


class BucketCollectives(CustomGraphPass):
    """Bucket the graph's all-reduces and reduce-scatters (``caps[0]`` bytes for the first bucket
    of a run, ``caps[1]`` after) and all-gathers (``gather_cap`` bytes); with ``exchange_sums``
    (gloo), each reduce-scatter then becomes an all-to-all and a sum."""

    def __init__(self, caps: tuple[int, int], gather_cap: int, exchange_sums: bool):
        self.caps, self.gather_cap, self.exchange_sums = caps, gather_cap, exchange_sums

    def __call__(self, graph: torch.fx.Graph) -> None:
        for kind, (is_kind, key, merge) in KINDS.items():
            caps = (self.gather_cap, self.gather_cap) if kind == "all_gather" else self.caps
            for nodes in buckets(graph, is_kind, key, caps):
                merge(graph, nodes)
        if self.exchange_sums:
            for node in [n for n in graph.nodes if bucketing.is_reduce_scatter_tensor(n)]:
                _exchange_sum(graph, node)
        stable_topological_sort(graph)  # a merged bucket's users may precede it (as after inductor's own)

    def uuid(self) -> str:
        with open(__file__, "rb") as handle:
            source = handle.read()
        return hashlib.sha256(source + repr((self.caps, self.gather_cap, self.exchange_sums)).encode()).hexdigest()


def bucket_pass(options: CommOptions, exchange_sums: bool) -> BucketCollectives:
    first = options.first_bucket_cap_bytes or options.bucket_cap_bytes
    return BucketCollectives((first, options.bucket_cap_bytes), max(options.gather_group_bytes, 1), exchange_sums)


def buckets(
    graph: torch.fx.Graph, is_kind: Callable[[torch.fx.Node], bool], key: Callable[[torch.fx.Node], tuple], caps: tuple[int, int]
) -> list[list[torch.fx.Node]]:
    """Buckets of two or more collectives of one kind, in the order of their waits: a run of
    waits with the same key (group, op, dtype) is cut greedily at ``caps[0]`` bytes for the
    first bucket and ``caps[1]`` after, and where a collective depends on the bucket being
    filled (it cannot join it)."""
    children: dict[torch.fx.Node, list[torch.fx.Node]] = collections.defaultdict(list)
    for node in graph.nodes:
        for source in node.all_input_nodes:
            children[source].append(node)
    runs: list[list[torch.fx.Node]] = []
    last_key = None
    for node in graph.nodes:
        if bucketing.is_wait_tensor(node) and is_kind(node.args[0]):
            collective = node.args[0]
            if key(collective) != last_key:
                runs.append([])
                last_key = key(collective)
            runs[-1].append(collective)
    out: list[list[torch.fx.Node]] = []
    for run in runs:
        started = 0
        bucket: list[torch.fx.Node] = []
        below: set[torch.fx.Node] = set()  # what the bucket's collectives feed
        filled = 0
        for collective in run:
            size = max(_nbytes(collective), _nbytes(collective.all_input_nodes[0]))
            if bucket and (collective in below or filled + size > caps[min(started, 1)]):
                if len(bucket) > 1:
                    out.append(bucket)
                bucket, below, filled, started = [], set(), 0, started + 1
            bucket.append(collective)
            filled += size
            _descendants(collective, children, below)
        if len(bucket) > 1:
            out.append(bucket)
    return out


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _descendants(node: torch.fx.Node, children: dict, into: set[torch.fx.Node]) -> None:
    stack = [node]
    while stack:
        for child in children[stack.pop()]:
            if child not in into:
                into.add(child)
                stack.append(child)


def _exchange_sum(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """``reduce_scatter_tensor(x, "sum", k, g)`` → ``all_to_all_single(x)`` (piece j of dim 0 to
    rank j), its wait, and the sum of the k pieces received, where dim 0 divides by k (it does
    for a reduce-scatter)."""
    source, reduce_op, size, group = node.args
    if reduce_op != "sum" or len(node.users) != 1 or not bucketing.is_wait_tensor(next(iter(node.users))):
        return  # left as it is: gloo runs its own reduce-scatter
    (wait,) = node.users
    val = source.meta["val"]
    rows = val.shape[0] // size
    with graph.inserting_before(node):
        exchange = graph.call_function(_C10D.all_to_all_single.default, (source, [rows] * size, [rows] * size, group))
        received = graph.call_function(_C10D.wait_tensor.default, (exchange,))
        pieces = graph.call_function(torch.ops.aten.view.default, (received, [size, rows, *val.shape[1:]]))
        summed = graph.call_function(torch.ops.aten.sum.dim_IntList, (pieces, [0]))
    fake_mode = torch._guards.detect_fake_mode([val])
    with fake_mode:
        exchange.meta["val"] = torch.empty_like(val)
        received.meta["val"] = torch.empty_like(val)
        pieces.meta["val"] = val.new_empty((size, rows, *val.shape[1:]))
        summed.meta["val"] = val.new_empty((rows, *val.shape[1:]))
    wait.replace_all_uses_with(summed)
    graph.erase_node(wait)
    graph.erase_node(node)
