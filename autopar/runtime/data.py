"""The ranks agree on each call's data before the call's first collective and before it returns.

Under ``batch="whole"`` every rank must pass the same whole batch; under ``batch="per_rank"``
the ranks of one data-parallel rank must pass the same rows. A rank that passes other data would
mix rows of different batches into one step without any error, so every call compares a
fingerprint of each rank's inputs in one all-gather of a few numbers per rank (over the world,
so that every rank sees every other's and all raise the same error, none waits). A call that one
rank refuses (wrong arguments or shapes) is refused on every rank in the same exchange. The
gather runs while the call computes: each rank waits for it just before the call's first
collective, or at the end of its forward (``start_check``), so it raises before any collective
and before the call returns.

Where a graph's first collective is an all-reduce of a few numbers (a data-parallel plan's loss:
its sum and denominator), the gather waits for it and carries them: each rank sums the group's
numbers from the checked table itself, so the forward makes one collective where it made two
(``_Check.ride``; ``ParallelModule`` learns which graphs do so from their first call).

The random generators are an input too. Where the plan draws random numbers (dropout) for a tensor
that several ranks hold whole (replicated on a mesh axis), those ranks must draw the same numbers,
or their copies of one tensor differ and the step is silently wrong. The same gather compares a
fingerprint of their generators' states (``random_ops``), and refuses a call whose ranks are not in
step, as DDP scripts that seed each rank differently would be.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import is_fake

from autopar.errors import DataMismatchError, InputError, ModelError, PartialCallError
from autopar.ir.data import DataLayout
from autopar.ir.plan import Plan
from autopar.ops import collectives

_T = TypeVar("_T")
# Per rank: its group (the data-parallel rank under per_rank data, else 0), refused (1) or not, the
# data's fingerprint (3), the group of ranks whose random generators must agree, and theirs, and
# which call of the module this is (its count, and 1 in train mode): ``check_same_call``, and the
# number of the call's input shapes (``runtime.shapes``), which every rank must share. Then the
# all-reduce that rides along (``_Check.ride``): how many numbers (0: none), its group's key, and
# the numbers. Every row has every column, so that every rank's gather is the same size whatever
# it carries (a rank that refuses or settles early posts the same all-gather as one that rides).
_RIDE = 10
RIDE_SLOTS = 4
_FIELDS = _RIDE + 2 + RIDE_SLOTS
_PRIME = 251  # position weights cycle through 1..251, so that reordered rows change the fingerprint
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13's name


def fingerprint(leaves: list[Any], device: torch.device) -> torch.Tensor:
    """Three float64 numbers that differ, almost surely, between two different lists of tensors:
    the tensors' sizes (each weighted by its place), the sum of their rows' sums, and that sum
    weighted by row position (so that reordered rows differ). Sums accumulate in float64 and make
    no float64 copy of the inputs' elements beyond the row sums. A handful of ops in all, whatever
    the number of tensors: it runs on every call (``start_check`` reads ``_data_sums``)."""
    count, sums = _data_sums(leaves, device)
    return torch.cat([torch.tensor([count], dtype=torch.float64, device=device), sums])


def _data_sums(leaves: list[Any], device: torch.device) -> tuple[float, torch.Tensor]:
    """``fingerprint``'s numbers: the sizes' number (a Python float) and the two sums (a float64
    tensor on ``device``), in one product of the row sums with their weights (``_row_weights``)."""
    count, sums, layout, floating = 0.0, [], [], False
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        rows = (leaf.detach() if leaf.requires_grad else leaf).reshape(leaf.shape[0] if leaf.dim() else 1, -1)
        summed = rows.sum(dim=1, dtype=torch.float64)
        floating = floating or leaf.is_floating_point() or leaf.is_complex()
        sums.append(summed if summed.device == device else summed.to(device))
        layout.append((rows.shape[0], index))
        count += (index + 1) * (leaf.numel() + sum(size * (dim + 1) * _PRIME for dim, size in enumerate(leaf.shape)))
    if not sums:
        return count, torch.zeros(2, dtype=torch.float64, device=device)
    flat = sums[0] if len(sums) == 1 else torch.cat(sums)
    if floating:  # a NaN would make equal data compare unequal; integer sums hold none (one op less a call)
        flat = torch.nan_to_num(flat)
    return count, flat @ _row_weights(tuple(layout), device)


_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _row_weights(layout: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """Each row's two weights in ``fingerprint`` ([rows, 2]): 1, and its position in its tensor,
    cycling through 1..251, plus the tensor's place; made once per layout of (rows, place) and device."""
    key = (layout, device)
    weights = _WEIGHTS.get(key)
    if weights is None:
        if len(_WEIGHTS) > 64:  # shapes that keep changing: keep the cache small
            _WEIGHTS.clear()
        parts = [torch.arange(rows, dtype=torch.float64).remainder_(_PRIME).add_(index + 1) for rows, index in layout]
        positions = torch.cat(parts)
        weights = _WEIGHTS[key] = torch.stack([torch.ones_like(positions), positions], dim=1).to(device)
    return weights


