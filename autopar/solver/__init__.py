"""The solver: from a traced model, a mesh and a cluster to an ``ir.Plan``.

Laid out by role, each folder importing only from those below it (``pyproject.toml``):

- ``planners``: what plans are built with: the sharding planner (``solve``), the memory planner
  (checkpointing, offload), pipeline stages, mesh search, hand plans;
- ``pricing``: pricing a solved plan: the communication schedule, runner-ups for ``explain``,
  symbolic costs; ``strategies``: solving the ILP: LP rounding, the Lagrangian under a budget,
  the MILP backends;
- ``problem``: the choice graph (every node's strategies, priced) and the ILP built on it.
"""

from __future__ import annotations

from autopar.solver.planners.sharding import plan_from_solution, predicted_step_s, solve
from autopar.solver.problem.choices import build_choice_graph
from autopar.solver.problem.ilp import ShardingILP
from autopar.solver.search.backends import SOLVERS

__all__ = ["solve", "build_choice_graph", "ShardingILP", "plan_from_solution", "predicted_step_s", "SOLVERS"]
