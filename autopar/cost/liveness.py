"""Peak memory: a liveness walk over forward and backward of one training step.

The timeline has ``2N`` times for a graph of ``N`` nodes in graph order:

* time ``i`` (``0 <= i < N``): forward, just after node ``i`` ran;
* time ``bwd(i) = 2N - 1 - i``: backward of node ``i``, while its saved tensors, the gradient of
  its output and the gradients of its inputs that it produces are all alive.

Every stored tensor is an ``Interval`` of times (both ends included) whose size is ``factor``
times the local bytes of some node's outputs under that node's chosen strategy. So the memory at
any time is linear in the ILP's strategy variables, and the peak is a max over times.

================  ======================  ============================================  =========
kind              owner                   alive                                         factor
================  ======================  ============================================  =========
param             parameter p             the whole step                                1
optimizer_state   parameter p             the whole step                                states·4/itemsize
optimizer_        parameter p             the optimizer step (the last time)            its state's
temporary                                                                               × temporary
grad              parameter p             bwd(last use of p) … end of step              1
input             user input, buffer,     the whole step                                1
                  constant
activation        op output (a root)      from its op to its last forward use, or, if   1
                                          saved for backward, to bwd(first saver)
activation_grad   op output (a root)      bwd(last use) … bwd(the op)                   1
activation_grad   first input of an op    bwd(the op) only: the intermediate gradient   see
                  in BACKWARD_TEMPORARIES a composite op's backward makes               memory
gathered          a parameter the         its group's gather (one group ahead: from     1
                  runtime all-gathers     the previous group's first use) to its last
                  (FSDP; ``Gathered``)    forward use, or to bwd(first saver) if kept;
                                          resharded: again from its group's (or the
                                          group after's) last saver's backward to
                                          bwd(its group's first saver)
comm_buffer       the same parameter      bwd(its last use) … the launch of the next    see
                                          group's reduce-scatter (end of backward for   Gathered
                                          the first group): its whole gradient in a
                                          reduce-scatter bucket; on gloo, again from its
                                          group's launch to the same end (the exchange's
                                          receive buffer)
================  ======================  ============================================  =========

* A *root* is a node that owns storage. Views and getitems alias their input's root: they add no
  bytes, and their uses and savers count as the root's.
* What an op saves for backward follows ``autopar.cost.memory`` (``saves_inputs`` and
  ``saves_output``), only when the op itself needs a gradient. ``mul``/``div`` of two tensors save
  an operand only when the *other* operand needs a gradient (``d(a·b)/da = b``); by a scalar they
  save nothing.
* Gradients of parameters are kept to the end of the step (the optimizer reads them). The
  optimizer state is taken as alive all step: from the second step on it always is.
* The last time, ``bwd(0)`` (the first node is a placeholder: no backward runs there), is the
  optimizer step: every bucket has been waited on, and what the optimizer holds while it steps
  beyond its state is alive (``build_timeline``'s ``step_temporary``: torch's foreach AdamW's
  ``_foreach_sqrt`` of every second moment, ``cost.optimizer.step_temporary``).
* Not modelled: workspace inside a kernel, the allocator's fragmentation and caching (which
  ``cost.step_memory`` runs the final plan's walk through), and the fused kernels' small extra
  saved statistics (a norm's mean and rstd, attention's logsumexp).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from autopar.cost import memory

KINDS = (
    "param",
    "optimizer_state",
    "optimizer_temporary",
    "grad",
    "input",
    "activation",
    "activation_grad",
    "gathered",
    "comm_buffer",
)


@dataclass(frozen=True, slots=True)
class LiveNode:
    """What the walk needs to know of one graph node.

    ``kind`` is ``param``, ``buffer``, ``user``, ``constant``, ``op``, ``alias`` (a view or a
    getitem: shares its first input's storage) or ``output``. ``inputs`` names the producer of
    each tensor input, in order; ``input_requires_grad`` says which of them need a gradient.
    """

    name: str
    kind: str
    inputs: tuple[str, ...] = ()
    target: Any = None
    requires_grad: bool = False
    input_requires_grad: tuple[bool, ...] = ()
    itemsize: int = 4
    # Intermediates the op keeps for its backward beyond its inputs and output, as a multiple of
    # its output's bytes (``memory.internal_saved_factor``: a mixture-of-experts layer's).
    internal_saved: float = 0.0


@dataclass(frozen=True, slots=True)
class Interval:
    node: str  # whose strategy sets the size
    kind: str  # one of KINDS
    start: int
    end: int  # inclusive
    factor: float = 1.0

    def __post_init__(self) -> None:
        assert self.kind in KINDS and 0 <= self.start <= self.end, self


@dataclass(frozen=True, slots=True)
class Timeline:
    """The intervals of one graph; ``curve`` and ``breakdown`` price them for chosen sizes."""

    names: tuple[str, ...]  # node names in graph order
    intervals: tuple[Interval, ...]
    # ``_layout``'s arrays (and the intervals' starts, ends and kinds), built on first use.
    _arrays: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_times(self) -> int:
        return 2 * len(self.names)

    def time_name(self, time: int) -> str:
        num = len(self.names)
        if time < num:
            return f"forward after {self.names[time]}"
        if time == 2 * num - 1:
            return "the optimizer step"
        return f"backward of {self.names[2 * num - 1 - time]}"

    def alive_at(self, time: int) -> list[Interval]:
        return [self.intervals[k] for k in self._alive(time)]

    def _alive(self, time: int) -> np.ndarray:
        """The positions of the intervals alive at ``time``, in interval order."""
        self._layout()
        return np.flatnonzero((self._arrays["starts"] <= time) & (self._arrays["ends"] >= time))

    def factors_at(self, time: int) -> dict[str, float]:
        """Σ factor of the intervals alive at ``time``, per name, in the order of each name's first
        interval: what a loop over ``alive_at`` would sum (``np.add.at`` adds in interval order)."""
        names, index, factors, _ = self._layout()
        alive = self._alive(time)
        owners = index[alive]
        total = np.zeros(len(names))
        np.add.at(total, owners, factors[alive])
        unique, first = np.unique(owners, return_index=True)
        ordered = unique[np.argsort(first)]
        return dict(zip([names[k] for k in ordered], total[ordered].tolist()))

    def curve(self, bytes_of: Callable[[str], float]) -> list[float]:
        """Bytes alive at every time, where node ``n``'s outputs take ``bytes_of(n)`` bytes."""
        return self.curve_array(bytes_of).tolist()

    def curve_array(self, bytes_of: Callable[[str], float]) -> np.ndarray:
        """``curve`` as an array, summed as the walk always summed it: each interval's size
        (``factor * bytes_of(node)``) added at its start and taken off after its end, interval
        by interval, then a running sum from 0 (``np.add.at`` and ``np.cumsum`` add in order,
        so every value is the same to the last bit). ``bytes_of`` is asked once per name."""
        sizes = self.sizes(bytes_of)
        positions = self._layout()[3]
        changes = np.empty(2 * len(sizes))
        changes[0::2], changes[1::2] = sizes, -sizes
        delta = np.zeros(self.num_times + 2)  # a leading 0 for the running sum to start from
        np.add.at(delta, positions, changes)
        return np.cumsum(delta)[1:-1]

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """(each interval's first time, its last time), in interval order."""
        self._layout()
        return self._arrays["starts"], self._arrays["ends"]

    def sizes(self, bytes_of: Callable[[str], float]) -> np.ndarray:
        """Each interval's bytes, ``factor * bytes_of(node)``, in interval order (``bytes_of``
        asked once per name)."""
        names, index, factors, _ = self._layout()
        return factors * np.fromiter(map(bytes_of, names), float, len(names))[index]

    def _layout(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """(the names the intervals size by, each interval's index among them, the intervals'
        factors, where each interval's start and end change the running sum, interleaved)."""
        if not self._arrays:
            names: dict[str, int] = {}
            index = [names.setdefault(iv.node, len(names)) for iv in self.intervals]
            positions = np.empty(2 * len(self.intervals), dtype=np.intp)
            positions[0::2] = [iv.start + 1 for iv in self.intervals]
            positions[1::2] = [iv.end + 2 for iv in self.intervals]
            self._arrays.update(
                names=list(names),
                index=np.array(index, dtype=np.intp),
                factors=np.array([iv.factor for iv in self.intervals], dtype=float),
                positions=positions,
                starts=positions[0::2] - 1,
                ends=positions[1::2] - 2,
                kinds=np.repeat(np.array([KINDS.index(iv.kind) for iv in self.intervals], dtype=np.intp), 2),
            )
        arrays = self._arrays
        return arrays["names"], arrays["index"], arrays["factors"], arrays["positions"]

    def peak(self, bytes_of: Callable[[str], float]) -> tuple[float, int]:
        """(peak bytes, the first time it is reached)."""
        values = self.curve_array(bytes_of)
        time = int(np.argmax(values))
        return float(values[time]), time

    def sampled(self, bytes_of: Callable[[str], float], max_points: int = 240) -> dict[str, Any]:
        """A compact timeline for reports (``Plan.memory_timeline``): bytes alive by kind at up to
        ``max_points`` times, the fullest time of each of as many equal buckets, so the peak is
        always among them. Times index forward (``0 .. num_forward - 1``) then backward.

        Each kind's curve is summed as ``curve_array`` sums the whole one (in interval order, then
        a running sum), and the total at each time kind by kind, in ``KINDS`` order."""
        num_times = self.num_times
        changes = np.empty(2 * len(self.intervals))
        sizes = self.sizes(bytes_of)
        changes[0::2], changes[1::2] = sizes, -sizes
        delta = np.zeros((len(KINDS), num_times + 2))  # a leading 0 per kind for the running sums
        np.add.at(delta, (self._arrays["kinds"], self._arrays["positions"]), changes)
        curves = np.cumsum(delta, axis=1)[:, 1:-1]
        total = np.zeros(num_times)
        for curve in curves:
            total = total + curve
        step = max(1, math.ceil(num_times / max_points))
        buckets = -(-num_times // step)
        padded = np.full(buckets * step, -np.inf)  # a bucket's first fullest time (the last bucket padded)
        padded[:num_times] = total
        times = (np.argmax(padded.reshape(buckets, step), axis=1) + np.arange(buckets) * step).tolist()
        peak = int(np.argmax(total)) if num_times else 0
        shown = [k for k in range(len(KINDS)) if np.any(curves[k, times] != 0)]
        return {
            "num_forward": len(self.names),
            "times": times,
            "kinds": [KINDS[k] for k in shown],
            "bytes": [[int(round(value)) for value in row] for row in curves[shown][:, times].T.tolist()],
            "peak_time": peak,
            "peak_at": self.time_name(peak) if num_times else "",
        }

    def breakdown(self, time: int, bytes_of: Callable[[str], float]) -> dict[str, float]:
        """Bytes alive at ``time`` by kind."""
        out = dict.fromkeys(KINDS, 0.0)
        for iv in self.alive_at(time):
            out[iv.kind] += iv.factor * bytes_of(iv.node)
        return out

    def checkpoints(self, references: Sequence[Callable[[str], float]], per_reference: int = 4) -> list[int]:
        """A handful of times at which the peak is likely: the end of forward, and the highest
        local maxima of the curve under each reference sizing (for example every node's leanest
        and its largest strategy)."""
        chosen = [len(self.names) - 1] if self.names else []
        for bytes_of in references:
            values = self.curve(bytes_of)
            maxima = [
                t
                for t in range(len(values))
                if (t == 0 or values[t] >= values[t - 1]) and (t + 1 == len(values) or values[t] > values[t + 1])
            ]
            maxima.sort(key=lambda t: (-values[t], t))
            chosen.extend(maxima[:per_reference])
        return sorted(dict.fromkeys(chosen))


@dataclass(frozen=True, slots=True)
class Gathered:
    """A parameter that the runtime all-gathers whole before its uses (``ops.buckets.ParamGathers``).

    ``name`` sizes its intervals (the gathered bytes); ``uses`` are the (node index, input index)
    of its forward uses; parameters of one ``group`` are gathered by one collective, in the order
    of their groups' first uses, and ``reshard`` (``ir.gathers.reshards``) frees the group after
    forward and gathers it again in backward. ``grad_factor``: bytes of its whole gradient held in
    a reduce-scatter bucket, per gathered byte (0: its gradient is not reduce-scattered), from its
    backward until the next group's bucket launches (``gathered_intervals``)."""

    name: str
    uses: tuple[tuple[int, int], ...]
    group: int
    reshard: bool
    grad_factor: float = 0.0
    prefetched_by: int | None = None  # the group at whose first gather this one's starts (None: its own)


def gathered_intervals(
    nodes: Sequence[LiveNode], gathered: Sequence[Gathered], backward_prefetch: bool = True, exchange: bool = False
) -> list[Interval]:
    """The ``gathered`` and ``comm_buffer`` intervals of the module docstring.

    A gathered parameter is alive from its group's all-gather, launched at the first use of
    group ``prefetched_by`` (forward prefetch), to its last forward use; what an op saves of it
    keeps it to that op's backward, unless its group is resharded: then backward gathers the
    group again at the first saved tensor it needs (while the group after it in forward order
    runs its backward, with ``backward_prefetch``) and frees it after the last one. Where a
    group of several parameters completes (its first use, its first saved tensor's backward), it
    is there twice: the all-gather's buffer and the parameters copied out of it.

    A reduce-scattered parameter's whole gradient (``grad_factor``) is alive in its group's
    bucket from its last use's backward until the next group's bucket launches, at the
    backward of that group's first use, which waits for this one and frees it
    (``ops.buckets.GradBuckets``); the first group's stays to the end of backward, waited on
    before the optimizer steps at the walk's last time. With
    ``exchange`` (gloo: ``ClusterSpec.gloo``) the reduce-scatter is an all-to-all into a second
    buffer of the same size, alive from the launch until that same wait."""
    num = len(nodes)

    def bwd(i: int) -> int:
        return 2 * num - 1 - i

    def saves(index: int, position: int) -> bool:
        node = nodes[index]
        if getattr(node.target, "overloadpacket", None) is torch.ops.aten.embedding and position == 0:
            return False  # the table's gradient needs its shape only
        return position in _saved_inputs(node)

    first_use: dict[int, int] = {}
    savers: dict[int, list[int]] = {}
    for item in gathered:
        first_use[item.group] = min([first_use.get(item.group, 2 * num)] + [i for i, _ in item.uses])
        savers.setdefault(item.group, []).extend(i for i, j in item.uses if saves(i, j))
    resharded = {item.group for item in gathered if item.reshard}
    # backward gathers a resharded group again when it first needs it, and the resharded group
    # before it in forward order ahead
    order = sorted((g for g in first_use if g in resharded and savers[g]), key=first_use.__getitem__)
    after = {g: order[k + 1] for k, g in enumerate(order[:-1])}
    members: dict[int, int] = {}
    for item in gathered:
        members[item.group] = members.get(item.group, 0) + 1
    scatter_first, freed_at = _scatter_launches(gathered, num)
    out: list[Interval] = []
    for item in gathered:
        if not item.uses:
            continue
        group = item.group
        start = first_use[item.prefetched_by if item.prefetched_by is not None else group]
        last = max(i for i, _ in item.uses)
        own = [i for i, j in item.uses if saves(i, j)]
        # A group of several parameters is copied out of the all-gather's buffer, and both are
        # alive while that runs: once more its bytes, where it is gathered (a group of one is a
        # view of the buffer).
        copied = members[group] > 1
        if copied:
            out.append(Interval(item.name, "gathered", first_use[group], first_use[group]))
        if item.reshard and savers[group]:
            out.append(Interval(item.name, "gathered", start, last))
            begin = bwd(max(savers[group]))
            if copied:
                out.append(Interval(item.name, "gathered", begin, begin))
            following = after.get(group)
            if backward_prefetch and following is not None:
                begin = min(begin, bwd(max(savers[following])))
            out.append(Interval(item.name, "gathered", begin, bwd(min(savers[group]))))
        else:
            out.append(Interval(item.name, "gathered", start, max([last] + [bwd(i) for i in own])))
        if item.grad_factor:
            out.append(Interval(item.name, "comm_buffer", bwd(last), max(bwd(last), freed_at[group]), item.grad_factor))
            if exchange and group in scatter_first:
                launch = bwd(scatter_first[group])
                out.append(Interval(item.name, "comm_buffer", launch, max(launch, freed_at[group]), item.grad_factor))
    return out


def _scatter_launches(gathered: Sequence[Gathered], num: int) -> tuple[dict[int, int], dict[int, int]]:
    """(group → the node whose backward launches its reduce-scatter, group → when its bucket is
    freed). Each group's reduce-scatter launches when its last gradient is complete: at the
    backward of its members' first use. It frees the input of the group launched before it."""
    scatter_first: dict[int, int] = {}
    for item in gathered:
        if item.grad_factor and item.uses:
            scatter_first[item.group] = min(scatter_first.get(item.group, 2 * num), min(i for i, _ in item.uses))
    launches = sorted(set(scatter_first.values()))  # forward order; backward launches them in reverse
    next_in_backward = dict(zip(launches[1:], launches))  # each launch to the one after it in backward
    freed_at = {  # the last launch's is waited on at the end of backward, before the optimizer step
        g: 2 * num - 1 - next_in_backward[first] if first in next_in_backward else 2 * num - 2
        for g, first in scatter_first.items()
    }
    return scatter_first, freed_at


def _saved_inputs(node: LiveNode) -> list[int]:
    """Indices of the tensor inputs that ``node`` keeps for its backward."""
    if not node.requires_grad or node.target is None:
        return []
    packet = getattr(node.target, "overloadpacket", None)
    if packet in (torch.ops.aten.mul, torch.ops.aten.div):
        if len(node.inputs) != 2:
            return []  # by a scalar: the gradient needs only the scalar
        a_grad, b_grad = node.input_requires_grad
        saved = ([1] if a_grad else []) + ([0] if b_grad else [])
        if packet is torch.ops.aten.div and a_grad:
            saved.append(1)
        return sorted(set(saved))
    if memory.saves_inputs(node.target):
        return list(range(len(node.inputs)))
    return []


def _parameter_intervals(
    node: LiveNode, last: int, grad_start: int | None, state: float, split: tuple[int, int], step_temporary: float
) -> list[Interval]:
    """A parameter's intervals (``build_timeline``): itself all step; where it needs a gradient,
    its optimizer state all step (``state`` bytes per byte of it), what the step holds beyond
    that at the last time, and its gradient from ``grad_start`` (None: never used) to the end;
    ``split`` divides the state and the gradient (ZeRO-1 and -2 over that many replicas)."""
    out = [Interval(node.name, "param", 0, last)]
    if not node.requires_grad:
        return out
    if state:
        factor = state / split[0]
        out.append(Interval(node.name, "optimizer_state", 0, last, factor))
        if step_temporary:
            out.append(Interval(node.name, "optimizer_temporary", last, last, factor * step_temporary))
    if grad_start is not None:
        out.append(Interval(node.name, "grad", grad_start, last, 1.0 / split[1]))
    return out


def build_timeline(
    nodes: Sequence[LiveNode],
    optimizer: str = "adamw",
    ties: Sequence[Sequence[str]] = (),
    zero_stage: int = 0,
    zero_ways: int = 1,
    optimizer_dtype: torch.dtype | None = None,
    step_temporary: float = 0.0,
) -> Timeline:
    """The intervals of the module docstring for ``nodes`` in graph order.

    ``zero_stage`` 1 splits every parameter's optimizer state ``zero_ways`` ways (ZeRO-1 over
    ``zero_ways`` replicas), 2 its gradient too (ZeRO-2).

    ``optimizer_dtype`` is the dtype of the optimizer state (a precision policy's); None: each
    parameter's own, as torch's optimizers keep it (a bf16 model's AdamW moments are bf16).

    ``step_temporary``: bytes the optimizer holds while it steps, per byte of a parameter's
    state (``cost.optimizer.step_temporary``), alive at the last time.

    ``ties`` groups parameter placeholders that hold one tensor: only the first of each group
    carries the parameter's bytes, and its gradient is alive from the last use of any member.
    """
    states = memory.OPTIMIZER_STATES[memory.optimizer_kind(optimizer)]
    num = len(nodes)

    def bwd(i: int) -> int:
        return 2 * num - 1 - i

    root: dict[str, str] = {}
    for node in nodes:
        root[node.name] = root[node.inputs[0]] if node.kind == "alias" and node.inputs else node.name
    tie_leader = {member: group[0] for group in ties for member in group}
    uses: dict[str, list[int]] = {}
    savers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if node.kind == "alias":
            continue
        for producer in node.inputs:
            base = tie_leader.get(root[producer], root[producer])
            uses.setdefault(base, []).append(i)
        for j in _saved_inputs(node):
            savers.setdefault(root[node.inputs[j]], []).append(i)
        if node.kind == "op" and node.requires_grad and memory.saves_output(node.target):
            savers.setdefault(node.name, []).append(i)

    intervals: list[Interval] = []
    last = 2 * num - 1
    for i, node in enumerate(nodes):
        name = node.name
        if node.kind == "param":
            if name in tie_leader and tie_leader[name] != name:
                continue
            grad_start = bwd(max(uses[name])) if uses.get(name) else None
            state = states * (optimizer_dtype.itemsize / node.itemsize if optimizer_dtype is not None else 1.0)
            split = (zero_ways if zero_stage >= 1 else 1, zero_ways if zero_stage >= 2 else 1)
            intervals.extend(_parameter_intervals(node, last, grad_start, state, split, step_temporary))
        elif node.kind in ("buffer", "user", "constant"):
            intervals.append(Interval(name, "input", 0, last))
        elif node.kind == "op":
            end = max(uses.get(name, [i]))
            if savers.get(name):
                end = max(end, bwd(min(savers[name])))
            intervals.append(Interval(name, "activation", i, end))
            if node.requires_grad and node.internal_saved:
                intervals.append(Interval(name, "activation", i, bwd(i), node.internal_saved))
            temporary = memory.backward_temporary_factor(node.target)
            if node.requires_grad and temporary and node.inputs:
                intervals.append(Interval(root[node.inputs[0]], "activation_grad", bwd(i), bwd(i), temporary))
            if node.requires_grad and uses.get(name):
                grad_uses = [u for u in uses[name] if nodes[u].requires_grad or nodes[u].kind == "output"]
                if grad_uses:
                    intervals.append(Interval(name, "activation_grad", bwd(max(grad_uses)), bwd(i)))
    return Timeline(tuple(n.name for n in nodes), tuple(intervals))


__all__ = ["KINDS", "LiveNode", "Interval", "Timeline", "build_timeline", "Gathered", "gathered_intervals"]
