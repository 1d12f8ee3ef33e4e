"""The prices of one op's strategies: compute (roofline), gradient all-reduces, the collectives
of kernels that run their own, output memory and parameter reductions (``price_strategies``,
which ``choices`` calls once per distinct op), with the impossible and dominated strategies cut
(``pruning``). ``choices`` builds the graph of them; the reports (``solver.pricing``) and the
rewrite (``passes``) ask the same functions, so that every layer reads the same numbers."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from autopar.cost import comm, compute, memory
from autopar.cost.cluster import ClusterSpec
from autopar.ir import context
from autopar.ir.spec import Spec, local_shape, replicated_axes
from autopar.rules import node_strategies
from autopar.rules.moe import EXPERT_PARALLEL_KERNELS
from autopar.rules.registry import Strategy
from autopar.solver.problem import pruning
from autopar.solver.problem.edges import flatten
from autopar.solver.problem.priced import PricedStrategy, PriceTable
from autopar.trace.moe import EXPERTS_OP

if TYPE_CHECKING:
    from autopar.solver.problem.choices import Choice


def grad_sync_cost(
    arg, spec: Spec, axis: int, is_param: bool, mesh_shape, cluster, dtype: torch.dtype | None = None
) -> comm.CommCost:
    """The backward all-reduce of an input's gradient on ``axis``, one per use, latency included
    (``compute_s`` carries it, for activations and parameters alike).

    The runtime reduces a parameter's gradient once per parameter, in buckets
    (``passes.schedule``). The ILP prices that: it takes these per-use terms of parameters back
    out of the objective and charges each (parameter, axis, held spec) once, at the bucketed
    price (``PricedStrategy.param_syncs``, ``ilp.ShardingILP.add_param_sync_variables``);
    ``solver.pricing.comm_schedule`` prices the solved plan's buckets and their overlap with backward.
    ``is_param`` marks the parameter terms (``PricedStrategy.param_sync_s``); ``dtype`` is the
    reduction's, where a precision policy sets one (else the argument's)."""
    return comm.grad_allreduce_cost(arg.shape, spec, axis, dtype or arg.dtype, mesh_shape, cluster)


def price_strategies(
    info, val, choices, input_nodes, mesh_shape, cluster, needs_grad, sync_dtypes, reachable, extra=()
) -> tuple[PriceTable, tuple[int, int, int]]:
    """Every possible strategy of one op with its prices, dominated ones cut (``solver.problem.pruning``),
    and the counts (enumerated, impossible, dominated). ``extra``: strategies offered beyond the
    rules' (a padded parameter's cast, ``padded_casts``)."""
    enumerated = node_strategies(info, mesh_shape) + list(extra)
    strategies = [enumerated[i] for i in pruning.feasible([s.ins for s in enumerated], reachable)]
    if not strategies:  # nothing the producers deliver: keep the rules' list, so the ILP says why
        strategies = enumerated
    priced = price_each(info, val, choices, input_nodes, mesh_shape, cluster, needs_grad, sync_dtypes, strategies)
    number = _by_identity(_numbering())  # interfaces compared by their specs' numbers: each spec hashed once
    keep = pruning.undominated(
        [
            (
                tuple(map(number, p.strategy.ins)),
                tuple(map(number, p.strategy.outs)),
                tuple(sorted((i, a) for i, a, _, _ in p.param_syncs)),
            )
            for p in priced
        ],
        [(p.compute_s, p.memory_bytes, p.grad_sync_bytes, p.param_sync_s, -p.backward_s) for p in priced],
    )
    if len(keep) < len(strategies):
        priced = priced.keep(keep)
    counts = (len(enumerated), len(enumerated) - len(strategies), len(strategies) - len(keep))
    return priced, counts


def price_each(info, val, choices, input_nodes, mesh_shape, cluster, needs_grad, sync_dtypes, strategies) -> PriceTable:
    """Each strategy's compute (roofline, gradient all-reduces, kernel collectives), output
    memory and parameter reductions. What depends on one spec (its replicated axes, a gradient
    all-reduce, an output's bytes) is priced once per spec object: the rules give an op's equal
    specs as one object (``registry.expand_rows``), and any other list is priced all the same."""
    priced = []
    replicated = _by_identity(replicated_axes)
    roofline = compute.roofline_terms_each(info, strategies, mesh_shape, cluster, needs_grad, replicated)
    grads = [
        (index, arg, choices[node.name].kind == "param")
        for index, (arg, node) in enumerate(zip(info.inputs, input_nodes))
        if choices[node.name].requires_grad
    ]
    sync_terms: dict[tuple, tuple] = {}  # (input, id(spec), axis) -> (its all-reduce, bucketed seconds or None)
    outputs = list(zip(range(len(info.out_shapes)), info.out_shapes, (out.dtype for out in flatten(val))))
    out_bytes_of: dict[tuple[int, int], int] = {}  # (output, id(spec)) -> local bytes
    for strategy, (flops_s, bytes_s, factor) in zip(strategies, roofline):
        seconds = max(flops_s, bytes_s) * factor
        backward_s = seconds * (factor - 1) / factor
        synced = param_synced_s = 0.0
        merged = []
        for index, arg, is_param in grads:
            spec = strategy.ins[index]
            for axis in grad_sync_axes(strategy, index, replicated):
                key = (index, id(spec), axis)
                terms = sync_terms.get(key)
                if terms is None:
                    terms = sync_terms[key] = _sync_terms(arg, spec, axis, is_param, mesh_shape, cluster, sync_dtypes[index])
                cost, bucketed_s = terms
                seconds += cost.backward_s
                if is_param:
                    param_synced_s += cost.backward_s
                if bucketed_s is not None:
                    merged.append((index, axis, cost.backward_s, bucketed_s))
                synced += cost.bytes_sent
        if strategy.kernel is not None:  # a plain strategy runs no collectives of its own
            kernel_s, kernel_bytes = comm.collectives_cost(
                kernel_collectives(info, strategy, mesh_shape, needs_grad), mesh_shape, cluster
            )
            seconds += kernel_s
            synced += sum(kernel_bytes.values())
        out_bytes = 0
        for index, shape, dtype in outputs:
            spec = strategy.outs[index]
            found = out_bytes_of.get((index, id(spec)))
            if found is None:
                found = out_bytes_of[(index, id(spec))] = memory.local_bytes(shape, dtype, spec, mesh_shape)
            out_bytes += found
        # By position, in the record's field order: keywords take twice as long, per strategy.
        priced.append(PricedStrategy(strategy, seconds, float(out_bytes), synced, param_synced_s, backward_s, tuple(merged)))
    return PriceTable(priced)


def _sync_terms(arg, spec: Spec, axis: int, is_param: bool, mesh_shape, cluster, sync_dtype) -> tuple:
    """An input's gradient all-reduce on ``axis`` (``grad_sync_cost``), and for a parameter's
    gradient, or that of its cast under a precision policy (which carries the reduction dtype),
    the seconds of its reduction once per parameter, in a bucket (None for others)."""
    cost = grad_sync_cost(arg, spec, axis, is_param, mesh_shape, cluster, sync_dtype)
    if not (is_param or sync_dtype is not None):
        return cost, None
    bucketed = comm.param_grad_sync_cost(arg.shape, spec, axis, sync_dtype or arg.dtype, mesh_shape, cluster)
    return cost, bucketed.backward_s


def _by_identity(function: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``function`` of one argument, computed once per argument object while the cache lives
    (the caller holds every argument it asks about, so no id is reused)."""
    found: dict[int, Any] = {}

    def cached(value: Any) -> Any:
        result = found.get(id(value), _MISSING)
        if result is _MISSING:
            result = found[id(value)] = function(value)
        return result

    return cached


_MISSING = object()


def _numbering() -> Callable[[Spec], int]:
    """Numbers specs by value, in order of first appearance."""
    numbers: dict[Spec, int] = {}
    return lambda spec: numbers.setdefault(spec, len(numbers))


def kernel_all_to_all_bytes(info, strategy: Strategy, mesh_shape: Sequence[int], needs_grad: bool) -> list[float]:
    """Sizes (local bytes) of the all-to-alls ``strategy``'s kernel runs on its axis in one
    forward and backward.

    ``moe_experts_all_to_all`` sends each of its T·k token copies (T: this rank's tokens) of H
    elements to the rank holding its expert, and the results back: two exchanges of T·k·H
    elements in forward, two in backward (the reverse exchanges of their gradients), plus the
    copies' expert ids (int64) and one count per rank in forward. Routing decides how many
    copies the busiest rank receives; they are priced at ``compute.CAPACITY_FACTOR`` times the
    mean, as the experts' compute is."""
    if strategy.kernel != "moe_experts_all_to_all":
        return []
    hidden, top_k_index = info.kw["hidden"], info.kw["top_k_index"]
    local_tokens = local_shape(hidden.shape, strategy.ins[0], mesh_shape)[0]
    copies = local_tokens * top_k_index.shape[1] * compute.CAPACITY_FACTOR
    rows = copies * hidden.shape[1] * info.kw["gate_up"].dtype.itemsize
    axis = strategy.kernel_axes[0]
    sizes = [8.0 * mesh_shape[axis], copies * 8.0, rows, rows]
    return sizes + [rows, rows] if needs_grad else sizes


def expert_parallel_record(choice: Choice, index: int, mesh_shape: Sequence[int], cluster: ClusterSpec) -> dict | None:
    """What the plan reports of a node whose strategy ``index`` splits experts (a kernel of
    ``rules.moe.EXPERT_PARALLEL_KERNELS``): the axes and degree, the experts each device holds,
    and the kernel's all-to-all seconds and bytes within the node's cost. None otherwise."""
    strategy = choice.strategies[index]
    if strategy.kernel not in EXPERT_PARALLEL_KERNELS or choice.info is None:
        return None
    weight = choice.info.inputs[3] if choice.info.target is EXPERTS_OP else choice.info.inputs[1]
    degree = math.prod(mesh_shape[axis] for axis in strategy.kernel_axes)
    exchange_s, per_axis = comm.collectives_cost(
        kernel_collectives(choice.info, strategy, mesh_shape, choice.requires_grad), mesh_shape, cluster
    )
    exchange_bytes = sum(per_axis.values())
    return {
        "node": choice.name,
        "kernel": strategy.kernel,
        "axes": list(strategy.kernel_axes),
        "degree": degree,
        "num_experts": weight.shape[0],
        "experts_per_device": weight.shape[0] // degree,
        "cost_s": choice.priced[index].compute_s,
        "all_to_all_s": exchange_s,
        "all_to_all_bytes": int(exchange_bytes),
        "capacity_factor": compute.CAPACITY_FACTOR,
    }


def kernel_collectives(info, strategy: Strategy, mesh_shape: Sequence[int], requires_grad: bool) -> list[tuple[str, float, int]]:
    """Collectives a kernel runs of its own, beyond the redistributions of its inputs and
    outputs (which the edges price), as ``(kind, bytes, axis)``: the context-parallel
    attention's K/V gathers, gradient reduce-scatters and head-tail row exchanges
    (``comm.context_parallel_collectives``), an expert-parallel kernel's all-to-alls
    (``kernel_all_to_all_bytes``), and the vocab-parallel cross entropy's one all-gather per
    axis of [2, rows] (each row's log-sum-exp and target logit, in float32; float64 logits:
    float64) in forward, with nothing in backward; the batch-split mean cross entropy's one
    all-reduce per axis of two float64 numbers (its loss sum and denominator), less the one that
    rides the data check (``rides_data_check``)."""
    if strategy.kernel == "cross_entropy_mean":
        rides = rides_data_check(strategy, mesh_shape)
        return [("all_reduce", 16, axis) for axis in strategy.kernel_axes[1 if rides else 0 :]]
    if strategy.kernel == "cross_entropy_vocab_split":
        logits = info.kw["self"]
        rows = local_shape(logits.shape, strategy.ins[logits.index], mesh_shape)[0]
        stats = 2 * rows * max(4, logits.dtype.itemsize)
        return [("all_gather", stats * mesh_shape[axis], axis) for axis in strategy.kernel_axes]
    if strategy.kernel != "sdpa_context_parallel":
        return [
            ("all_to_all", num_bytes, axis)
            for axis in strategy.kernel_axes
            for num_bytes in kernel_all_to_all_bytes(info, strategy, mesh_shape, requires_grad)
        ]
    q, k, v = (info.kw[name] for name in ("query", "key", "value"))
    specs = dict(zip(("query", "key", "value"), (strategy.ins[a.index] for a in (q, k, v))))
    kv_bytes = sum(memory.local_bytes(a.shape, a.dtype, specs[n], mesh_shape) for n, a in (("key", k), ("value", v)))
    q_bytes = memory.local_bytes(q.shape, q.dtype, specs["query"], mesh_shape)
    out_bytes = memory.local_bytes(info.out_shape, q.dtype, strategy.outs[0], mesh_shape)
    axes = strategy.kernel_axes
    balanced = context.is_balanced(q.shape[-2], tuple(mesh_shape[a] for a in axes))
    return comm.context_parallel_collectives(kv_bytes, q_bytes + out_bytes, axes, balanced, mesh_shape, requires_grad)


# False while pipelined plans are priced: a pipeline stage's data check settles before its
# first send or receive, so no all-reduce rides it (``runtime.pipeline``).
_RIDES: contextvars.ContextVar[bool] = contextvars.ContextVar("autopar_data_check_rides", default=True)


@contextlib.contextmanager
def pricing_without_rides():
    """Price every kernel all-reduce in full inside the ``with`` block (``rides_data_check``)."""
    token = _RIDES.set(False)
    try:
        yield
    finally:
        _RIDES.reset(token)


def pricing_for(cluster: ClusterSpec) -> contextlib.AbstractContextManager:
    """Prices as ``cluster``'s executor runs the graph: where inductor runs it, its collectives are
    the compiled code's own and the data check settles before it (``runtime.module``), so the
    loss's all-reduce rides nothing (``pricing_without_rides``); else as the context already says."""
    return pricing_without_rides() if cluster.executor == "inductor" else contextlib.nullcontext()


def rides_data_check(strategy: Strategy, mesh_shape: Sequence[int]) -> bool:
    """Whether the batch-split mean cross entropy's first all-reduce costs nothing: on a mesh
    with one axis of more than one rank (data parallel), where it is the forward's first
    collective, the runtime's data check (an all-gather of a fixed-size row per rank, paid on
    every call) carries its two numbers (``runtime.data``: ``_Check.ride``), so the forward makes
    one collective where it would make two. Priced per op, the ILP cannot see whether another
    collective comes first (an FSDP plan's parameter gathers, a gather of the logits): there the
    all-reduce runs apart, underpriced by one latency of a 16-byte all-reduce; a plan that would
    run a collective before the loss for it pays more than that anyway. Not in pipelined plans
    (``pricing_without_rides``)."""
    split = [axis for axis, size in enumerate(mesh_shape) if size > 1]
    return _RIDES.get() and len(split) == 1 and strategy.kernel_axes[:1] == (split[0],)


def grad_sync_bytes_per_axis(
    choice: Choice, index: int, choices: dict[str, Choice], mesh_shape: Sequence[int]
) -> dict[int, float]:
    """Bytes each device sends per mesh axis in the backward gradient all-reduces of strategy
    ``index`` of ``choice`` (what its ``PricedStrategy.grad_sync_bytes`` sums)."""
    per_axis: dict[int, float] = {}
    if choice.info is None:
        return per_axis
    strategy = choice.strategies[index]
    for position, arg in enumerate(choice.info.inputs):
        if not choices[choice.inputs[position][0]].requires_grad:
            continue
        for axis in grad_sync_axes(strategy, position):
            dtype = (choice.sync_dtypes[position] if choice.sync_dtypes else None) or arg.dtype
            local = memory.local_bytes(arg.shape, dtype, strategy.ins[position], mesh_shape)
            per_axis[axis] = per_axis.get(axis, 0.0) + comm.bytes_sent("all_reduce", local, mesh_shape[axis])
    for kind, num_bytes, axis in kernel_collectives(choice.info, strategy, mesh_shape, choice.requires_grad):
        per_axis[axis] = per_axis.get(axis, 0.0) + comm.bytes_sent(kind, num_bytes, mesh_shape[axis])
    return per_axis


def grad_sync_axes(strategy: Strategy, index: int, replicated: Callable[[Spec], int] = replicated_axes) -> list[int]:
    """Axes on which input ``index`` is replicated while the op's result is split.

    There every rank's local gradient for that input is only a partial sum, so it needs an
    all-reduce in backward (DDP's gradient all-reduce and Megatron's ``f`` are both this case).
    ``replicated``: ``spec.replicated_axes``, or a cache of it.
    """
    split_axes = 0
    for out in strategy.outs:
        split_axes |= ~replicated(out)
    axes_mask = replicated(strategy.ins[index]) & split_axes
    axes = []
    for axis in range(len(strategy.ins[index])):
        if axes_mask >> axis & 1 and (index, axis) not in strategy.whole_grad:
            axes.append(axis)
    return axes
