"""``PlanOptions`` as every planner reads them: the memory budget is resolved here, once."""

from __future__ import annotations

from autopar.cost.cluster import ClusterSpec, resolve_budget
from autopar.ir.options import PlanOptions


def memory_budget(options: PlanOptions, cluster: ClusterSpec) -> float | None:
    """The bytes per device that the sharding planner, the stage planner and Colossal-AI's
    layouts plan under: ``options.memory.budget``, where None is ``cluster``'s device memory less
    its reserve (``ClusterSpec.default_memory_budget``) and ``float("inf")`` is no budget (None)."""
    return resolve_budget(options.memory.budget, cluster)


__all__ = ["memory_budget"]
