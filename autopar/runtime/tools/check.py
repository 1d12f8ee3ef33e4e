"""``autopar check``: run a plan's rewritten module at full world size on one machine, offline.

A ``fake`` process group (``torch.testing._internal.distributed.fake_pg``) stands in for the
cluster: it accepts every collective at any world size and moves no data. The model runs on the
meta device, or (a model with real weights) under a FakeTensorMode, so nothing is computed
either. What is checked is what would
otherwise first fail on the cluster: the passes run for one rank's mesh coordinate, and its
forward goes through every inserted collective. At each step the local shapes must be what the
plan implies:

- every planned node's outputs have the local shape of its global shape under its output spec;
- every tensor a planned node takes has the local shape of its producer's global shape under
  the spec the node takes it in (so the collectives in between produced the right thing);
- every collective's output relates to its input as the collective says (all-gather multiplies
  the dimension by the group size, chunk and reduce-scatter divide it evenly, all-reduce keeps it).

A padded parameter shard (FSDP2's uneven ``Shard(0)``, ``ir.spec.padded_axis``) is the one tensor
whose pieces differ between ranks: each rank must hold its own rows of ``torch.chunk``'s cut, and
its gather is made as the runtime's scheduled gather makes it (``_padded``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree

from autopar.errors import MeshError, PlanError
from autopar.ir.options import PlanOptions
from autopar.ir.plan import Plan
from autopar.ir.spec import format_spec, local_shape, pad_piece, piece_shape
from autopar.ops import collectives
from autopar.passes import check_plan_matches, default_passes, run_passes
from autopar.runtime.module import ParallelModule, mesh_groups
from autopar.runtime.padded import check_padded_plan, padded_placeholders
from autopar.trace import trace

log = logging.getLogger("autopar")


@dataclass(frozen=True, slots=True)
class CheckResult:
    rank: int
    world_size: int
    coordinate: tuple[int, ...]
    num_nodes: int  # planned nodes whose shapes were checked
    num_inputs: int  # tensor inputs checked against the spec they are taken in
    num_collectives: int  # collectives run and checked
    mismatches: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def text(self) -> str:
        head = (
            f"rank {self.rank} of {self.world_size} (mesh coordinate {self.coordinate}): "
            f"{self.num_nodes} nodes, {self.num_inputs} inputs, {self.num_collectives} collectives checked"
        )
        if self.ok:
            return f"OK: {head}; every shape agrees with the plan"
        shown = "\n".join(f"  {m}" for m in self.mismatches[:20])
        more = f"\n  ... {len(self.mismatches) - 20} more" if len(self.mismatches) > 20 else ""
        return f"MISMATCH: {head}; {len(self.mismatches)} disagree:\n{shown}{more}"


_COLLECTIVES = {
    collectives.all_reduce: "all_reduce",
    collectives.all_gather: "all_gather",
    collectives.chunk: "chunk",
    collectives.reduce_scatter: "reduce_scatter",
    collectives.all_to_all: "all_to_all",
    collectives.allreduce_grad: "allreduce_grad",
}


def _group_name(args: tuple) -> str:
    """The process-group name among a collective's arguments (the only string; ``blocks`` of a
    strided shard may follow it)."""
    return next(a for a in args if isinstance(a, str))


def _expected_collective_shape(kind: str, args: tuple, shape: tuple[int, ...]) -> tuple[int, ...] | str:
    """The output shape ``kind`` must produce from an input of ``shape``, or why none exists."""
    size = collectives.group_size(_group_name(args))
    out = list(shape)
    if kind in ("all_reduce", "allreduce_grad"):
        return tuple(out)
    if kind == "all_gather":
        out[args[1]] *= size
        return tuple(out)
    if kind in ("chunk", "reduce_scatter"):
        dim = args[1]
        if out[dim] % size:
            return f"dim {dim} of size {out[dim]} does not split evenly over {size} ranks"
        out[dim] //= size
        return tuple(out)
    src_dim, dst_dim = args[1], args[2]  # all_to_all
    if out[dst_dim] % size:
        return f"dim {dst_dim} of size {out[dst_dim]} does not split evenly over {size} ranks"
    out[src_dim] *= size
    out[dst_dim] //= size
    return tuple(out)


class _ShapeChecker(torch.fx.Interpreter):
    """Runs the rewritten graph and compares every shape with the plan's."""

    def __init__(self, gm: torch.fx.GraphModule, plan: Plan, coordinate: tuple[int, ...], padded: _Padded):
        super().__init__(gm)
        self.plan = plan
        self.coordinate = coordinate
        self.gathers = padded.gathers
        self.pieces = padded.pieces
        self.mismatches: list[str] = []
        self.num_nodes = self.num_inputs = self.num_collectives = 0

    def run_node(self, node: torch.fx.Node) -> Any:
        decision = self.plan.nodes.get(node.name)
        if decision is not None and decision.inputs and node.op != "placeholder":
            self._check_inputs(node, decision)
        try:
            result = self._padded_gather(node) if node.name in self.gathers else super().run_node(node)
        except Exception as error:  # the op itself rejected the shapes it was given
            self.mismatches.append(f"{node.name}: raised {type(error).__name__}: {str(error).splitlines()[0]}")
            raise _Stop from error
        kind = _COLLECTIVES.get(node.target) if node.op == "call_function" else None
        if node.name in self.gathers:
            self.num_collectives += 1
        elif kind is not None:
            self._check_collective(node, kind, result)
        elif decision is not None and node.op != "output":
            self._check_outputs(node, decision, result)
        return result

    def _padded_gather(self, node: torch.fx.Node) -> torch.Tensor:
        """A padded shard's all-gather, as the runtime's scheduled gather makes it (``ops.buckets``):
        this rank's own rows (its placeholder checked them), padded to ``ceil(n / k)``, gathered, and
        cut back to ``n`` rows, which its users' inputs check."""
        size = self.gathers[node.name]
        args, kwargs = self.fetch_args_kwargs_from_env(node)
        k = collectives.group_size(_group_name(node.args))
        return node.target(pad_piece(args[0], 0, -(-size // k)), *args[1:], **kwargs)[:size]

    def _check_collective(self, node: torch.fx.Node, kind: str, result: torch.Tensor) -> None:
        self.num_collectives += 1
        source = self.env[node.args[0]]
        expected = _expected_collective_shape(kind, node.args, tuple(source.shape))
        if isinstance(expected, str) or tuple(result.shape) != expected:
            why = expected if isinstance(expected, str) else f"expected {expected}"
            self.mismatches.append(
                f"{node.name} ({kind} on group {_group_name(node.args)}): input {tuple(source.shape)}, "
                f"output {tuple(result.shape)}, {why}"
            )

    def _check_outputs(self, node: torch.fx.Node, decision, result: Any) -> None:
        tensors = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if len(tensors) != len(decision.outs):
            return  # a node whose outputs are not plain tensors (nothing planned to compare)
        self.num_nodes += 1
        for index, (tensor, spec, shape) in enumerate(zip(tensors, decision.outs, decision.shapes)):
            expected = self._held(node.name, shape, spec)
            if tuple(tensor.shape) != tuple(expected):
                self.mismatches.append(
                    f"{node.name} ({decision.op}) output {index}: local shape {tuple(tensor.shape)}, but global "
                    f"{tuple(shape)} under {format_spec(spec)} is {tuple(expected)}"
                )

    def _check_inputs(self, node: torch.fx.Node, decision) -> None:
        leaves = pytree.tree_leaves((node.args, node.kwargs))
        values = [self.env[leaf] for leaf in leaves if isinstance(leaf, torch.fx.Node)]
        tensors = [value for value in values if isinstance(value, torch.Tensor)]
        if len(tensors) != len(decision.inputs):
            return  # non-tensor fx values among the arguments: the order cannot be matched safely
        for index, (tensor, (producer, out_index), spec) in enumerate(zip(tensors, decision.inputs, decision.ins)):
            self.num_inputs += 1
            shape = self.plan.nodes[producer].shapes[out_index]
            expected = self._held(producer, shape, spec)
            if tuple(tensor.shape) != tuple(expected):
                self.mismatches.append(
                    f"{node.name} ({decision.op}) input {index} from {producer}: local shape {tuple(tensor.shape)}, "
                    f"but it is taken as {format_spec(spec)}, which is {tuple(expected)}"
                )

    def _held(self, name: str, shape, spec) -> tuple[int, ...]:
        """The local shape of node ``name``'s output of global ``shape`` held as ``spec``: the padded
        piece that collectives move, but this rank's own rows of a padded shard before its gather."""
        if name in self.pieces:
            return piece_shape(shape, spec, self.coordinate, self.plan.mesh_shape)
        return tuple(local_shape(shape, spec, self.plan.mesh_shape))


class _Padded(NamedTuple):
    """The plan's padded parameter shards in the rewritten graph (``_padded``)."""

    gathers: dict[str, int]  # each one's all-gather (node name) -> the parameter's rows
    pieces: frozenset[str]  # the nodes that hold a rank's own rows of one: its placeholder and casts


def _padded(gm: torch.fx.GraphModule, plan: Plan, traced, groups: tuple[str, ...]) -> _Padded:
    """Where ``gm`` gathers the plan's padded parameter shards (``ir.spec.padded_axis``). The runtime
    moves such a shard only by its scheduled gather on its padded axis
    (``ir.spec.padded_transition_ok``), which pads the pieces; the graph's plain gather of it (dim 0,
    that axis's group, of the parameter or a cast of it) stands for that one here."""
    padded = {name: (groups[axis], rows) for name, (_, axis, rows) in padded_placeholders(plan, traced).items()}
    origin = {name: name for name in padded}  # a node holding a rank's own rows -> its placeholder
    gathers = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or len(node.all_input_nodes) != 1 or node.all_input_nodes[0].name not in origin:
            continue
        source = origin[node.all_input_nodes[0].name]
        if node.target not in _COLLECTIVES:
            origin[node.name] = source  # a cast of the parameter (a precision policy's), or its alias
        elif node.target is collectives.all_gather and node.args[1] == 0 and _group_name(node.args) == padded[source][0]:
            gathers[node.name] = padded[source][1]
    return _Padded(gathers, frozenset(origin))


class _Stop(Exception):
    """A node raised; the mismatch is recorded and the run ends there."""


class _CheckingModule(torch.nn.Module):
    def __init__(self, checker: _ShapeChecker):
        super().__init__()
        self.checker = checker

    def forward(self, *values: Any) -> Any:
        return self.checker.run(*values)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """A ``fake`` default process group of ``world_size`` ranks, as rank ``rank``; destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise MeshError("autopar check makes its own fake process group: run it outside torch.distributed")
    if not 0 <= rank < world_size:
        raise MeshError(f"rank {rank} is not in a world of {world_size} ranks: pass 0 <= rank < {world_size}")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _is_meta(model: torch.nn.Module) -> bool:
    tensors = list(model.parameters()) + list(model.buffers())
    return bool(tensors) and all(t.is_meta for t in tensors)


@contextlib.contextmanager
def _no_compute(model: torch.nn.Module) -> Iterator[Any]:
    """Run without computing: meta tensors as they are, or real ones turned into FakeTensors."""
    if _is_meta(model):
        yield lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t


def check_plan(plan: Plan, model: torch.nn.Module, example_inputs: tuple, rank: int = 0) -> CheckResult:
    """Rewrite ``model`` by ``plan`` for ``rank`` of the plan's full world and run its forward on
    meta tensors under a fake process group, checking every shape against the plan."""
    if plan.pipeline is not None:
        raise PlanError(
            "autopar check does not check pipelined plans yet (their stages run under a pipeline schedule, "
            "which the fake process group cannot drive): run the plan on real ranks with autopar.compile"
        )
    # Trace the model as it was planned (tracing on another device can give another graph).
    inputs = tuple(example_inputs)
    traced = trace(model, inputs, None, plan.precision)
    check_plan_matches(plan, traced, tuple(plan.mesh_shape))
    check_padded_plan(plan, traced, PlanOptions(), None)  # what compile refuses of padded shards, refused here
    world_size = math.prod(plan.mesh_shape)
    with fake_world(world_size, rank):
        level = log.level
        log.setLevel(logging.ERROR)  # the fake group has no timeout to read; that is expected here
        try:
            groups, coordinate = mesh_groups(tuple(plan.mesh_shape))
        finally:
            log.setLevel(level)
        # The sharding is checked; checkpointing and offload (plan.memory) change no shape.
        sharding = dataclasses.replace(plan, memory=None)
        gm = run_passes(copy.deepcopy(traced.gm), sharding, default_passes(groups))
        module = ParallelModule(model, traced, gm, sharding, groups, coordinate)
        checker = _ShapeChecker(gm, plan, coordinate, _padded(gm, plan, traced, groups))
        module.graph_module = _CheckingModule(checker)
        with torch.no_grad(), contextlib.suppress(_Stop), _no_compute(model) as convert:
            module(*pytree.tree_map(convert, inputs))
    return CheckResult(
        rank, world_size, coordinate, checker.num_nodes, checker.num_inputs, checker.num_collectives, tuple(checker.mismatches)
    )


__all__ = ["CheckResult", "check_plan", "fake_world"]
