r"""The y of hub edges as columns of the LP alone, until a solution uses them.

On meshes of three or more axes an edge's near pairs (``edges.near_pairs``) are most of the
ILP's variables: LLaMA-3-8B on (8, 2, 4) has 140,000 y next to 9,000 x, and a solution uses a
few hundred of them. Each y as a PuLP variable, in a dict keyed by its spec pair, in two PuLP
rows and the objective, and then read back into the HiGHS model, cost more than the LP's
solve. So the y of a hub edge (``EdgePrices.held_pairs``; not those of a gathered parameter,
whose memory rows weigh them) are held here as arrays: the rows each sits in (edge_out[e, p]
and edge_in[e, q], coefficient 1 in both) and its objective coefficient w · r[e, p, q] (w: the
edges that share the y, ``ShardingILP.set_objective``). ``solver.search.relaxation`` gives
them columns of its HiGHS model beside the PuLP variables: the LP is the same LP, every column
in it. A held y that a solution sets above 0 becomes a PuLP variable (``ShardingILP.generate``),
in its y dict, its two rows and the objective, with the value HiGHS gave it; so the problem of
record holds every y the solution uses, ``rounding.check`` prices an assignment by it as
before, and the objective's value at the solution is the LP's. A MILP (PuLP's solvers), or an LP
under another objective, first takes them all (``ShardingILP.generate_all``).
"""

from __future__ import annotations

import bisect

import numpy as np

from autopar.ir.spec import Spec
from autopar.solver.problem.edges import HeldPairs


