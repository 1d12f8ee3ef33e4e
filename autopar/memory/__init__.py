"""Activation checkpointing and offload, chosen by the planner when sharding alone does not fit
``memory_budget``: the decisions (``decisions``), the planner that prices and picks them
(``planner``), where offloaded tensors live (``store``) and the hooks that move them
(``offload``). The passes are in ``autopar.passes.memory``, the optimizer in ``autopar.optim``."""

from autopar.memory.decisions import CheckpointSegment, MemoryPlan, OffloadEntry

__all__ = ["CheckpointSegment", "MemoryPlan", "OffloadEntry"]
