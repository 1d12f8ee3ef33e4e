"""Carry out a precision policy that keeps master weights: reduce gradients in ``reduce_dtype``.

Under a policy that casts (``MixedPrecision.casts``: "bf16-mixed"), ``trace`` gives each
floating parameter placeholder (the master dtype, fp32) one ``_to_copy`` to ``param_dtype`` at its
first use, and ``insert_collectives`` puts the collectives of each use *after* that cast: the
gradient all-reduces (``allreduce_grad``) would then sum bf16 gradients, per use. These passes
move the reductions to the master side, where the schedule buckets them and the reduced
gradient reaches the master's ``.grad``:

- ``cast_after_collectives`` (before ``schedule_communication``): on every use of a parameter's
  cast, the chain of collectives between the cast and the op that reads it is re-rooted at the
  placeholder, and a cast of the chain's end feeds the op. Forward values are unchanged: every
  such collective (``allreduce_grad``, ``all_gather``, ``chunk``, ``all_to_all``) moves or keeps
  elements and commutes with an elementwise cast. In backward each gradient is cast up at the
  op's input, so reductions and the accumulation over uses run in the master dtype. The
  scheduled communication then sees the same placeholder → collectives patterns as without a
  policy. Where ``reduce_dtype`` (the cast's ``meta["autopar"]["reduce_dtype"]``, which the cost
  model prices) is not the master dtype (FSDP2's default: bf16 reductions of fp32 masters), each
  moved ``allreduce_grad`` is told so (``reduce_dtype=``): the schedule gives its parameter a
  bucket slot in that dtype (each gradient cast into it, the sum cast back into ``.grad``), and
  one left per use casts down, sums and casts back. Else the buckets reduce in the master dtype.
  No division follows the sum: each rank's gradient is already its share of the mean's (the
  loss's backward divides), so bf16, with fp32's exponent range, neither overflows nor
  underflows where fp32 would not (README, "Mixed precision").
- ``gather_in_param_dtype`` (after it): a parameter whose every use reads its scheduled gather
  through a cast to one dtype is gathered in that dtype instead (FSDP2's all-gather in
  ``param_dtype``: half the bytes of fp32, as the cost model prices it); its reduce-scatter slot
  stays in the master dtype. Casts of one tensor to one dtype are then merged into the first.
  In the compiled mode a parameter resharded after forward (``gather_param_resharded``) takes
  such a cast into its gather instead (after the all-gather, as before), so that backward
  recomputes the cast with the gather rather than keeping the cast parameter whole.

Parameters gathered by per-use collectives (``CommOptions(enabled=False)``, or uses the
schedule keeps apart) move their forward bytes in the master dtype.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.ir.plan import Plan
from autopar.ops import collectives
from autopar.ops.buckets import ParamGathers
from autopar.passes.schedule import PARAM_GATHERS, cast_dtype
from autopar.trace import is_param_cast

# Collectives that only move or keep elements in forward (so commute with a cast); allreduce_grad
# is the identity in forward.
_MOVES = (collectives.allreduce_grad, collectives.all_gather, collectives.chunk, collectives.all_to_all)


def _dtype_of(node: torch.fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is_move(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _MOVES


def cast_after_collectives(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Move each parameter cast past the collectives of each of its uses (module docstring).
    A traced cast left without uses stays as an alias of what it read, so that its name (where
    the plan's checkpoint segments may start) and its planned shape stay in the graph."""
    if plan.precision is None or not plan.precision.casts:
        return gm
    graph = gm.graph
    for cast in [n for n in graph.nodes if is_param_cast(n)]:
        (source,) = cast.all_input_nodes
        reduce_dtype = cast.meta["autopar"].get("reduce_dtype")
        for user in list(cast.users):
            chain = []
            node = user
            while _is_move(node) and len(node.users) == 1:
                chain.append(node)
                node = next(iter(node.users))
            if not chain:
                continue
            chain[0].replace_input_with(cast, source)
            if reduce_dtype not in (None, _dtype_of(source)):  # FSDP2's reduce_dtype: not the master's
                for sync in chain:
                    if sync.target is collectives.allreduce_grad:
                        sync.kwargs = {**sync.kwargs, "reduce_dtype": reduce_dtype}
            with graph.inserting_after(chain[-1]):
                moved = graph.call_function(cast.target, (chain[-1],), dict(cast.kwargs))
            moved.meta = {key: (dict(value) if key == "autopar" else value) for key, value in cast.meta.items()}
            chain[-1].replace_all_uses_with(moved, delete_user_cb=lambda use, moved=moved: use is not moved)
        if not cast.users:
            cast.target, cast.kwargs = torch.ops.aten.alias.default, {}
            cast.meta["val"] = source.meta.get("val")
    return gm


def gather_in_param_dtype(gm: torch.fx.GraphModule, plan: Plan) -> torch.fx.GraphModule:
    """Gather in ``param_dtype`` where every use of a scheduled gather casts to it; merge
    repeated casts of one tensor (module docstring). A cast the plan names (checkpoint segments
    may start at it) is not erased but made an alias of what replaces it."""
    if plan.precision is None or not plan.precision.casts:
        return gm
    graph = gm.graph

    def drop(cast: torch.fx.Node, keep: torch.fx.Node) -> None:
        if cast.name in plan.nodes:
            cast.target, cast.args, cast.kwargs = torch.ops.aten.alias.default, (keep,), {}
        else:
            cast.replace_all_uses_with(keep)
            graph.erase_node(cast)

    gathers = getattr(gm, PARAM_GATHERS, None)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is collectives.gather_param_resharded:
            dtype = cast_dtype(node)
            if dtype is not None:
                # the cast joins the gather's recomputation, so backward keeps neither
                casts = list(node.users)
                node.kwargs = {**node.kwargs, "param_dtype": dtype}
                node.meta["val"] = casts[0].meta["val"]
                for cast in casts:
                    drop(cast, node)
                continue
        if node.op == "call_module" and node.target == PARAM_GATHERS and isinstance(gathers, ParamGathers):
            dtype = cast_dtype(node)  # as ``schedule_communication`` grouped the gathers
            if dtype is not None:
                gathers.cast_to(node.kwargs["key"], dtype, node.args[0].meta["val"].dtype)
                for cast in list(node.users):
                    drop(cast, node)
                continue
        casts = [user for user in node.users if is_param_cast(user)]
        if len(casts) < 2:
            continue
        order = {n: i for i, n in enumerate(graph.nodes)}
        for dtype in {cast.kwargs.get("dtype") for cast in casts}:
            same = sorted((c for c in casts if c.kwargs.get("dtype") == dtype), key=order.__getitem__)
            for duplicate in same[1:]:
                drop(duplicate, same[0])
    return gm


__all__ = ["cast_after_collectives", "gather_in_param_dtype", "is_param_cast"]
