"""Strategies the ILP never needs to see: impossible ones, and dominated ones.

Both cuts are exact: no plan the ILP could choose, and no optimum, is lost.

- **Impossible** (``feasible``): a strategy whose input takes ``Partial`` on a mesh axis where no
  strategy of its producer leaves that input ``Partial`` can never be chosen, because no
  collective turns R or S into P (``spec.transition_steps``). Nor can one that needs a
  tensor written in place, or a getitem's, in a spec its producer never outputs (those edges
  are pinned). In the ILP such an x is 0 in every feasible solution; on a 3-axis mesh they are
  a third of a linear's strategies (a weight is never Partial) and more of the ops after it.
  Nodes are cut in graph order, so each sees its producers already cut.
- **Dominated** (``undominated``): two strategies with the same interface (the same input and
  output specs) cost the same on every edge, so the one that is no cheaper in seconds,
  bytes, memory and gradient reductions, and hides no more of them in backward, is never
  needed. Among equals the first is kept.

The counts go to ``ChoiceGraph.pruned`` and the plan's solver statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.spec import Spec, partial_axes


def partial_mask(spec: Spec) -> int:
    """Bit ``a`` set where ``spec`` is Partial on mesh axis ``a``."""
    return partial_axes(spec)


@dataclass(frozen=True, slots=True)
class Reachable:
    """What can arrive at a consumer's input from its producer's output specs: any spec whose
    Partial axes the producer leaves Partial in one of its specs, or (``pinned``) only those
    specs themselves."""

    masks: frozenset[int]
    specs: frozenset[Spec]
    pinned: bool

    @classmethod
    def of(cls, out_specs: Sequence[Spec], pinned: bool) -> Reachable:
        masks = frozenset(partial_mask(spec) for spec in out_specs)
        # Only the maximal masks matter for the subset test.
        maximal = frozenset(m for m in masks if not any(m != o and m & o == m for o in masks))
        return cls(maximal, frozenset(out_specs) if pinned else frozenset(), pinned)

    def admits(self, spec: Spec) -> bool:
        if self.pinned:
            return spec in self.specs
        mask = partial_mask(spec)
        return not mask or any(mask & m == mask for m in self.masks)


def feasible(ins_of: Sequence[tuple[Spec, ...]], reachable: Sequence[Reachable | None]) -> list[int]:
    """Indices of the strategies (given by their input specs) whose every input spec its
    producer can deliver (``reachable[i]`` None: anything). Each input's spec objects are asked
    about once (an op's equal specs are mostly one object: ``rules.registry.expand_rows``)."""
    admitted: dict[tuple[int, int], bool] = {}  # (input, id(spec)): ``ins_of`` holds the specs
    keep = []
    for s, ins in enumerate(ins_of):
        for index, (spec, r) in enumerate(zip(ins, reachable)):
            if r is None:
                continue
            found = admitted.get((index, id(spec)))
            if found is None:
                found = admitted[(index, id(spec))] = r.admits(spec)
            if not found:
                break
        else:
            keep.append(s)
    return keep


def undominated(interfaces: Sequence[tuple], costs: Sequence[tuple[float, ...]]) -> list[int]:
    """Indices of the strategies that no other strategy of the same interface dominates.

    ``interfaces[s]`` is what the edges see of strategy s (input and output specs);
    ``costs[s]`` a tuple of amounts where less is better for every entry (seconds, bytes,
    memory, ... ; negate one where more is better). s is dominated by t when t ≤ s in every
    entry and t comes first or is strictly better in one."""
    by_interface: dict[tuple, list[int]] = {}
    for s, interface in enumerate(interfaces):
        by_interface.setdefault(interface, []).append(s)
    dropped: set[int] = set()
    for members in by_interface.values():
        if len(members) < 2:
            continue
        for s in members:
            for t in members:
                if t == s or t in dropped:
                    continue
                no_worse = all(a <= b for a, b in zip(costs[t], costs[s]))
                if no_worse and (t < s or any(a < b for a, b in zip(costs[t], costs[s]))):
                    dropped.add(s)
                    break
    return [s for s in range(len(interfaces)) if s not in dropped]


__all__ = ["partial_mask", "Reachable", "feasible", "undominated"]
