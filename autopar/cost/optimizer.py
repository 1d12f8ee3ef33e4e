"""The optimizer step in the predicted step: AdamW, priced from the bytes it reads and writes.

A training step ends with the optimizer: AdamW reads each parameter, its gradient and both moments
and writes the parameter and both moments back, memory-bound. Per device, over the parameters it
steps (a sharded parameter's local shard; ZeRO's share of the state and gradients), with ``P``,
``G`` and ``S`` the local bytes of a parameter, its gradient and both its moments:

    fused_bytes = 2·P + G + 2·S                       (the fused kernel's one pass)
    seconds     = Σ over tensor groups of max(traffic · fused_bytes / (bandwidth · memory_efficiency),
                                              launches · launch_overhead_s)

by implementation (``IMPLEMENTATIONS``):

* ``"fused"``: one kernel over every tensor, traffic 1 (``cost.rates.OPTIMIZER_TRAFFIC``);
* ``"foreach"`` (torch's default on CUDA): one list kernel per operation, each a whole pass over
  its tensors, traffic 21/7 (``cost.rates.OPTIMIZER_TRAFFIC``), and at least one launch per tensor;
* ``"for-loop"`` (torch's default off CUDA, and ``autopar.optim.AdamW``, which steps one
  parameter at a time where its state lives): the same passes, ``KERNELS_PER_TENSOR`` kernels per
  tensor, each tensor on its own (``max`` per tensor, summed).

Where a plan holds its parameters as DTensors (any one not replicated), each op of the step goes
through DTensor's dispatch on the host: ``dtensor_dispatch_s`` adds ``ClusterSpec.dtensor_op_s``
per op (``plan_step_s``).

The plan prices the optimizer the training loop declares (``PlanOptions.optimizer``: "adamw:fused"
runs the fused kind), else torch's default AdamW for the devices (``implementation``). Other
kinds (SGD, with or without momentum) are priced with AdamW's passes over their own bytes.

The liveness walk already sizes every parameter, gradient and moment of a chosen sharding
(``cost.liveness``: the "param", "grad" and "optimizer_state" intervals), so the step is priced
from those intervals: what the memory model counts is what the optimizer moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from autopar.cost.cluster import ClusterSpec
from autopar.cost.rates import OPTIMIZER_TRAFFIC
from autopar.errors import InternalError
from autopar.ir.options import DEFAULT_OPTIMIZER, OPTIMIZER_IMPLEMENTATIONS, parse_optimizer

IMPLEMENTATIONS = OPTIMIZER_IMPLEMENTATIONS
# Kernels the single-tensor AdamW launches per parameter (torch's ``_single_tensor_adamw`` and
# ``autopar.runtime.optim._adamw_update``): decay mul_, lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_.
KERNELS_PER_TENSOR = 8


def default_implementation(cluster: ClusterSpec) -> str:
    """What ``torch.optim.AdamW`` runs by default on ``cluster``'s devices: foreach on CUDA, the
    for-loop on host devices (a cluster without a host link, ``ClusterSpec.gloo``)."""
    return "for-loop" if cluster.gloo else "foreach"


def implementation(cluster: ClusterSpec, optimizer: str = DEFAULT_OPTIMIZER) -> str:
    """The implementation a plan prices ``optimizer`` (``PlanOptions.optimizer``) as running: the
    one it names ("adamw:fused"), else torch's default on ``cluster``'s devices."""
    return parse_optimizer(optimizer)[1] or default_implementation(cluster)


# Bytes torch's foreach Adam(W) holds while it steps, per byte of its state, by kind: one moment,
# ``_foreach_sqrt`` of every second moment (or, under amsgrad, of their running maximum) at once,
# freed when the step ends.
FOREACH_TEMPORARY = {"adam": 1 / 2, "adamw": 1 / 2, "adam-amsgrad": 1 / 3, "adamw-amsgrad": 1 / 3}


def step_temporary(cluster: ClusterSpec, optimizer: str = DEFAULT_OPTIMIZER) -> float:
    """Bytes ``optimizer`` (``PlanOptions.optimizer``) holds on ``cluster`` while it steps, beyond
    its state, per byte of state (the liveness walk's "optimizer_temporary" intervals): foreach
    Adam(W)'s ``FOREACH_TEMPORARY``; none for the fused kernel or the for-loop (one parameter's
    at a time), or an optimizer that updates its state in place."""
    kind = parse_optimizer(optimizer)[0]
    if kind in FOREACH_TEMPORARY and implementation(cluster, optimizer) == "foreach":
        return FOREACH_TEMPORARY[kind]
    return 0.0


def stepped_tensors(intervals: Iterable, bytes_of: Callable[[str], float]) -> list[float]:
    """``fused_bytes`` (module docstring) of each parameter the optimizer steps, from the liveness
    walk's intervals (``cost.liveness.Interval``): parameters that have a gradient."""
    return [fused for fused, _ in stepped_params(intervals, bytes_of).values()]


def stepped_params(intervals: Iterable, bytes_of: Callable[[str], float]) -> dict[str, tuple[float, float]]:
    """Per parameter the optimizer steps (one that has a gradient), its ``fused_bytes`` and its
    gradient's bytes, from the liveness walk's intervals as ``stepped_tensors``."""
    param: dict[str, float] = {}
    grad: dict[str, float] = {}
    state: dict[str, float] = {}
    for iv in intervals:
        table = {"param": param, "grad": grad, "optimizer_state": state}.get(iv.kind)
        if table is not None:
            table[iv.node] = table.get(iv.node, 0.0) + iv.factor * bytes_of(iv.node)
    return {node: (2 * param.get(node, 0.0) + size + 2 * state.get(node, 0.0), size) for node, size in grad.items()}


