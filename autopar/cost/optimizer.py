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

The liveness walk already sizes every parameter, gradient and moment of a chosen sharding
(``cost.liveness``: the "param", "grad" and "optimizer_state" intervals), so the step is priced
from those intervals: what the memory model counts is what the optimizer moves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from autopar.cost.cluster import ClusterSpec
from autopar.cost.rates import OPTIMIZER_TRAFFIC
from autopar.errors import InternalError

IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
# Kernels the single-tensor AdamW launches per parameter (torch's ``_single_tensor_adamw`` and
# ``autopar.runtime.optim._adamw_update``): decay mul_, lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_.
KERNELS_PER_TENSOR = 8


def default_implementation(cluster: ClusterSpec) -> str:
    """What ``torch.optim.AdamW`` runs by default on ``cluster``'s devices: foreach on CUDA, the
    for-loop on host devices (a cluster without a host link, ``ClusterSpec.gloo``)."""
    return "for-loop" if cluster.gloo else "foreach"


def stepped_tensors(intervals: Iterable, bytes_of: Callable[[str], float]) -> list[float]:
    """``fused_bytes`` (module docstring) of each parameter the optimizer steps, from the liveness
    walk's intervals (``cost.liveness.Interval``): parameters that have a gradient."""
    param: dict[str, float] = {}
    grad: dict[str, float] = {}
    state: dict[str, float] = {}
    for iv in intervals:
        table = {"param": param, "grad": grad, "optimizer_state": state}.get(iv.kind)
        if table is not None:
            table[iv.node] = table.get(iv.node, 0.0) + iv.factor * bytes_of(iv.node)
    return [2 * param.get(node, 0.0) + size + 2 * state.get(node, 0.0) for node, size in grad.items()]


def adamw_step_s(
    fused_bytes: Sequence[float], cluster: ClusterSpec, implementation: str, mesh_shape: Sequence[int] = (1,)
) -> float:
    """Seconds of one AdamW step over tensors of ``fused_bytes`` each (module docstring), at a
    rank's share of its device on ``mesh_shape`` (``ClusterSpec.compute_share``)."""
    if implementation not in IMPLEMENTATIONS:
        raise InternalError(f"optimizer implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    rates = cluster.rates
    bandwidth = cluster.memory_bandwidth_bytes_per_s * (rates.memory_efficiency if rates is not None else 1.0)
    launch = rates.launch_overhead_s if rates is not None else 0.0
    share = cluster.compute_share(mesh_shape)
    if implementation == "for-loop":
        traffic = OPTIMIZER_TRAFFIC["foreach"]
        return sum(max(traffic * size / bandwidth, KERNELS_PER_TENSOR * launch) for size in fused_bytes) / share
    launches = len(fused_bytes) if implementation == "foreach" else 1
    return max(OPTIMIZER_TRAFFIC[implementation] * sum(fused_bytes) / bandwidth, launches * launch) / share


__all__ = ["IMPLEMENTATIONS", "KERNELS_PER_TENSOR", "default_implementation", "stepped_tensors", "adamw_step_s"]