class RandomOps(NamedTuple):
    """The random ops of a graph that draw for a tensor replicated on some mesh axes (``random_ops``)."""

    group: int  # this rank's coordinate on the other axes, row-major: the ranks that must draw alike share it
    axes: tuple[int, ...]
    nodes: tuple[str, ...]


def random_ops(
    gm: torch.fx.GraphModule, plan: Plan, coordinate: tuple[int, ...], only: Collection[str] | None = None
) -> RandomOps | None:
    """Which of ``gm``'s random ops (``torch.Tag.nondeterministic_seeded``: dropout in training,
    ``rand_like``, ``bernoulli`` ...) have an output replicated on a mesh axis of size > 1, as the
    plan places them; None if none has. A node the plan does not name counts as replicated.
    ``only``: the names of the nodes this rank runs (a pipeline stage's), None for all."""
    axes: set[int] = set()
    nodes = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if only is not None and node.name not in only:
            continue
        if torch.Tag.nondeterministic_seeded not in node.target.tags or _draws_nothing(node):
            continue
        decided = plan.nodes.get(node.name)
        spec = decided.outs[0] if decided is not None and decided.outs else None
        replicated = [
            axis
            for axis, size in enumerate(plan.mesh_shape)
            if size > 1 and (spec is None or axis >= len(spec) or spec[axis].is_replicate())
        ]
        if replicated:
            axes.update(replicated)
            nodes.append(node.name)
    if not nodes:
        return None
    group = 0
    for axis, size in enumerate(plan.mesh_shape):
        group = group * size + (0 if axis in axes else coordinate[axis])
    return RandomOps(group, tuple(sorted(axes)), tuple(nodes))


