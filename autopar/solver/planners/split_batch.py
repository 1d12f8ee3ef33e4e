"""A default that parallelizes: ``compile`` without ``cluster=`` splits the batch at least.

``compile`` without a cluster prices the machine it runs on; on a CPU host that is the "cpu-gloo"
preset, whose roofline compute (one core's peak) is far faster than eager's small ops reach,
while gloo's latency is measured. For a small model it then prices the whole batch on every rank
below data parallelism, and a multi-rank run would do every rank's work on every rank: each rank
then computes the global batch, and a DDP script's per-rank batch is refused. A user who starts
N ranks without naming a cluster asks for the work to be split, so the default keeps at least
the split of the batch: where the priced plan does not split it, the plan is solved again with
every activation that carries the batch pinned to ``Shard(0)`` on every mesh axis, and the plan
says so in one note. The solver still chooses the parameters' placements (replicated as DDP's,
or sharded). ``cluster=`` (any preset, spec or file) turns this off: the price decides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch.distributed.tensor import Shard

from autopar.ir.plan import Plan
from autopar.ir.spec import Spec, is_valid
from autopar.solver.planners.data import batch_reached, batched_inputs
from autopar.trace import TracedModel


def batch_pins(traced: TracedModel, mesh_shape: tuple[int, ...]) -> dict[str, Spec]:
    """Node name → ``Shard(0)`` on every axis, for each op output computed from a batched input
    whose dim 0 is a multiple of the batch (the batch itself, or the batch flattened with the
    dims after it, as ``view(-1, vocab)`` makes it) and divides evenly. Any such pin is correct
    (the runtime inserts what a consumer needs); it only makes the batch split."""
    inputs = batched_inputs(traced)
    if not inputs or math.prod(mesh_shape) == 1:
        return {}
    batch = next(iter(inputs.values()))[0]
    spec = tuple(Shard(0) for _ in mesh_shape)
    if not all(is_valid(shape, spec, mesh_shape) for shape in inputs.values()):
        return {}
    reached = batch_reached(traced, inputs)
    pins: dict[str, Spec] = {}
    for node in traced.gm.graph.nodes:
        if node.op != "call_function" or node.name not in reached:
            continue
        val = node.meta.get("val")
        if (
            isinstance(val, torch.Tensor)
            and val.dim()
            and val.shape[0] % batch == 0
            and is_valid(tuple(val.shape), spec, mesh_shape)
        ):
            pins[node.name] = spec
    return pins


def split_batch_at_least(made: Plan, traced: TracedModel, solve: Callable[[dict[str, Spec]], Plan]) -> Plan:
    """``made`` where it splits the batch (or cannot: one rank, no batched input, a batch that
    the mesh does not divide), else ``solve(pins)`` with the batch pinned (``batch_pins``),
    noting why. A pinned solve that fails keeps ``made``, with a note saying why."""
    mesh_shape = tuple(made.mesh_shape)
    if made.data_layout.size > 1 or made.pipeline is not None:
        return made
    pins = batch_pins(traced, mesh_shape)
    if not pins:
        return made
    try:
        split = solve(pins)
    except Exception as error:  # noqa: BLE001 - the priced plan still runs; say why it stands
        return _noted(made, f"the batch stays whole on every rank: pinning its split failed ({type(error).__name__}: {error})")
    whole_ms = made.predicted.step_time_s * 1e3
    split_ms = split.predicted.step_time_s * 1e3
    return _noted(
        split,
        f"batch split on mesh axes {split.data_layout.axes} because compile was given no cluster= (the "
        f"{made.cluster} preset prices the whole batch on every rank at {whole_ms:.3g} ms, this plan at "
        f"{split_ms:.3g} ms; pass cluster= to let the price decide)",
    )


def whole_batch_note(made: Plan, traced: TracedModel) -> Plan:
    """``made`` noting that every rank computes the whole batch, where it runs on several ranks
    and keeps a batch whole that the mesh could split: on a cluster whose links are slow for the
    model's size the price chooses that, which a user who started N ranks may not expect (``compile``
    without ``cluster=`` splits it at least: ``split_batch_at_least``)."""
    mesh_shape = tuple(made.mesh_shape)
    pins = batch_pins(traced, mesh_shape)
    if made.data_layout.size > 1 or made.pipeline is not None or not pins:
        return made
    inside = _split_inside(made, pins)
    if inside:  # the ops after the first split it (a sequence-split embedding, say): not the note below
        return _noted(
            made,
            f"the batch enters whole on every rank (data_parallel_size 1): its first ops take it whole, and the "
            f"plan splits it on mesh axes {inside} further in, so each rank loads the whole batch",
        )
    return _noted(
        made,
        f"every rank computes the whole batch: on the {made.cluster} preset this plan "
        f"({made.predicted.step_time_s * 1e3:.3g} ms a step) is priced below splitting it over the mesh "
        "(a small model, or slow links); autopar.compile without cluster= splits it at least",
    )


def _split_inside(made: Plan, pins: dict[str, Spec]) -> tuple[int, ...]:
    """The mesh axes (larger than 1) on which ``made`` splits some op output that carries the
    batch along dim 0 (a key of ``pins``, ``batch_pins``)."""
    axes = set()
    for name in pins:
        node = made.nodes.get(name)
        if node is not None and node.outs:
            axes.update(a for a, p in enumerate(node.outs[0]) if p == Shard(0) and made.mesh_shape[a] > 1)
    return tuple(sorted(axes))


def _noted(plan: Plan, note: str) -> Plan:
    return dataclasses.replace(plan, notes=(*plan.notes, note), stats=plan.stats)
