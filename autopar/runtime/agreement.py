"""Every rank runs the same plan: rank 0 solves it (or the caller gives it) and broadcasts it,
each rank checks it against its own graph, and the ranks compare its hash."""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from autopar.cost.cluster import ClusterSpec, get_cluster
from autopar.errors import AutoparError, PlanError
from autopar.ir.data import DataOptions
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan, validate_plan_json
from autopar.ops import collectives
from autopar.passes import check_plan_matches
from autopar.passes.plan_check import check_plan_strategies
from autopar.solver.planners.data import with_data_layout
from autopar.solver.planners.split_batch import split_batch_at_least
from autopar.solver.planners.traced import plan_traced
from autopar.trace import TracedModel


def resolve_plan(
    plan: Plan | None,
    traced: TracedModel,
    mesh_shape: tuple[int, ...],
    cluster: ClusterSpec | str | None,
    options: PlanOptions,
    forced: dict[str, Any] | None = None,
    data_axes: tuple[int, ...] | None = None,
    split_batch: bool = False,
) -> Plan:
    """This rank's plan for ``traced`` on ``mesh_shape``: ``plan`` where given (checked to be one
    the solver could make: it may be hand-edited), else the one rank 0 makes on ``cluster``
    under ``options`` (``solver.planners.traced.plan_traced``; ``forced`` and ``data_axes`` as
    there, ``split_batch``: at least split the batch, ``split_batch.split_batch_at_least``) and
    broadcasts. Either way, a plan made for this graph, torch and mesh."""
    if plan is None:
        # Rank 0 solves and broadcasts; the solve is deterministic, but eight identical solves
        # on one host would only compete for its cores. A failure is broadcast too, so that
        # every rank raises it now instead of waiting out the process-group timeout.
        payload: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                # ``traced`` is one microbatch where ``options`` pipeline
                made = plan_traced(traced, mesh_shape, get_cluster(cluster), options, forced, data_axes)
                if split_batch and not options.pipeline.enabled:
                    made = split_batch_at_least(
                        made, traced, lambda pins: plan_traced(traced, mesh_shape, get_cluster(cluster), options, pins)
                    )
                text = made.to_json()
                validate_plan_json(json.loads(text))  # once, here: every rank parses these same bytes
                payload[0] = ("plan", text)
            except Exception as error:
                payload[0] = ("error", error)
        collectives.call_on_world("plan broadcast", dist.broadcast_object_list, payload, src=0)
        kind, value = payload[0]
        if kind == "error":
            if dist.get_rank() == 0:
                raise value
            raise (
                type(value)(f"{value}\n(planned on rank 0)")
                if isinstance(value, AutoparError)
                else RuntimeError(f"planning failed on rank 0: {type(value).__name__}: {value}")
            )
        chosen = Plan.from_json(value, validate=False)  # checked on rank 0 before the broadcast
    else:
        chosen = plan
    check_plan_matches(chosen, traced, mesh_shape)
    if plan is not None and chosen.data_layout.per_rank:
        # the batched inputs and outputs as this autopar deals them (a plan saved before outputs
        # left as each rank's rows, or edited, would run them whole)
        chosen = with_data_layout(chosen, traced, DataOptions("per_rank"), axes=chosen.data_layout.axes)
    if plan is not None:  # the user's plan may be hand-edited: every choice one the solver could make
        check_plan_strategies(chosen, traced)
    return chosen


def check_rank_agreement(chosen: Plan) -> None:
    """Every rank must run the same plan; a mismatch is an error on every rank, not a hang."""
    hashes: list[Any] = [None] * dist.get_world_size()
    collectives.call_on_world("plan hash check", dist.all_gather_object, hashes, chosen.hash)
    if len(set(hashes)) > 1:
        groups: dict[str, list[int]] = {}
        for rank, value in enumerate(hashes):
            groups.setdefault(value, []).append(rank)
        detail = "; ".join(f"plan {h} on ranks {r}" for h, r in groups.items())
        raise PlanError(f"ranks hold different plans ({detail}): give every rank the same plan file and model")


__all__ = ["resolve_plan", "check_rank_agreement"]
