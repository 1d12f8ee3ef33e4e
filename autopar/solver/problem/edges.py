"""The edges of the choice graph and their prices: what resharding a tensor between its producer's
output spec and its consumer's input spec costs (``cost.comm.transition_cost``).

An edge's price table (``EdgePrices``) answers for any (src, dst) pair, pricing on demand. What
the ILP sees of it is what it iterates over:

- On meshes of at most two axes larger than 1, every possible pair (``dense``). The ILP gives
  each its own y variable: the joint distribution of the two ends' specs, exact.
- On three or more such axes that product is too large (a 4-D activation takes ~200 specs on
  (8, 2, 4): 40,000 pairs per edge, a million y on LLaMA-3-8B). There it iterates over the
  *near* pairs (``near_pairs``: one axis changes; or only replicated axes, by local chunks; or
  the Partial axes and at most one more, to replicated, or two that split one dim, one to
  replicated and one to another dim), and carries a *hub* through the
  replicated spec: the price of each src → R…R and of each R…R → dst. Any other pair is priced
  in the ILP as the gather to replicated and the local chunk back (``ilp.ShardingILP._add_hub``):
  an upper bound of its own price, which the plan then reports exactly (``__getitem__``). Pairs
  into a Partial input that are not near have no route there: the ILP cannot choose them.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.fx

from autopar.cost import comm
from autopar.cost.cluster import ClusterSpec
from autopar.ir.spec import KIND_PARTIAL, KIND_REPLICATE, KIND_SHARD, PlacementNumbers, Spec, spec_key
from autopar.rules.registry import normalized_kwargs, tensor_meta

Price = tuple[float, float]  # (seconds forward + backward, bytes sent)
Item = tuple[tuple[Spec, Spec], Price]


class HeldPairs(NamedTuple):
    """The pairs of a hub's table that the hub prices higher (``EdgePrices.direct_items``), in
    table order: the position of each one's src in the src spec list the table was priced from,
    of its dst in the dst list, and its seconds; and the lengths of both lists."""

    src: np.ndarray
    dst: np.ndarray
    seconds: np.ndarray
    num_src: int
    num_dst: int


class EdgePrices(Mapping):
    """(src spec, dst spec) → (seconds, bytes sent) of one edge; a missing key is an impossible
    transition. Iteration yields the pairs the ILP gives variables (all, or the near ones: see
    the module docstring); with ``price`` (a hub's table), any other pair is priced when asked,
    and kept. ``hub`` is None (dense or pinned), or the seconds of src → replicated per src spec
    and of replicated → dst per dst spec."""

    __slots__ = ("_table", "_items", "hub", "_price", "_asked", "_factor", "_routed", "_held", "_coded")

    def __init__(
        self,
        table: dict[tuple[Spec, Spec], Price] | list[Item] | Callable[[], list[Item]],
        price: Callable[[Spec, Spec], Price | None] | None,
        hub: tuple[dict[Spec, float], dict[Spec, float]] | None = None,
        factor: float = 1.0,
        routed: np.ndarray | None = None,
        held: HeldPairs | None = None,
        coded: tuple[Callable, Callable, Callable] | None = None,
    ):
        # A hub's table comes as its (pair, price) items, or a function that lists them, made a
        # dict only when iterated (most never are): a pair is found by pricing it (``price``),
        # and the dict's keys cost a hash of every placement of both specs, for 10^5 near pairs.
        self._table, self._items = table, None
        if not isinstance(table, dict):
            self._table, self._items = None, table
            if price is None:
                self._table, self._items = dict(table() if callable(table) else table), None
        self.hub = hub
        self._price = price
        self._asked: dict[tuple[Spec, Spec], Price | None] = {}
        self._factor = factor
        self._routed = routed  # per item of ``table``: whether the hub prices it no higher
        self._held = held  # ``direct_items`` as arrays (a hub's table; ``held_pairs``)
        self._coded = coded  # a hub's table: its pricer's (``Pricer.code``, ``prices_of``, ``prices_many``)

    def coder(self) -> Callable[[Spec], int] | None:
        """The numbering of specs ``get_coded`` takes (a hub's table, unscaled); None: ask ``get``."""
        return None if self._coded is None or self._factor != 1.0 else self._coded[0]

    def get_coded(self, src: Spec, dst: Spec, src_code: int, dst_code: int) -> Price | None:
        """``get((src, dst))`` where ``coder`` numbers ``src`` and ``dst``: the same price, read
        from the pricer by the codes, with no hash of the specs' placements (the runner-ups of a
        decision ask for ~10^4 pairs the table leaves out, on LLaMA-3-8B (8, 2, 4))."""
        return self._coded[1](src, dst, src_code, dst_code)

    def get_coded_many(self, pairs: list[tuple[int, int]]) -> list[Price | None]:
        """``get_coded`` of each (src code, dst code) of ``pairs``, those not priced yet priced
        together: the explanations of a decision on a 3-axis mesh ask for 10^3-10^4 at once."""
        return self._coded[2](pairs)

    def direct_items(self) -> list[tuple[tuple[Spec, Spec], Price]]:
        """The (pair, price) items of ``table`` that the hub does not price as low: through the
        replicated spec a pair costs r[p, ρ] + r[ρ, q] ≥ r[p, q] (``ilp.ShardingILP._add_hub``),
        so where that is equal (a gather to replicated and a local chunk back, on LLaMA-3-8B
        (8, 2, 4) a sixth of the near pairs), the pair needs no y of its own: every item with
        no hub."""
        if self._routed is None:
            return list(self.table.items())
        return [item for item, routed in zip(self.table.items(), self._routed.tolist()) if not routed]

    def held_pairs(self) -> HeldPairs | None:
        """``direct_items`` as arrays, for an ILP that gives them columns of its LP alone
        (``solver.problem.columns``): None on a table without a hub."""
        return self._held

    @property
    def table(self) -> dict[tuple[Spec, Spec], Price]:
        """The priced pairs (all, pinned, or near: see the module docstring) and their prices."""
        if self._table is None:
            items = self._items
            self._table, self._items = dict(items() if callable(items) else items), None
        return self._table

    def get(self, pair: tuple[Spec, Spec], default=None):
        found = self._table.get(pair) if self._table is not None else None
        if found is not None or self._price is None:
            return default if found is None else found
        price = self._asked.get(pair, _UNPRICED)
        if price is _UNPRICED:
            price = self._price(*pair)
            price = self._asked[pair] = None if price is None else (price[0] * self._factor, price[1])
        return default if price is None else price

    def __getitem__(self, pair: tuple[Spec, Spec]) -> Price:
        price = self.get(pair)
        if price is None:
            raise KeyError(pair)
        return price

    def __contains__(self, pair) -> bool:
        return self.get(pair) is not None

    def __iter__(self) -> Iterator[tuple[Spec, Spec]]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    # What iteration yields, read straight from the table (``Mapping``'s own look each key up).
    def values(self):
        return self.table.values()

    def items(self):
        return self.table.items()

    def __eq__(self, other) -> bool:
        if not isinstance(other, EdgePrices):
            return NotImplemented
        return self.table == other.table and self.hub == other.hub

    __hash__ = None

    def scaled(self, factor: float) -> EdgePrices:
        """The same prices with seconds times ``factor`` (bytes as they are)."""
        table = {pair: (seconds * factor, sent) for pair, (seconds, sent) in self.table.items()}
        hub = None if self.hub is None else tuple({spec: s * factor for spec, s in side.items()} for side in self.hub)
        held = self._held
        if held is not None:
            held = HeldPairs(held.src, held.dst, held.seconds * factor, held.num_src, held.num_dst)
        return EdgePrices(table, self._price, hub, self._factor * factor, self._routed, held)


@dataclass
class Edge:
    producer: str
    out_index: int
    consumer: str
    in_index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    # The tensor must arrive as it is: the consumer writes it in place, or is a getitem, which
    # only names one output of its producer, or follows its producer (``choices._mark_followers``).
    no_reshard: bool
    # (src spec, dst spec) → (seconds, bytes sent); absent = impossible (``EdgePrices``)
    price: Mapping[tuple[Spec, Spec], Price] = field(default_factory=dict)
    # The dtype its gradient is reduced in, where not ``dtype`` (a parameter's cast under a
    # precision policy: its ``reduce_dtype``).
    grad_dtype: torch.dtype | None = None


def uses_hub(mesh_shape: tuple[int, ...]) -> bool:
    """Whether edges on ``mesh_shape`` give the ILP near pairs and a hub, not every pair."""
    return sum(size > 1 for size in mesh_shape) >= 3


def reduce_dtype(node: torch.fx.Node) -> torch.dtype | None:
    """The dtype gradients flowing into ``node`` are reduced in, where a precision policy says
    (``trace._cast_parameters`` marks the casts of parameters); None: their own dtype."""
    return node.meta.get("autopar", {}).get("reduce_dtype")


class Pricer:
    """Prices of one (shape, dtype, grad, grad dtype) by spec codes, computed once each: hashing a
    spec hashes each of its placements, so specs are numbered (``code``) by their placements'
    numbers (``comm.TransitionPrices.numbered``), which read each placement object once."""

    def __init__(self, mesh_shape, cluster):
        self.mesh_shape, self.cluster = mesh_shape, cluster
        self.codes: dict[tuple[int, ...], int] = {}  # by the spec's placement numbers
        self.rows: list[tuple[int, ...]] = []  # and back
        self.known: dict[tuple, dict[tuple[int, int], Price | None]] = {}
        self.transitions = comm.TransitionPrices(mesh_shape, cluster)  # ``comm.transition_cost``, shared work

    def code(self, spec: Spec) -> int:
        row = self.transitions.numbered(spec)
        found = self.codes.get(row)
        if found is None:
            found = self.codes[row] = len(self.rows)
            self.rows.append(row)
        return found

    def rows_of(self, specs: list[tuple[Spec, int]]) -> np.ndarray:
        """The placement numbers of ``specs`` (with their codes), a row each: what
        ``comm.TransitionPrices.price_pairs`` takes."""
        return self._rows([code for _, code in specs])

    def _rows(self, codes: list[int]) -> np.ndarray:
        rows = self.rows
        numbered = np.array([rows[code] for code in codes], dtype=self.transitions.numbers.dtype)
        return numbered.reshape(len(codes), len(self.mesh_shape))

    def _known(self, edge: Edge) -> tuple[tuple, dict[tuple[int, int], Price | None]]:
        """(what an edge's prices depend on besides its specs, the prices known for it by codes)."""
        key = _price_key(edge)
        known = self.known.get(key)
        if known is None:
            known = self.known[key] = {}
        return key, known

    def price(self, edge: Edge, src: Spec, dst: Spec, src_code: int, dst_code: int) -> Price | None:
        return self.prices_of(edge)(src, dst, src_code, dst_code)

    def prices_of(self, edge: Edge) -> Callable[[Spec, Spec, int, int], Price | None]:
        """``price`` for one edge's (shape, dtype, grad, grad dtype), looked up once."""
        key, known = self._known(edge)
        transitions, get = self.transitions.price, known.get

        def price(src: Spec, dst: Spec, src_code: int, dst_code: int) -> Price | None:
            codes = (src_code, dst_code)
            found = get(codes, _UNPRICED)
            if found is _UNPRICED:
                found = known[codes] = transitions(src, dst, codes, *key)
            return found

        return price

    def prices_many(self, edge: Edge) -> Callable[[list[tuple[int, int]]], list[Price | None]]:
        """``prices_of`` for many (src code, dst code) at once: the ones not known yet priced
        together (``comm.TransitionPrices.price_pairs``, the same floats as one by one), and kept."""
        key, known = self._known(edge)
        transitions = self.transitions

        def prices(pairs: list[tuple[int, int]]) -> list[Price | None]:
            new = [pair for pair in dict.fromkeys(pairs) if pair not in known]
            if new:
                src, dst = self._rows([pair[0] for pair in new]), self._rows([pair[1] for pair in new])
                possible, seconds, sent = transitions.price_pairs(src, dst, *key)
                for pair, ok, total, bytes_sent in zip(new, possible.tolist(), seconds.tolist(), sent.tolist()):
                    known[pair] = (total, bytes_sent) if ok else None
            return [known[pair] for pair in pairs]

        return prices

    def on_demand(self, edge: Edge) -> Callable[[Spec, Spec], Price | None]:
        """``price`` of any pair, by specs. It holds no reference to ``edge``, whose table keeps
        it: that cycle left every hub table (10^5 tuples on a 3-axis mesh) to the garbage
        collector's full passes, which planning holds off (``solver.planners.quiet_gc``)."""
        prices, code = self.prices_of(edge), self.code
        return lambda src, dst: prices(src, dst, code(src), code(dst))


_UNPRICED = object()


def _price_key(edge: Edge) -> tuple:
    """What an edge's transition prices depend on besides its two specs: (shape, dtype, grad, grad dtype)."""
    return (edge.shape, edge.dtype, edge.requires_grad, edge.grad_dtype)


def near_pairs(srcs: list[tuple[Spec, int]], dsts: list[tuple[Spec, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The (i, j) such that ``srcs[i]`` and ``dsts[j]`` differ on at most one mesh axis; or only on
    axes where the src is replicated (local chunks, free in forward); or, besides the axes where
    the src is Partial (reductions), on at most one more, which then changes to replicated (a
    row-parallel linear's (S, S, P) into a sequence-parallel (S, R, S) is one); or, besides
    those, a dim sharded on two axes that is gathered on one and moved to another dim on the
    other (an all-to-all: a vocabulary-parallel embedding's (S(2), S(2), P) into (S(0), R, S(1))).
    In the order of ``itertools.product`` (src, then dst), as two arrays: the i, and the j."""
    if not srcs or not dsts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    numbers = PlacementNumbers()

    def rows(specs: list[tuple[Spec, int]]) -> np.ndarray:
        return np.array([[numbers.number(key) for key in spec_key(spec)] for spec, _ in specs], dtype=numbers.dtype)

    src, dst = rows(srcs), rows(dsts)
    return near_numbered(src, dst, numbers.arrays()[0])


def near_numbered(src: np.ndarray, dst: np.ndarray, kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``near_pairs`` of specs as rows of placement numbers (``spec.PlacementNumbers``: 0 is
    replicated; ``kinds``: each number's ``_kind`` bits).

    Every (src, dst) at once, with numpy: ``differ[i, j]`` the mask of the axes where the pair
    differs, one byte a pair (a table of 1,800 x 2,900 specs on a 4-axis mesh)."""
    num_axes = src.shape[1]
    differ = np.zeros((len(src), len(dst)), dtype=np.uint8)
    for axis in range(num_axes):
        differ |= (src[:, None, axis] != dst[None, :, axis]) * np.uint8(1 << axis)
    src_kinds = kinds[src]
    bits = (1 << np.arange(num_axes)).astype(np.uint8)
    partial = ((src_kinds & KIND_PARTIAL != 0) * bits).sum(axis=1, dtype=np.uint8)
    whole = ((src_kinds & KIND_REPLICATE != 0) * bits).sum(axis=1, dtype=np.uint8)
    # Local chunks out of the replicated axes: any of them, and nothing else; or one axis, with no Partial.
    near = (differ & ~whole[:, None]) == 0
    near |= (partial == 0)[:, None] & ((differ & (differ - np.uint8(1))) == 0)
    reducing = np.flatnonzero(partial)
    if len(reducing):
        near[reducing] |= _near_reductions(differ[reducing], partial[reducing], src[reducing], dst, kinds)
    return np.nonzero(near)


def _near_reductions(differ: np.ndarray, partial: np.ndarray, src: np.ndarray, dst: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """``near_numbered``'s pairs of srcs with Partial axes: the Partial axes and at most one more,
    to replicated or that axis alone; or a reduction, a gather to replicated on one axis of a
    dim sharded on two, and an all-to-all on the other."""
    num_axes = src.shape[1]
    near = np.zeros(differ.shape, dtype=bool)
    reduced = (differ & partial[:, None]) == 0
    for axis in range(num_axes):
        bit = np.uint8(1 << axis)
        within = (differ & ~(partial | bit)[:, None]) == 0
        allowed = ((partial & bit) != 0)[:, None] | reduced | (dst[None, :, axis] == 0)
        near |= within & allowed
    outside_partial = differ & ~partial[:, None]
    dst_whole, dst_sharded = dst == 0, kinds[dst] & KIND_SHARD != 0
    for a, b in itertools.combinations(range(num_axes), 2):
        split = (
            (partial >> a & 1 == 0) & (partial >> b & 1 == 0) & (src[:, a] == src[:, b]) & (kinds[src[:, a]] & KIND_SHARD != 0)
        )
        rows = np.flatnonzero(split)
        if not len(rows):
            continue
        moved = (dst_whole[:, b] & dst_sharded[:, a]) | (dst_whole[:, a] & dst_sharded[:, b])
        near[rows] |= ((outside_partial[rows] & ~np.uint8((1 << a) | (1 << b))) == 0) & moved[None, :]
    return near


def price_edges(gm: torch.fx.GraphModule, choices: dict, mesh_shape: tuple[int, ...], cluster: ClusterSpec) -> list[Edge]:
    """One ``Edge`` per tensor input of every node, with its prices.

    Edges of one shape share prices: one table per (spec lists, shape, dtype, grad, pinned), and
    one price per (src, dst, shape, dtype, grad) across tables. Spec lists are computed once per
    strategy list (identical ops share one, see ``choices._op_choice``)."""
    edges = []
    tables: dict[tuple, EdgePrices] = {}
    pricer = Pricer(mesh_shape, cluster)
    spec_lists: dict[tuple[int, str, int], tuple[tuple[Spec, ...], tuple[int, ...]]] = {}
    interned: dict[tuple[int, ...], tuple[tuple[Spec, ...], tuple[int, ...]]] = {}
    hub = uses_hub(mesh_shape)

    def coded(specs: tuple[tuple[Spec, ...], tuple[int, ...]]) -> list[tuple[Spec, int]]:
        return list(zip(*specs))

    def specs_of(choice, side: str, index: int) -> tuple[tuple[Spec, ...], tuple[int, ...]]:
        """The distinct specs of one side of a strategy list, in order (``Choice.out_specs``,
        ``Choice.in_specs``), and their codes; told apart by the codes, which read placements by
        identity (hashing a spec hashes each of its placements, in Python)."""
        key = (id(choice.strategies), side, index)
        found = spec_lists.get(key)
        if found is None:
            distinct: dict[int, Spec] = {}
            for strategy in choice.strategies:
                spec = (strategy.outs if side == "out" else strategy.ins)[index]
                distinct.setdefault(pricer.code(spec), spec)
            # One object per distinct list (every layer's weights have their own strategy
            # lists), so that the tables below, keyed by identity, are shared between layers.
            codes = tuple(distinct)
            found = spec_lists[key] = interned.setdefault(codes, (tuple(distinct.values()), codes))
        return found

    grad_dtypes = {node.name: reduce_dtype(node) for node in gm.graph.nodes if reduce_dtype(node) is not None}
    for node in gm.graph.nodes:
        choice = choices[node.name]
        if node.op == "placeholder":
            continue
        mutated = mutated_inputs(node)
        for in_index, (producer, out_index) in enumerate(choice.inputs):
            source = choices[producer]
            shape, dtype = source.out_shapes[out_index], source.out_dtypes[out_index]
            pinned = in_index in mutated or node.target is operator.getitem or choice.follower_of == producer
            edge = Edge(
                producer,
                out_index,
                node.name,
                in_index,
                shape,
                dtype,
                source.requires_grad,
                pinned,
                grad_dtype=grad_dtypes.get(producer),
            )
            srcs, dsts = specs_of(source, "out", out_index), specs_of(choice, "in", in_index)
            # By identity: the spec tuples are cached above, and hashing their placements is
            # most of this loop's time on a deep model.
            table_key = (id(srcs), id(dsts), shape, dtype, edge.requires_grad, pinned, edge.grad_dtype)
            if table_key not in tables:
                tables[table_key] = price_table(edge, coded(srcs), coded(dsts), pricer, hub and not pinned)
            edge.price = tables[table_key]  # shared, read-only from here on
            edges.append(edge)
    return edges


def price_table(edge: Edge, srcs: list[tuple[Spec, int]], dsts: list[tuple[Spec, int]], pricer: Pricer, hub: bool) -> EdgePrices:
    """The prices of one edge (``EdgePrices``): every pair, only the spec as it is (pinned), or
    the near pairs and the hub (``_hub_table``)."""
    if hub and not edge.no_reshard:
        return _hub_table(edge, srcs, dsts, pricer)
    if edge.no_reshard:
        allowed = {spec for spec, _ in dsts}
        combos = [(pair, pair) for pair in srcs if pair[0] in allowed]
    else:
        combos = itertools.product(srcs, dsts)
    prices = pricer.prices_of(edge)
    table = {}
    for (src, src_code), (dst, dst_code) in combos:
        price = prices(src, dst, src_code, dst_code)
        if price is not None:
            table[(src, dst)] = price
    # Only a hub's table leaves pairs out that may be asked for: a dense one holds every
    # possible pair, a pinned one every pair it allows (the spec as it is).
    return EdgePrices(table, None)


def _hub_table(edge: Edge, srcs: list[tuple[Spec, int]], dsts: list[tuple[Spec, int]], pricer: Pricer) -> EdgePrices:
    """The near pairs' prices, and the hub: each src's price to the replicated spec and the
    replicated spec's to each dst; the pairs the hub prices no higher are ``routed``, the
    others ``held`` (by their positions in ``srcs`` and ``dsts``). All priced at once, with
    numpy (``comm.TransitionPrices.price_pairs``: 10^6 near pairs on a 4-axis mesh)."""
    transitions = pricer.transitions
    src_rows, dst_rows = pricer.rows_of(srcs), pricer.rows_of(dsts)
    rows, columns = near_numbered(src_rows, dst_rows, transitions.numbers.arrays()[0])
    # One call prices each src → replicated (placement number 0 on every axis), replicated → each dst, and the near pairs.
    whole = np.zeros((1, len(pricer.mesh_shape)), dtype=src_rows.dtype)
    src_all = np.concatenate([src_rows, np.broadcast_to(whole, dst_rows.shape), src_rows[rows]])
    dst_all = np.concatenate([np.broadcast_to(whole, src_rows.shape), dst_rows, dst_rows[columns]])
    possible, seconds, sent = transitions.price_pairs(src_all, dst_all, *_price_key(edge))
    hub = slice(len(srcs), len(srcs) + len(dsts))
    outs, ins, into = seconds[: len(srcs)], seconds[hub], possible[hub]
    possible, seconds, sent = (column[hub.stop :] for column in (possible, seconds, sent))
    # A padded parameter shard moves by its own gather alone (``spec.padded_transition_ok``): no
    # route through the replicated spec, only its near pairs
    padded = transitions.padded_axes(src_rows, edge.shape)
    hubbed = np.ones(len(srcs), dtype=bool) if padded is None else ~padded.any(axis=1)
    outs = np.where(hubbed, outs, np.inf)
    via = (
        {src: seconds for (src, _), seconds, through in zip(srcs, outs.tolist(), hubbed.tolist()) if through},
        {dst: seconds for (dst, _), seconds, possible in zip(dsts, ins.tolist(), into.tolist()) if possible},
    )
    routed = possible & (seconds >= outs[rows] + np.where(into, ins, np.inf)[columns])
    direct = np.flatnonzero(possible & ~routed)
    held = HeldPairs(rows[direct], columns[direct], seconds[direct], len(srcs), len(dsts))
    kept = np.flatnonzero(possible)
    items = functools.partial(_items, srcs, dsts, (rows[kept], columns[kept], seconds[kept], sent[kept]))
    coded = (pricer.code, pricer.prices_of(edge), pricer.prices_many(edge))
    return EdgePrices(items, pricer.on_demand(edge), via, routed=routed[kept], held=held, coded=coded)


def _items(srcs: list[tuple[Spec, int]], dsts: list[tuple[Spec, int]], pairs: tuple[np.ndarray, ...]) -> list[Item]:
    """A hub table's (pair, price) items: ``pairs`` as (src positions, dst positions, seconds, bytes sent)."""
    return [((srcs[i][0], dsts[j][0]), (seconds, sent)) for i, j, seconds, sent in zip(*(column.tolist() for column in pairs))]


# Composite ops that write arguments their schema does not mark as written: they update running
# statistics in place through the native op they call.
_UNDECLARED_WRITES = {
    torch.ops.aten.batch_norm.default: {"running_mean", "running_var"},
    torch.ops.aten.instance_norm.default: {"running_mean", "running_var"},
}


@functools.cache
def _written_arguments(target: torch._ops.OpOverload) -> frozenset[str]:
    """Names of the arguments ``target`` writes in place (once per op: every node asks)."""
    written = {a.name for a in target._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    return frozenset(written | _UNDECLARED_WRITES.get(target, set()))


def mutated_inputs(node: torch.fx.Node) -> set[int]:
    """Tensor-input indices that the op writes in place: schema alias info with is_write, plus
    ``_UNDECLARED_WRITES``. Such an input can never be resharded on its way in, or the write
    would land in a temporary."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return set()
    written = _written_arguments(target)
    if not written:
        return set()
    indices, index = set(), 0
    for name, value in normalized_kwargs(node).items():
        for leaf in flatten(value):
            if isinstance(leaf, torch.fx.Node) and tensor_meta(leaf.meta.get("val")):
                if name in written:
                    indices.add(index)
                index += 1
    return indices


def flatten(value) -> list:
    """The leaves of nested lists, tuples and dicts (an fx node's arguments)."""
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in flatten(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in flatten(v)]
    return [value]


__all__ = [
    "Edge",
    "EdgePrices",
    "HeldPairs",
    "Pricer",
    "price_edges",
    "price_table",
    "near_pairs",
    "uses_hub",
    "mutated_inputs",
    "reduce_dtype",
    "flatten",
]
