"""The cost model: seconds and bytes for each strategy and each resharding.

* ``cluster``: ``ClusterSpec`` (devices, links) and ``get_cluster`` (presets in ``presets/``).
* ``comm``: alpha-beta collective costs per mesh axis and ``transition_cost`` of a resharding.
* ``compute``: roofline time of one op under one strategy (``measured``: timed on this device).
* ``memory``: tensor, shard and parameter-state bytes, and what backward keeps alive.
* ``liveness``: the peak-memory walk over forward and backward that the ILP constrains.
* ``allocator``, ``step_memory``: PyTorch's CUDA caching allocator, replayed over a step's
  allocations (what ``max_memory_allocated`` and ``max_memory_reserved`` would report).
* ``profile``: ``autopar profile``, which measures a machine into a ClusterSpec.
"""

from autopar.cost.cluster import ClusterSpec, LinkSpec, get_cluster, preset_names
from autopar.cost.comm import (
    CommCost,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    bytes_sent,
    grad_allreduce_cost,
    reduce_scatter_s,
    send_recv_s,
    transition_cost,
)
from autopar.cost.compute import compute_cost_s, node_bytes, node_flops
from autopar.cost.memory import (
    SAVES_INPUTS,
    local_bytes,
    param_state_bytes,
    saves_inputs,
    saves_output,
    tensor_bytes,
)

__all__ = [
    "ClusterSpec",
    "LinkSpec",
    "get_cluster",
    "preset_names",
    "CommCost",
    "all_reduce_s",
    "all_gather_s",
    "reduce_scatter_s",
    "all_to_all_s",
    "send_recv_s",
    "bytes_sent",
    "transition_cost",
    "grad_allreduce_cost",
    "node_flops",
    "node_bytes",
    "compute_cost_s",
    "tensor_bytes",
    "local_bytes",
    "param_state_bytes",
    "SAVES_INPUTS",
    "saves_inputs",
    "saves_output",
]
