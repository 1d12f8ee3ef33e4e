"""The optimizer step in the sharding ILP: each parameter's placement prices the step of its shard.

AdamW steps every parameter where it lives, so a parameter's placement decides the bytes its
step moves on each device: its local shard, its gradient and both moments (``cost.optimizer``:
``fused_bytes = 2·P + G + 2·S``, each the local bytes under the strategy times the factors of
the liveness walk's "param", "grad" and "optimizer_state" intervals: ZeRO's splits, the state's
dtype). The ILP's objective adds

    Σ_{n param} Σ_s o[n, s] · x[n, s],   o[n, s] = cost.optimizer.tensor_step_s(fused_bytes[n, s])

at the implementation the plan prices (``cost.optimizer.implementation``: the declared one, else
torch's default AdamW for the cluster). That is the
reported ``predicted.optimizer_s`` term by term (``cost.optimizer.adamw_step_s`` sums the same
``tensor_step_s``), but for the list kernels' floor (a launch per tensor, or one), which is the
same for every layout and is applied to the solved plan. The state's bytes are already in the
memory rows: the same intervals are alive all step.

Where any parameter is not replicated, the runtime holds every parameter as a DTensor, and each
op of the step pays DTensor's dispatch on the host (``cost.optimizer.dtensor_dispatch_s``): one
price D for the plan, not per parameter. The ILP carries it as a continuous d ∈ [0, 1],

    d ≥ Σ_{s not replicated} x[n, s]   for each parameter n   (``dtensor_params__<n>``),

and D · d in the objective (``ilp.ShardingILP.add_dtensor_variable``): d is 1 exactly when some
parameter is sharded. Clusters that have not measured ``ClusterSpec.dtensor_op_s`` have D = 0
and no d.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.cost import optimizer
from autopar.cost.cluster import ClusterSpec
from autopar.cost.liveness import Timeline
from autopar.ir.options import DEFAULT_OPTIMIZER

# fused_bytes counts the parameter and both moments twice (read and written), the gradient once.
_WEIGHTS = {"param": 2.0, "grad": 1.0, "optimizer_state": 2.0}


def step_prices(
    memory_bytes: Mapping[str, Sequence[float]],
    timeline: Timeline,
    cluster: ClusterSpec,
    mesh_shape: Sequence[int],
    stepper: str = DEFAULT_OPTIMIZER,
) -> dict[str, list[float]]:
    """o[n, s] for every parameter n the optimizer ``stepper`` (``PlanOptions.optimizer``) steps
    (one with a gradient interval), from ``memory_bytes`` (each node's local bytes per strategy,
    ``PricedStrategy.memory_bytes``)."""
    weight: dict[str, float] = {}
    stepped: set[str] = set()
    for iv in timeline.intervals:
        if iv.kind in _WEIGHTS:
            weight[iv.node] = weight.get(iv.node, 0.0) + _WEIGHTS[iv.kind] * iv.factor
            if iv.kind == "grad":
                stepped.add(iv.node)
    implementation = optimizer.implementation(cluster, stepper)
    return {
        node: [optimizer.tensor_step_s(weight[node] * size, cluster, implementation, mesh_shape) for size in sizes]
        for node, sizes in memory_bytes.items()
        if node in stepped
    }


def dtensor_price(timeline: Timeline, cluster: ClusterSpec, mesh_shape: Sequence[int]) -> float:
    """D: the seconds DTensor's dispatch adds to the step where the plan holds its parameters as
    DTensors (``cost.optimizer.dtensor_dispatch_s`` over the parameters the optimizer steps)."""
    stepped = {iv.node for iv in timeline.intervals if iv.kind == "grad"}
    return optimizer.dtensor_dispatch_s(len(stepped), cluster, mesh_shape)


__all__ = ["step_prices", "dtensor_price"]
