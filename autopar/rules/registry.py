"""The strategy registry: one rule function per op family, expanded over every mesh axis.

A rule looks at one op (an ``OpInfo``: shapes and normalized arguments) and returns ``Row``s for
*one* mesh axis: which placement each tensor input takes and which placement the output(s) get.
``node_strategies`` expands those rows over all mesh axes (a cartesian product), drops
combinations whose shards would be uneven, and returns full-mesh ``Strategy`` objects.

A row's local computation is the op itself applied to the local shards, with size arguments
rewritten to local sizes (``localize_kwargs``). When that is not enough (the mean over a sharded
dim, a loss whose denominator is global, batch-norm statistics over a sharded batch), the row
names a *kernel* from ``autopar.ops.kernels``: the op's semantics plus collectives over the axes on
which that row was chosen.

Where no rule is registered, ``autopar.rules.dtensor_adapter`` asks DTensor's own sharding
registry; where that fails too, the op is replicated on every axis and marked as a fallback.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard

from autopar.errors import InternalError
from autopar.ir.spec import Placement, Spec, axis_cut
from autopar.trace.attention import EXAMPLE_MASK

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class TensorArg:
    """A tensor argument of an op, as seen by a rule: its position among tensor inputs and shape."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What a rule may look at. ``kw`` holds every argument by schema name, tensors as TensorArg."""

    name: str
    target: Any
    kw: dict[str, Any]
    inputs: tuple[TensorArg, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_is_tuple: bool
    # "causal" for an attention call whose mask the example batch makes causal, which the runtime
    # then attends without (``trace.attention.causal_for_the_example``); None otherwise.
    example_mask: str | None = None

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.out_shapes[0]

    @property
    def out_ndim(self) -> int:
        return len(self.out_shapes[0])

    def describe(self) -> str:
        return f"{self.name} = {self.target}({', '.join(f'{k}={v}' for k, v in self.kw.items())})"


@dataclass(frozen=True, slots=True)
class Row:
    """One strategy on one mesh axis: a placement per tensor input, one per output, a kernel."""

    ins: tuple[Placement, ...]
    out: Placement | tuple[Placement, ...]
    kernel: str | None = None
    # Inputs (by index) that are replicated here and whose local gradient the computation
    # already makes whole, so they need no gradient all-reduce (see solver.problem.op_prices.grad_sync_axes).
    whole_grad: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for index in self.whole_grad:
            if not isinstance(self.ins[index], Replicate):
                raise InternalError(f"whole_grad names input {index}, which is not replicated in {self}")
        for placement in self.ins + self.outs:
            if isinstance(placement, Shard) and placement.dim < 0:
                raise InternalError(f"rows use non-negative dims, got {placement} in {self}")

    @property
    def outs(self) -> tuple[Placement, ...]:
        return self.out if isinstance(self.out, tuple) else (self.out,)


@dataclass(frozen=True, slots=True)
class Strategy:
    """A full-mesh choice for one node: a spec per tensor input, a spec per output, a kernel.

    ``kernel_axes`` are the mesh axes on which the row that named ``kernel`` was chosen; the
    kernel reduces over exactly those axes. ``source`` says where the strategy came from:
    ``rule``, ``dtensor`` or ``fallback`` (replicate everything).
    """

    ins: tuple[Spec, ...]
    outs: tuple[Spec, ...]
    kernel: str | None = None
    kernel_axes: tuple[int, ...] = ()
    source: str = "rule"
    whole_grad: tuple[tuple[int, int], ...] = ()  # (input index, mesh axis) pairs

    @property
    def out(self) -> Spec:
        return self.outs[0]


Rule = Callable[[OpInfo], list[Row]]
# Keyed by OpOverload, or by schema name ("transformers::grouped_mm_fallback") for an op that
# a library defines only once imported.
RULES: dict[Any, Rule] = {}
# Kernels that can run on one mesh axis only: strategies naming them on two axes are dropped.
SINGLE_AXIS_KERNELS: set[str] = set()

# Block counts for which rules offer strided shards (``spec.SS``). A strided shard only pays off
# where a split or chunk into that many equal parts consumes it (a fused q/k/v or gate/up
# projection), so the planner offers the counts that the graph's splits use (``split_blocks``),
# and nothing else, which keeps the strategy lists of other models as they were.
_STRIDED_BLOCKS: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("autopar_strided_blocks", default=())


def strided_blocks() -> tuple[int, ...]:
    """The block counts that rules offer strided shards for, in this planning context."""
    return _STRIDED_BLOCKS.get()


@contextlib.contextmanager
def offering_strided(blocks: Iterable[int]):
    """Let rules offer strided shards of these block counts inside the ``with`` block."""
    token = _STRIDED_BLOCKS.set(tuple(sorted(set(blocks))))
    try:
        yield
    finally:
        _STRIDED_BLOCKS.reset(token)


def split_blocks(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Numbers of equal parts of the graph's splits and chunks (a fused projection's split)."""
    found = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _EQUAL_SPLITS:
            continue
        values = node.meta.get("val")
        if not isinstance(values, (list, tuple)) or len(values) < 2:
            continue
        kw = normalized_kwargs(node)
        shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
        if len(shapes) == 1 and kw.get("dim") is not None:
            found.add(len(values))
    return tuple(sorted(found))


_EQUAL_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def register(*targets: Any) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule for each target. Registering a target twice is an error."""

    def wrap(fn: Rule) -> Rule:
        for target in targets:
            if target in RULES:
                raise InternalError(f"duplicate sharding rule for {target}: {RULES[target].__qualname__} and {fn.__qualname__}")
            RULES[target] = fn
        return fn

    return wrap


def replicate_row(info: OpInfo) -> Row:
    outs = tuple(Replicate() for _ in info.out_shapes)
    return Row(tuple(Replicate() for _ in info.inputs), outs if info.out_is_tuple or not outs else outs[0])


# Ops whose size argument must be rewritten to the local output shape after sharding.
SIZE_ARGS: dict[Any, str] = {
    aten.view.default: "size",
    aten._unsafe_view.default: "size",
    aten.reshape.default: "shape",
    aten.expand.default: "size",
    aten.new_zeros.default: "size",
    aten.new_ones.default: "size",
    aten.new_empty.default: "size",
    aten.new_full.default: "size",
    aten.zeros.default: "size",
    aten.ones.default: "size",
    aten.empty.memory_format: "size",
    aten.full.default: "size",
}


def localize_kwargs(target: Any, kw: dict[str, Any], local_out_shape: Sequence[int]) -> dict[str, Any]:
    """Rewrite global sizes in ``kw`` to the local output shape, for ops listed in SIZE_ARGS
    and for equal splits (whose first output's local size along the dim is the local part)."""
    name = SIZE_ARGS.get(target)
    if target in (aten.split.Tensor, aten.split_with_sizes.default):
        dim = kw["dim"] % len(local_out_shape)
        if target is aten.split.Tensor:
            return {**kw, "split_size": local_out_shape[dim]} if kw["split_size"] > local_out_shape[dim] else kw
        sizes = list(kw["split_sizes"])
        if len(set(sizes)) == 1 and sizes[0] > local_out_shape[dim]:
            return {**kw, "split_sizes": [local_out_shape[dim]] * len(sizes)}
        return kw
    if name is None:
        if target is aten.unflatten.int:
            dim = kw["dim"] % (len(local_out_shape) - len(kw["sizes"]) + 1)
            return {**kw, "sizes": list(local_out_shape[dim : dim + len(kw["sizes"])])}
        return kw
    return {**kw, name: list(local_out_shape)}


# Where no rule is registered, these are asked in turn (``dtensor_adapter`` adds DTensor's registry).
FALLBACK_RULES: list[Callable[[OpInfo], list[Row] | None]] = []


def node_strategies(info: OpInfo, mesh_shape: Sequence[int]) -> list[Strategy]:
    """All valid full-mesh strategies for one op. Never empty: falls back to replication."""
    rule = RULES.get(info.target) or RULES.get(_schema_name(info.target))
    rows: list[Row] | None = None
    source = "rule"
    if rule is not None:
        rows = rule(info)
    else:
        rows = next((rows for fallback in FALLBACK_RULES if (rows := fallback(info))), None)
        source = "dtensor"
    if not rows:
        return [fallback_strategy(info, len(mesh_shape))]
    strategies = expand_rows(info, rows, mesh_shape, source)
    if not strategies:
        return [fallback_strategy(info, len(mesh_shape))]
    return strategies


def _schema_name(target: Any) -> str | None:
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


def fallback_strategy(info: OpInfo, num_axes: int) -> Strategy:
    rep = (Replicate(),) * num_axes
    return Strategy(
        ins=tuple(rep for _ in info.inputs),
        outs=tuple(rep for _ in info.out_shapes),
        source="fallback",
    )


def expand_rows(info: OpInfo, rows: Iterable[Row], mesh_shape: Sequence[int], source: str = "rule") -> list[Strategy]:
    """Cartesian product of per-axis rows, keeping combinations with even shards everywhere
    (``spec.is_valid``), one kernel at most, and a single-axis kernel on one axis, in the
    product's order. The product is walked axis by axis and a prefix that already fails is not
    extended: a dim cut on several axes must divide by each of their sizes in turn
    (``spec.axis_cut`` per row and axis, computed once)."""
    rows = _dedupe(rows)
    for row in rows:
        if len(row.ins) != len(info.inputs) or len(row.outs) != len(info.out_shapes):
            raise InternalError(
                f"rule for {info.target} returned {row} with {len(row.ins)} inputs and "
                f"{len(row.outs)} outputs; the op has {len(info.inputs)} tensor inputs and "
                f"{len(info.out_shapes)} outputs ({info.describe()})"
            )
    # A mesh axis of size 1 carries only R (``spec.is_valid``): the op runs whole on it.
    rows.append(replicate_row(info))
    shapes = [arg.shape for arg in info.inputs] + list(info.out_shapes)
    cuts = {size: [_row_cuts(row, shapes, size) for row in rows] for size in set(mesh_shape)}
    whole = len(rows) - 1
    candidates = [[whole] if size == 1 else range(whole) for size in mesh_shape]
    combos = _valid_combos(rows, candidates, [cuts[size] for size in mesh_shape], [s for shape in shapes for s in shape])
    return _strategies(info, rows, combos, source)


def _row_cuts(row: Row, shapes: list[tuple[int, ...]], size: int) -> tuple | None:
    """What ``row`` does on one mesh axis of ``size`` (``spec.axis_cut`` of each placement): None
    where that alone is invalid, else the (position, size) of each dim it cuts, positions
    numbering the dims of every input and output in turn, and the masks of the positions it
    cuts and cuts strided."""
    cuts, cut_mask, strided_mask, offset = [], 0, 0, 0
    for shape, placement in zip(shapes, row.ins + row.outs):
        cut = axis_cut(shape, placement, size)
        if cut is None:
            return None
        if cut[0] >= 0:
            position = offset + cut[0]
            cuts.append((position, size))
            cut_mask |= 1 << position
            if cut[1]:
                strided_mask |= 1 << position
        offset += len(shape)
    return tuple(cuts), cut_mask, strided_mask


def _valid_combos(rows: list[Row], candidates: list, cuts: list[list], sizes: list[int]) -> list[tuple[int, ...]]:
    """The combinations (a row index per axis, from ``candidates``) that ``is_valid`` and the
    kernel rules keep, in ``itertools.product`` order: each prefix is extended by each row in
    turn. ``cuts[axis][row]``: ``_row_cuts``; ``sizes``: every dim's size, by position."""
    # A prefix: (row indices, each dim's size left to cut, cut mask, strided mask, kernel, axes running it)
    prefixes = [((), tuple(sizes), 0, 0, None, 0)]
    for axis, rows_here in enumerate(candidates):
        extended = []
        for combo, remaining, cut_mask, strided_mask, kernel, num_kernel in prefixes:
            for r in rows_here:
                found = cuts[axis][r]
                if found is None:
                    continue
                row_kernel = rows[r].kernel
                if row_kernel is not None:
                    if kernel is not None and row_kernel != kernel:
                        continue
                    if num_kernel and row_kernel in SINGLE_AXIS_KERNELS:
                        continue
                row_cuts, row_cut_mask, row_strided_mask = found
                if row_strided_mask & cut_mask or strided_mask & row_cut_mask:
                    continue  # a strided dim is cut on its one axis alone
                left = _divide(remaining, row_cuts) if row_cuts else remaining
                if left is None:
                    continue
                extended.append(
                    (
                        combo + (r,),
                        left,
                        cut_mask | row_cut_mask,
                        strided_mask | row_strided_mask,
                        kernel if row_kernel is None else row_kernel,
                        num_kernel + (row_kernel is not None),
                    )
                )
        prefixes = extended
    return [prefix[0] for prefix in prefixes]


def _divide(remaining: tuple[int, ...], cuts: tuple[tuple[int, int], ...]) -> tuple[int, ...] | None:
    """``remaining`` (each dim's size left to cut, by position) after ``cuts``; None where a
    size does not divide."""
    left = list(remaining)
    for position, size in cuts:
        if left[position] % size:
            return None
        left[position] //= size
    return tuple(left)


def _strategies(info: OpInfo, rows: list[Row], combos: list[tuple[int, ...]], source: str) -> list[Strategy]:
    """A ``Strategy`` per combination of rows (a row index per axis); rows of equal contents
    (one rule's ``out`` given as a placement and as a 1-tuple) give one strategy once. Equal
    specs are one object, and equal placements too (``_spec_numbers``): what prices an op's
    strategies can price each spec once, by identity."""
    first: dict[tuple, int] = {}
    same = [first.setdefault((row.ins, row.outs, row.kernel, row.whole_grad), r) for r, row in enumerate(rows)]
    # The last row (``expand_rows``'s replicated one) stands alone on its axes: it never meets another.
    seen: set[tuple] | None = set() if len(set(same[:-1])) < len(rows) - 1 else None
    placements, numbers = _spec_numbers(rows)
    specs: dict[tuple[int, ...], Spec] = {}
    num_ins, num_tensors = len(info.inputs), len(info.inputs) + len(info.out_shapes)
    any_whole_grad = any(row.whole_grad for row in rows)
    strategies: list[Strategy] = []
    for combo in combos:
        if seen is not None:
            key = tuple(same[r] for r in combo)
            if key in seen:
                continue
            seen.add(key)
        kernels = {rows[r].kernel for r in combo} - {None}
        kernel = kernels.pop() if kernels else None
        kernel_axes = tuple(a for a, r in enumerate(combo) if rows[r].kernel == kernel) if kernel else ()
        whole_grad = tuple((i, a) for a, r in enumerate(combo) for i in rows[r].whole_grad) if any_whole_grad else ()
        tensor_specs = []
        for tensor in range(num_tensors):
            key = tuple(map(numbers[tensor].__getitem__, combo))
            spec = specs.get(key)
            if spec is None:
                spec = specs[key] = tuple(map(placements.__getitem__, key))
            tensor_specs.append(spec)
        ins, outs = tuple(tensor_specs[:num_ins]), tuple(tensor_specs[num_ins:])
        strategies.append(Strategy(ins, outs, kernel, kernel_axes, source, whole_grad))
    return strategies


def _spec_numbers(rows: list[Row]) -> tuple[list[Placement], list[list[int]]]:
    """The distinct placements of ``rows`` (by type and value), and per tensor (inputs, then
    outputs) the number of each row's placement among them."""
    numbers: dict[tuple, int] = {}
    placements: list[Placement] = []
    by_row = []
    for row in rows:
        numbered = []
        for placement in row.ins + row.outs:
            number = numbers.setdefault((type(placement), placement), len(numbers))
            if number == len(placements):
                placements.append(placement)
            numbered.append(number)
        by_row.append(numbered)
    return placements, [list(column) for column in zip(*by_row)] if by_row else []


def _dedupe(rows: Iterable[Row]) -> list[Row]:
    out: list[Row] = []
    for row in rows:
        if row not in out:
            out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# Building an OpInfo from an fx node


def tensor_meta(value: Any) -> tuple[tuple[int, ...], torch.dtype] | None:
    if isinstance(value, torch.Tensor):
        return tuple(int(s) for s in value.shape), value.dtype
    return None


def normalized_kwargs(node: torch.fx.Node) -> dict[str, Any]:
    """Every argument of ``node`` by its schema name (positional ones included)."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        kw: dict[str, Any] = {}
        for i, arg in enumerate(schema.arguments):
            if i < len(node.args):
                kw[arg.name] = node.args[i]
            elif arg.name in node.kwargs:
                kw[arg.name] = node.kwargs[arg.name]
            elif arg.has_default_value():
                kw[arg.name] = arg.default_value
            else:
                kw[arg.name] = None
        return kw
    kw = {f"arg{i}": a for i, a in enumerate(node.args)}
    kw.update(node.kwargs)
    return kw


def op_info(node: torch.fx.Node) -> OpInfo:
    """The rule-facing view of a call_function node (shapes come from FakeTensor metadata)."""
    kw = {name: _to_value(value) for name, value in normalized_kwargs(node).items()}
    info = op_info_from_values(node.name, node.target, kw, node.meta.get("val"))
    example_mask = node.meta.get(EXAMPLE_MASK)
    return info if example_mask is None else dataclasses.replace(info, example_mask=example_mask)


# The recursive helpers below are module functions, not closures: a closure that calls itself
# is a reference cycle, left to the garbage collector's full passes, which planning holds off.
def _to_value(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return value.meta.get("val")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_value(v) for v in value)
    return value


def op_info_from_values(name: str, target: Any, kw_values: dict[str, Any], out_value: Any) -> OpInfo:
    """Build an OpInfo from argument values (real or fake tensors). Tensors become TensorArgs,
    numbered in the order they appear; every other argument is passed through unchanged."""
    inputs: list[TensorArg] = []
    kw = {key: _tensor_args(value, inputs) for key, value in kw_values.items()}
    if isinstance(out_value, (list, tuple)):
        out_shapes = tuple(tensor_meta(v)[0] for v in out_value if tensor_meta(v) is not None)
        out_is_tuple = True
    else:
        meta = tensor_meta(out_value)
        out_shapes = (meta[0],) if meta else ()
        out_is_tuple = False
    return OpInfo(name, target, kw, tuple(inputs), out_shapes, out_is_tuple)


def _tensor_args(value: Any, inputs: list[TensorArg]) -> Any:
    """``value`` with each tensor in it (nested lists and tuples) a ``TensorArg``, numbered in
    order and appended to ``inputs``."""
    meta = tensor_meta(value)
    if meta is not None:
        arg = TensorArg(len(inputs), *meta)
        inputs.append(arg)
        return arg
    if isinstance(value, (list, tuple)):
        return type(value)(_tensor_args(v, inputs) for v in value)
    return value


def replace_tensors(kw: dict[str, Any], tensors: Sequence[Any]) -> dict[str, Any]:
    """Put ``tensors`` (in TensorArg index order) back where the TensorArgs of ``kw`` stand."""

    def put(value: Any) -> Any:
        if isinstance(value, TensorArg):
            return tensors[value.index]
        if isinstance(value, (list, tuple)):
            return type(value)(put(v) for v in value)
        return value

    return {key: put(value) for key, value in kw.items()}


def call_with_kw(target: Any, kw: dict[str, Any]) -> Any:
    """Call an OpOverload with arguments given by schema name."""
    args, kwargs = [], {}
    for arg in target._schema.arguments:
        if arg.kwarg_only:
            kwargs[arg.name] = kw[arg.name]
        else:
            args.append(kw[arg.name])
    return target(*args, **kwargs)


def tensor_input_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The fx nodes feeding ``node``'s tensor inputs, in the same order as OpInfo.inputs."""
    found: list[torch.fx.Node] = []
    for value in normalized_kwargs(node).values():
        _tensor_nodes(value, found)
    return found


def _tensor_nodes(value: Any, found: list[torch.fx.Node]) -> None:
    """Append the nodes in ``value`` (nested lists and tuples) whose values are tensors to ``found``."""
    if isinstance(value, torch.fx.Node):
        if tensor_meta(value.meta.get("val")) is not None:
            found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensor_nodes(v, found)


__all__ = [
    "OpInfo",
    "Row",
    "Strategy",
    "TensorArg",
    "RULES",
    "SIZE_ARGS",
    "strided_blocks",
    "offering_strided",
    "split_blocks",
    "register",
    "replicate_row",
    "localize_kwargs",
    "node_strategies",
    "expand_rows",
    "fallback_strategy",
    "op_info",
    "tensor_input_nodes",
    "normalized_kwargs",
    "op_info_from_values",
    "replace_tensors",
    "call_with_kw",
]