class HeldColumns:
    """The held y of every hub edge with y of its own, as flat arrays, one entry a y: its group
    (an edge whose y its repeated-layer twins share), its position in the group, its two rows
    (numbered as the problem added them), its seconds; ``cost`` = seconds × the edges sharing
    the group, once ``weigh`` has counted them; ``taken``: a PuLP variable now."""

    def __init__(self):
        # Per group: (first edge, its y dict, its seconds list, src specs, dst specs, src and dst positions).
        self.groups: list[tuple] = []
        self._parts: list[tuple[np.ndarray, ...]] = []
        self.group = self.out_row = self.in_row = self.position = np.zeros(0, dtype=np.int64)
        self.seconds = self.cost = np.zeros(0)
        self.taken = np.zeros(0, dtype=bool)
        self._group_of: dict[int, int] = {}
        self._starts = np.zeros(1, dtype=np.int64)
        self._index: dict[int, tuple[dict, dict, dict]] = {}

    def hold(self, e: int, y: dict, seconds: list, specs: tuple[list[Spec], list[Spec]], pairs: HeldPairs, row: int) -> None:
        """Hold the y of edge ``e`` (``pairs``: its table's, positions into ``specs``, its
        producer's output specs and its consumer's input specs, whose edge_out rows are numbered
        from ``row`` on, then its edge_in rows); ``y`` and ``seconds``: its y dict and their seconds."""
        srcs, dsts = specs
        if (len(srcs), len(dsts)) != (pairs.num_src, pairs.num_dst):
            raise AssertionError(
                "columns.hold: an edge's specs are not those its prices were priced from; this is a bug in autopar"
            )
        if not len(pairs.seconds):
            return
        count = len(pairs.seconds)
        self._parts.append(
            (
                np.full(count, len(self.groups), dtype=np.int64),
                row + pairs.src,
                row + len(srcs) + pairs.dst,
                np.arange(count, dtype=np.int64),
                pairs.seconds,
            )
        )
        self.groups.append((e, y, seconds, srcs, dsts, pairs.src, pairs.dst))

    def weigh(self, uses: dict[int, int]) -> None:
        """Fix the arrays; ``uses``: the edges that share each group's y, by the id of its dict."""
        if self._parts:
            self.group, self.out_row, self.in_row, self.position, self.seconds = map(np.concatenate, zip(*self._parts))
            counts = np.array([uses[id(group[1])] for group in self.groups], dtype=float)
            self.cost = counts[self.group] * self.seconds
        self.taken = np.zeros(len(self.seconds), dtype=bool)
        self._parts = []
        self._group_of = {id(group[1]): g for g, group in enumerate(self.groups)}  # by the id of its y dict
        self._starts = np.cumsum([0] + [len(group[5]) for group in self.groups])
        self._index: dict[int, tuple[dict, dict, dict]] = {}  # ``find``'s, per group asked

    def find(self, y: dict, pair: tuple[Spec, Spec]) -> int | None:
        """The position of the held y of ``pair`` in the group whose y dict is ``y``; None when
        it is none (not a held group's, not one of its pairs, or a variable now)."""
        g = self._group_of.get(id(y))
        if g is None:
            return None
        index = self._index.get(g)
        if index is None:
            _, _, _, srcs, dsts, src, dst = self.groups[g]
            start = int(self._starts[g])
            pairs = {(i, j): start + n for n, (i, j) in enumerate(zip(src.tolist(), dst.tolist()))}
            index = self._index[g] = ({s: i for i, s in enumerate(srcs)}, {d: j for j, d in enumerate(dsts)}, pairs)
        k = index[2].get((index[0].get(pair[0]), index[1].get(pair[1])))
        return None if k is None or self.taken[k] else k

    def __len__(self) -> int:
        return len(self.taken) - int(self.taken.sum())

    def left(self) -> np.ndarray:
        """The positions of the y still held."""
        return np.flatnonzero(~self.taken)

    def name(self, k: int) -> str:
        """The name of held y ``k``'s variable: ``ShardingILP`` names an edge's y by its position
        among the edge's pairs (``EdgePrices.direct_items``), as it did when each was one."""
        return self.names(np.array([k]))[0]

    def names(self, held: np.ndarray) -> list[str]:
        """``name`` of each of ``held``."""
        edges = np.array([group[0] for group in self.groups], dtype=np.int64)[self.group[held]]
        return [f"y_{e}_{p}" for e, p in zip(edges.tolist(), self.position[held].tolist())]

    def merged_order(self, names: list[str], held: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the place of each of ``held``, the place of each of ``names``) in the sorted list of
        ``names`` (sorted, as PuLP sorts its variables) and the names of ``held``: what a stable
        argsort of the two lists' strings gives, without the strings of ``held``.

        A held name is ``y_{e}_{p}``; the names of one edge e are one block of the sorted list
        (they share a prefix), placed by the prefix where no other name has it, and ordered in it
        by the text of p; two blocks compare by the text of e followed by ``_``, which sorts after
        every digit."""
        edges = np.array([group[0] for group in self.groups], dtype=np.int64)[self.group[held]]
        positions = self.position[held]
        order = np.lexsort((_text_ranks(positions), _text_ranks(edges, suffix="_")))
        starts = np.empty(len(order), dtype=np.int64)  # how many of names sort before each, in that order
        sorted_edges = edges[order]
        bounds = np.flatnonzero(np.diff(sorted_edges)) + 1
        for first, last in zip(np.r_[0, bounds].tolist(), np.r_[bounds, len(order)].tolist()):
            e = int(sorted_edges[first])
            low, high = bisect.bisect_left(names, f"y_{e}_"), bisect.bisect_left(names, f"y_{e}`")
            if low == high:
                starts[first:last] = low
            else:  # names of this edge's y among them (generated since): place each by its text
                texts = [f"y_{e}_{p}" for p in positions[order[first:last]].tolist()]
                starts[first:last] = [bisect.bisect_left(names, text, low, high) for text in texts]
        place = np.empty(len(order), dtype=np.int64)
        place[order] = np.arange(len(order)) + starts
        return place, np.arange(len(names)) + np.searchsorted(starts, np.arange(len(names)), side="right")

    def pair(self, k: int) -> tuple[tuple[Spec, Spec], float, int]:
        """(its (src, dst) specs, its seconds, its group's first edge) of held y ``k``."""
        e, _, _, srcs, dsts, src, dst = self.groups[self.group[k]]
        position = self.position[k]
        return (srcs[src[position]], dsts[dst[position]]), float(self.seconds[k]), e


def _text_ranks(values: np.ndarray, suffix: str = "") -> np.ndarray:
    """Each of ``values`` (integers) replaced by the rank of its decimal text (plus ``suffix``)
    among theirs, in string order."""
    distinct, inverse = np.unique(values, return_inverse=True)
    ranks = np.empty(len(distinct), dtype=np.int64)
    ranks[sorted(range(len(distinct)), key=lambda i: f"{distinct[i]}{suffix}")] = np.arange(len(distinct))
    return ranks[inverse]


__all__ = ["HeldColumns"]