def tensor_step_s(fused_bytes: float, cluster: ClusterSpec, implementation: str, mesh_shape: Sequence[int] = (1,)) -> float:
    """The part of ``adamw_step_s`` that one tensor of ``fused_bytes`` adds on its own: its
    bandwidth term, and for the for-loop the floor of its own ``KERNELS_PER_TENSOR`` launches.
    The sharding ILP prices each parameter's placement with it (``solver.problem.optimizer_terms``):
    it is linear in the choice of one parameter, where the list kernels' floor
    (``list_kernels_floor_s``: a launch per tensor, or one) is the same for every layout."""
    return _unshared_s(fused_bytes, cluster, implementation) / cluster.compute_share(mesh_shape)


def adamw_step_s(
    fused_bytes: Sequence[float], cluster: ClusterSpec, implementation: str, mesh_shape: Sequence[int] = (1,)
) -> float:
    """Seconds of one AdamW step over tensors of ``fused_bytes`` each (module docstring), at a
    rank's share of its device on ``mesh_shape`` (``ClusterSpec.compute_share``): the sum of
    ``tensor_step_s``, and for the list kernels at least ``list_kernels_floor_s``."""
    share = cluster.compute_share(mesh_shape)
    if implementation == "for-loop":
        return sum(_unshared_s(size, cluster, implementation) for size in fused_bytes) / share
    # Σ over tensors of their bandwidth terms, summed as bytes first (one product, as before).
    terms = _unshared_s(sum(fused_bytes), cluster, implementation) / share
    return max(terms, list_kernels_floor_s(len(fused_bytes), cluster, implementation, mesh_shape))


def accumulate_s(grad_bytes: float, cluster: ClusterSpec, mesh_shape: Sequence[int] = (1,)) -> float:
    """Seconds to add one microbatch's gradient of ``grad_bytes`` into the step's sum (autograd's
    in-place add: the sum and the gradient read, the sum written), memory-bound at a rank's share
    of its device: what a pipeline pays per parameter in each microbatch but the first."""
    rates = cluster.rates
    bandwidth = cluster.memory_bandwidth_bytes_per_s * (rates.memory_efficiency if rates is not None else 1.0)
    return 3 * grad_bytes / bandwidth / cluster.compute_share(mesh_shape)


def list_kernels_floor_s(num_tensors: int, cluster: ClusterSpec, implementation: str, mesh_shape: Sequence[int] = (1,)) -> float:
    """The least time the fused or foreach kinds take over ``num_tensors`` tensors: one launch
    per tensor (foreach: each list op is launched per chunk of tensors) or one launch (fused);
    0 for the for-loop, whose floors are its tensors' own (``tensor_step_s``)."""
    _check(implementation)
    if implementation == "for-loop":
        return 0.0
    launch = cluster.rates.launch_overhead_s if cluster.rates is not None else 0.0
    launches = num_tensors if implementation == "foreach" else 1
    return launches * launch / cluster.compute_share(mesh_shape)


def holds_dtensors(param_specs: Iterable[Sequence]) -> bool:
    """Whether a plan with these parameter specs trains its parameters as DTensors: wherever one
    parameter is not replicated on every mesh axis (``runtime.module``: a plan that replicates
    every parameter keeps them plain, as DDP does)."""
    return any(not placement.is_replicate() for spec in param_specs for placement in spec)


def dtensor_dispatch_s(num_tensors: int, cluster: ClusterSpec, mesh_shape: Sequence[int] = (1,)) -> float:
    """Host seconds torch's AdamW adds when it steps ``num_tensors`` DTensor parameters: each of
    its ``KERNELS_PER_TENSOR`` ops per tensor goes through DTensor's dispatch
    (``ClusterSpec.dtensor_op_s``; measured for the for-loop kind on CPU ranks)."""
    return num_tensors * KERNELS_PER_TENSOR * cluster.dtensor_op_s / cluster.compute_share(mesh_shape)


def plan_step_s(
    fused_bytes: Sequence[float],
    cluster: ClusterSpec,
    mesh_shape: Sequence[int],
    dtensors: bool,
    optimizer: str = DEFAULT_OPTIMIZER,
) -> float:
    """A plan's ``predicted.optimizer_s``: ``optimizer`` as it runs on ``cluster``
    (``implementation``) over tensors of ``fused_bytes``, with DTensor's dispatch where the plan
    holds its parameters as DTensors."""
    step_s = adamw_step_s(fused_bytes, cluster, implementation(cluster, optimizer), mesh_shape)
    return step_s + dtensor_dispatch_s(len(fused_bytes), cluster, mesh_shape) if dtensors else step_s


def _unshared_s(fused_bytes: float, cluster: ClusterSpec, implementation: str) -> float:
    """One tensor's step on a whole device: memory-bound at the achieved bandwidth, and for the
    for-loop at least its own launches."""
    _check(implementation)
    rates = cluster.rates
    bandwidth = cluster.memory_bandwidth_bytes_per_s * (rates.memory_efficiency if rates is not None else 1.0)
    if implementation == "for-loop":
        launch = rates.launch_overhead_s if rates is not None else 0.0
        return max(OPTIMIZER_TRAFFIC["foreach"] * fused_bytes / bandwidth, KERNELS_PER_TENSOR * launch)
    return OPTIMIZER_TRAFFIC[implementation] * fused_bytes / bandwidth


def _check(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise InternalError(f"optimizer implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")


__all__ = [
    "IMPLEMENTATIONS",
    "KERNELS_PER_TENSOR",
    "default_implementation",
    "implementation",
    "FOREACH_TEMPORARY",
    "step_temporary",
    "stepped_tensors",
    "adamw_step_s",
    "tensor_step_s",
    "list_kernels_floor_s",
    "holds_dtensors",
    "dtensor_dispatch_s",
    "plan_step_s",
]