def _draws_nothing(node: torch.fx.Node) -> bool:
    """Dropout in evaluation (``train=False``) or with ``p=0`` is the identity; an op with a
    ``dropout_p`` of 0 (``scaled_dot_product_attention`` and its kernels, tagged random whatever
    their dropout: a model without dropout) draws nothing either, so that ranks seeded apart
    (DDP scripts seed ``seed + rank``) are not refused for attention that draws nothing."""
    if node.target in (torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p")
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return train is False or p == 0
    arguments = node.target._schema.arguments
    where = next((index for index, argument in enumerate(arguments) if argument.name == "dropout_p"), None)
    if where is None:
        return False
    if where < len(node.args):
        dropout_p = node.args[where]
    else:
        default = arguments[where].default_value if arguments[where].has_default_value() else None
        dropout_p = node.kwargs.get("dropout_p", default)
    return not isinstance(dropout_p, torch.fx.Node) and dropout_p == 0


_STATE_WEIGHTS: dict[int, torch.Tensor] = {}


def _random_fingerprint(state: tuple[torch.Tensor, torch.Tensor | None]) -> float:
    """One number that differs, almost surely, between two states of the generators a forward
    draws from (``_rng_state``: the CPU's, and the device's)."""
    total = 0.0
    for part in state:
        if part is None:
            continue
        weights = _STATE_WEIGHTS.get(part.numel())
        if weights is None:
            weights = _STATE_WEIGHTS.setdefault(
                part.numel(), torch.arange(part.numel(), dtype=torch.float64).remainder_(_PRIME).add_(1)
            )
        total = total * 2 + float((part.to(torch.float64) * weights).sum())
    return total


def start_check(
    validate: Callable[[], _T],
    leaves: list[Any],
    layout: DataLayout,
    coordinate: tuple[int, ...],
    device: torch.device,
    random: RandomOps | None = None,
    call: tuple[int, int] = (0, False),
    shapes: float = 0.0,
    defer: bool = False,
) -> tuple[_T, Callable[[], None]]:
    """``validate()`` (the call's own checks, which return its flat inputs) and the launch of one
    all-gather that tells every rank whether any rank refused the call or passed other data than
    the ranks it must agree with. Returns ``validate()``'s result and ``settle``, which waits for
    the gather and raises the same kind of error on every rank (once; later calls do nothing).

    The caller settles before the call's first collective and before it returns: until then the
    rank computes while the gather runs, so the check adds no sync point of its own (a data-parallel
    plan's forward has none before its loss). A rank that refuses waits for the gather and raises
    at once; the others raise at their settle, before any collective that rank would not join.
    ``random``: the graph's random ops that need this rank's generators in step with others'.
    ``call``: (how many calls of the module this rank made, its train mode or ``GATHER``), which must agree.
    ``shapes``: a number of the call's input shapes (``runtime.shapes.key_number``), which must be
    the same on every rank: a rank that meets new shapes settles before it plans them.
    ``defer``: post the gather at the settle instead of now, so that an all-reduce of a few numbers
    met first (a data-parallel plan's loss) rides in it (``_Check.ride``): one collective, not two."""
    if any(isinstance(leaf, torch.Tensor) and (leaf.is_meta or is_fake(leaf)) for leaf in leaves):
        return validate(), _nothing  # shapes only (``autopar check``'s fake world): no values to compare
    if dist.get_world_size() == 1:
        return validate(), _nothing  # no other rank to agree with (and no device sync on a lone GPU)
    refusal: BaseException | None = None
    result: Any = None
    try:
        result = validate()
    except (ValueError, TypeError) as error:
        refusal = error
    group = layout.rank(coordinate) if layout.per_rank else 0  # the ranks that must pass the same data
    rng = _rng_state(device)  # compared here where random ops need it, restored on a refusal
    drawn = [0.0, 0.0] if random is None else [float(random.group), _random_fingerprint(rng)]
    count, sums = _data_sums(leaves, device)
    head = [group, float(refusal is not None), count, 0.0, 0.0, *drawn, float(call[0]), float(call[1]), shapes]
    row = torch.tensor(head + [0.0] * (_FIELDS - _RIDE), dtype=torch.float64, device=device)
    row[3:5] = sums  # one tensor and one copy: this runs on every call
    check = _Check(row, layout, random, rng, device)
    if refusal is not None:
        check.post()
        collectives.call_on_world("all-gather (data check)", check.wait)
        raise refusal
    if not defer:
        check.post()
    return result, check


class _Check:
    """One call's data check (``start_check``): calling it settles the check, once. ``ride`` settles
    it at an all-reduce of a few numbers and, where every rank of the all-reduce's group put them
    in its row, returns their sum; ``rode`` says whether the check settled at such an all-reduce
    (``ParallelModule`` then defers the next call's gather to ride)."""

    __slots__ = ("_row", "_layout", "_random", "_rng", "_device", "_gathered", "_work", "_settled", "rode")

    def __init__(
        self,
        row: torch.Tensor,
        layout: DataLayout,
        random: RandomOps | None,
        rng: tuple[torch.Tensor, torch.Tensor | None],
        device: torch.device,
    ):
        self._row, self._layout, self._random, self._rng, self._device = row, layout, random, rng, device
        self._gathered: torch.Tensor | None = None
        self._work: Any = None
        self._settled = False
        self.rode = False

    def post(self) -> None:
        """Launch the all-gather of every rank's row."""
        self._gathered = torch.empty(dist.get_world_size() * _FIELDS, dtype=torch.float64, device=self._device)
        self._work = collectives.call_on_world(
            "all-gather (data check)", _all_gather_into, self._gathered, self._row, async_op=True
        )

    def wait(self) -> None:
        self._work.wait()

    def __call__(self) -> None:
        self._settle()

    def _settle(self) -> list[list[float]] | None:
        """Wait for the gather (posting it first where deferred) and check the table; the table."""
        if self._settled:
            return None
        self._settled = True
        if self._work is None:
            self.post()
        collectives.call_on_world("all-gather (data check)", self.wait)
        assert self._gathered is not None
        table = self._gathered.view(-1, _FIELDS).tolist()  # one device sync on a GPU; the checks read Python floats
        try:
            check_same_call([row[7:9] for row in table])
            refused = [rank for rank, row in enumerate(table) if row[1] != 0]
            if refused:
                raise InputError(f"ranks {refused} refused this call (see their errors); every rank stops here")
            _check_same_shapes(table)
            _check_same_data(table, self._layout)
            if self._random is not None:
                _check_same_random(table, self._random)
        except ValueError:  # a refusing rank ran nothing: every rank leaves with the state it came with
            _set_rng_state(self._rng, self._device)
            raise
        return table

    def ride(self, x: torch.Tensor, group_name: str) -> torch.Tensor | None:
        """Settle at an all-reduce (sum) of ``x`` over ``group_name``: where the gather is still to
        post and ``x`` holds at most ``RIDE_SLOTS`` floating-point numbers, they ride in this rank's
        row. Returns their sum over the group where every rank of it put the same all-reduce in its
        row (each rank sums the same rows in rank order, in float64: all get the same numbers), else
        None: the all-reduce then runs as it is, on every rank of the group alike, since each
        decides from the same table."""
        fits = x.is_floating_point() and 0 < x.numel() <= RIDE_SLOTS and x.device == self._device
        self.rode = fits and not self._settled
        if not self.rode:
            self._settle()
            return None
        members = collectives.group_ranks(group_name)
        key = _group_key(members)
        if self._work is None:  # still to post: the numbers ride in this rank's row
            carried = [x.numel(), key, *x.detach().reshape(-1).tolist()]
            self._row[_RIDE : _RIDE + len(carried)] = torch.tensor(carried, dtype=torch.float64)
        table = self._settle()
        assert table is not None
        if any(table[rank][_RIDE] != x.numel() or table[rank][_RIDE + 1] != key for rank in members):
            return None
        start = _RIDE + 2
        sums = [sum(table[rank][start + i] for rank in members) for i in range(x.numel())]
        return torch.tensor(sums, dtype=x.dtype, device=x.device).reshape(x.shape)  # rounded once, from float64


def _group_key(members: list[int]) -> float:
    """A number naming a group by its ranks (a CRC: exact in float64), so that ranks that ride
    all-reduces of different groups (which a rank never should) do not sum each other's."""
    return float(zlib.crc32(",".join(map(str, members)).encode()))


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random generators a forward draws from (dropout): the CPU's, and ``device``'s."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


_UNMARKED_WRITES = (torch.ops.aten.batch_norm.default, torch.ops.aten.instance_norm.default)


def writes_state(gm: torch.nn.Module) -> bool:
    """Whether ``gm`` writes one of its inputs in place (batch norm's running statistics and
    counter): such a graph settles its data check before it runs, so that a refused call leaves
    every rank's buffers as they were. Other graphs only read their inputs until they return.
    A module that is not an fx graph (``autopar check``'s shape checker) cannot be read, so it
    is taken to write."""
    if not isinstance(gm, torch.fx.GraphModule):
        return True
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target in _UNMARKED_WRITES and len(node.args) > 5 and node.args[5] is not False and node.args[3] is not None:
            return True  # training with running statistics: written in place, unmarked in the schema
        arguments = node.target._schema.arguments
        values = list(zip(arguments, node.args)) + [(a, node.kwargs[a.name]) for a in arguments if a.name in node.kwargs]
        for argument, value in values:
            if argument.alias_info is not None and argument.alias_info.is_write and _reads_input(value):
                return True
    return False


def _reads_input(value: Any) -> bool:
    """Whether ``value`` is a graph input or a view of one."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function" and value.args:
        target = value.target
        if not isinstance(target, torch._ops.OpOverload) or not target._schema.arguments:
            return False
        alias = target._schema.arguments[0].alias_info
        if alias is None or alias.is_write:  # not a view of its first argument
            return False
        value = value.args[0]
    return isinstance(value, torch.fx.Node) and value.op == "placeholder"


def _nothing() -> None:
    pass


# The mode code of a ``call`` that gathers the whole state (``ShardedModule.full_state_dict``),
# beside a forward's 0 (eval) and 1 (train): every rank must gather together, as every rank calls.
GATHER = 2


def _call_name(count: float, mode: float) -> str:
    if int(mode) == GATHER:
        return f"gathering the whole state after call {int(count)}"
    return f"call {int(count)} in {'train' if mode else 'eval'} mode"


def check_same_call(calls: torch.Tensor | list[list[float]]) -> None:
    """Refuse on every rank where ranks are at different calls (``calls``: per rank, its count of
    calls and its mode: eval, train or ``GATHER``): a forward or a gather of the whole state that
    only some ranks run (an evaluation or a checkpoint on rank 0 alone) would otherwise wait for the
    others until the process-group timeout, or pair with their next call."""
    calls = _listed(calls)
    seen = {(int(count), int(mode)) for count, mode in calls}
    if len(seen) == 1:
        return
    where = "; ".join(f"rank {rank}: {_call_name(count, mode)}" for rank, (count, mode) in enumerate(calls))
    if any(mode == GATHER for _, mode in seen):
        raise PartialCallError(
            f"every rank must gather the whole state of a compiled module together, but the ranks are in different "
            f"calls ({where}): pm.module.state_dict(), pm.full_state_dict() and save_pretrained gather the shards "
            "from every rank where the plan shards a tensor. Call it on every rank and let rank 0 alone write the "
            "file (torch.save on rank 0; save_pretrained does it), or save a sharded checkpoint on every rank with "
            "autopar.checkpoint.save(path, pm, optimizer)"
        )
    raise PartialCallError(
        f"every rank must call the compiled module, each call on every rank, but the ranks are in different calls "
        f"({where}): a forward that some ranks skip (an evaluation on rank 0 alone) meets another call of the others. "
        "Run it on every rank (each evaluates, rank 0 reports), or, as DDP's evaluation does, let rank 0 alone run "
        "a plan that replicates every parameter in eval mode under torch.no_grad(), which needs no other rank "
        "(under batch='per_rank', on other shapes than a rank's rows: the whole batch)"
    )


def _listed(rows: torch.Tensor | list[list[float]]) -> list[list[float]]:
    """The gathered table (a row per rank) as Python floats."""
    return rows.tolist() if isinstance(rows, torch.Tensor) else rows


def _check_same_data(rows: torch.Tensor | list[list[float]], layout: DataLayout) -> None:
    rows = _listed(rows)
    first: dict[int, int] = {}
    for rank, row in enumerate(rows):
        dp_rank = int(row[0])
        other = first.setdefault(dp_rank, rank)
        if row[2:5] == rows[other][2:5]:
            continue
        if not layout.per_rank:
            raise DataMismatchError(
                f"ranks {other} and {rank} passed different batches, but this module takes the same whole batch on "
                "every rank (batch='whole') and cuts it itself; mixing rows of different batches would train on "
                "neither. Pass every rank the same batch, or, to load each rank's own rows as DDP does, compile with "
                "data=autopar.DataOptions(batch='per_rank') and use DistributedSampler(num_replicas="
                "pm.data_parallel_size, rank=pm.data_parallel_rank)",
                (other, rank),
            )
        raise DataMismatchError(
            f"ranks {other} and {rank} have data-parallel rank {dp_rank} but passed different rows: under "
            f"batch='per_rank' the ranks of one data-parallel rank (data_parallel_size {layout.size}, the mesh axes "
            f"{list(layout.axes)} split the batch) pass the same rows. Build the sampler with "
            "DistributedSampler(num_replicas=pm.data_parallel_size, rank=pm.data_parallel_rank), not the world rank",
            (other, rank),
        )


def _check_same_shapes(rows: list[list[float]]) -> None:
    differ = [rank for rank, row in enumerate(rows) if row[9] != rows[0][9]]
    if differ:
        raise InputError(
            f"ranks 0 and {differ[0]} passed inputs of different shapes (or other values of an argument that is not "
            "a tensor): every rank must pass inputs of the same shapes and the same such values in each call "
            "(under batch='per_rank', the same number of rows: DistributedSampler pads the last batch so that each "
            "rank gets as many), since a new shape is planned by all ranks together"
        )


def _check_same_random(rows: list[list[float]], random: RandomOps) -> None:
    first: dict[int, int] = {}
    for rank, row in enumerate(rows):
        other = first.setdefault(int(row[5]), rank)
        if row[6] == rows[other][6]:
            continue
        nodes = ", ".join(random.nodes[:3]) + (f" and {len(random.nodes) - 3} more" if len(random.nodes) > 3 else "")
        raise ModelError(
            f"ranks {other} and {rank} draw different random numbers (their torch random generators are not in step: "
            "seeded differently, or they drew different counts since), but this plan draws random numbers "
            f"({nodes}) for tensors that both hold whole (replicated on mesh axes {list(random.axes)}), so their "
            "copies would differ and the step would be wrong without an error. Seed every rank alike before "
            "the first call (torch.manual_seed(seed), not seed + rank), and give per-rank randomness such as "
            "data augmentation a torch.Generator of its own"
        )
