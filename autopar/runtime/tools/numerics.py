"""The numerics guard: run a plan's rewritten graph for every rank in one process, against eager.

``check_numerics(model, plan, ...)`` traces ``model`` once, then runs the plan's passes and the
rewritten module of every rank of the mesh in threads of this process, over torch's threaded
process group (every collective moves real data between the threads). It compares

- the value of every planned node, reassembled from the ranks' local values under the node's
  output spec (Shard: concatenated, Partial: summed, Replicate: equal on every rank), with the
  same node of the traced graph run whole: the first node that differs is named;
- the loss and every parameter gradient with eager PyTorch.

No process group, spawn or device is needed, so tests, ``autopar check --numerics`` and the zoo
use it on any machine. Pipelined plans and plans that offload are not covered (they need the
pipeline runtime's point-to-point sends or an offload store): they are refused with a ValueError.
"""

from __future__ import annotations

import copy
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree

from autopar.errors import ConfigError, UsageError
from autopar.ir.options import CommOptions
from autopar.ir.plan import Plan
from autopar.passes import check_plan_matches, default_passes, run_passes
from autopar.rules.simulate import assemble
from autopar.runtime.module import ParallelModule, mesh_groups
from autopar.trace import TracedModel, trace

__all__ = ["NumericsResult", "check_numerics", "run_ranks_in_threads"]


@dataclass(frozen=True, slots=True)
class NodeDiff:
    node: str
    op: str
    rel_diff: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class NumericsResult:
    mesh_shape: tuple[int, ...]
    num_nodes: int  # planned nodes compared
    loss: tuple[float, float] | None  # (plan, eager)
    grad_rel: dict[str, float]  # FQN -> relative max difference against eager
    first_bad: NodeDiff | None
    tolerance: float
    bad_nodes: tuple[NodeDiff, ...] = field(default_factory=tuple)

    @property
    def max_grad_rel(self) -> float:
        return max(self.grad_rel.values(), default=0.0)

    @property
    def loss_rel(self) -> float:
        if self.loss is None:
            return 0.0
        got, want = self.loss
        return abs(got - want) / max(abs(want), 1e-30)

    @property
    def ok(self) -> bool:
        return self.first_bad is None and self.loss_rel <= self.tolerance and self.max_grad_rel <= self.tolerance

    def text(self) -> str:
        head = f"mesh {self.mesh_shape}: {self.num_nodes} nodes compared with eager"
        loss = "" if self.loss is None else f"; loss {self.loss[0]:.6g} vs eager {self.loss[1]:.6g}"
        if self.grad_rel:
            worst = max(self.grad_rel, key=self.grad_rel.get)
            grads = f"; largest gradient difference {self.grad_rel[worst]:.2e} ({worst})"
        else:
            grads = ""
        if self.ok:
            return f"OK: {head}{loss}{grads}"
        where = ""
        if self.first_bad is not None:
            where = (
                f"\n  first node that differs: {self.first_bad.node} ({self.first_bad.op}), "
                f"relative difference {self.first_bad.rel_diff:.2e}{self.first_bad.detail}"
            )
        return f"MISMATCH: {head}{loss}{grads}{where}"


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (exact equality for integer and bool tensors: 0 or inf)."""
    if got.shape != want.shape:
        return math.inf
    if not (want.is_floating_point() or want.is_complex()):
        return 0.0 if torch.equal(got, want) else math.inf
    got, want = got.detach().double(), want.detach().double()
    if not torch.isfinite(want).all():
        same = torch.equal(torch.isnan(got), torch.isnan(want)) and torch.allclose(got, want, equal_nan=True)
        return 0.0 if same else math.inf
    scale = want.abs().max().item() if want.numel() else 0.0
    error = (got - want).abs().max().item() if want.numel() else 0.0
    return error / scale if scale > 0 else error


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps the first tensor output of the named nodes (detached clones)."""

    def __init__(self, gm: torch.fx.GraphModule, names: set[str]):
        super().__init__(gm)
        self.names = names
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        if node.name in self.names:
            first = result[0] if isinstance(result, (list, tuple)) and result else result
            if isinstance(first, torch.Tensor):
                self.values[node.name] = first.detach().clone()
        return result


def run_ranks_in_threads(world_size: int, fn, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """``fn(rank, *args)`` for every rank, each in a thread of this process with its own
    ``threaded`` process group (torch's in-process backend: collectives move real data between
    the threads). Results in rank order; the first failure is raised with its rank."""
    from torch.testing._internal.distributed import multi_threaded_pg as threaded

    if dist.is_initialized():
        raise UsageError("the numerics guard runs its own in-process ranks: call it outside a process group")
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = threaded._install_threaded_pg()
    threaded.ProcessLocalGroup.reset()
    store = dist.HashStore()
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}

    def run(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = fn(rank, *args)
        except BaseException as error:  # noqa: BLE001 - reported to the caller below
            errors[rank] = error
            threaded.ProcessLocalGroup.exception_handle(error)  # wake the ranks waiting on it
        finally:
            if dist.distributed_c10d._world is world and dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=run, args=(rank,), name=f"autopar-rank-{rank}") for rank in range(world_size)]
    # mesh_groups warns that it cannot read the default group's timeout, which the threaded
    # backend does not keep; the threads are joined with timeout_s instead.
    quiet = _DropTimeoutWarning()
    logging.getLogger("autopar").addFilter(quiet)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s)
        if any(thread.is_alive() for thread in threads):
            threaded.ProcessLocalGroup.exception_handle(TimeoutError())
            raise TimeoutError(f"the in-process ranks did not finish in {timeout_s} s")
    finally:
        logging.getLogger("autopar").removeFilter(quiet)
        threaded._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threaded.ProcessLocalGroup.reset()
    if errors:
        first = min(errors)
        # A rank woken by another's failure raises SystemExit; report the real cause.
        real = [r for r in sorted(errors) if not isinstance(errors[r], SystemExit)] or [first]
        raise RuntimeError(f"rank {real[0]} of {world_size} failed: {errors[real[0]]!r}") from errors[real[0]]
    return results


class _DropTimeoutWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "timeout" not in record.getMessage()


def _rank_run(rank: int, model, traced: TracedModel, plan: Plan, inputs, kwargs, names: set[str]) -> dict:
    groups, coordinate = mesh_groups(plan.mesh_shape)
    fqns = {gi.name: traced.ties.get(gi.fqn, gi.fqn) for gi in traced.inputs if gi.kind == "param"}
    comm = CommOptions().with_plan(plan.kept_layers)  # the schedule compile runs the plan under
    gm = run_passes(copy.deepcopy(traced.gm), plan, default_passes(groups, None, fqns, comm))
    pm = ParallelModule(model, traced, gm, plan, groups, coordinate)
    recorder = _Recorder(pm.graph_module, names)
    pm.graph_module.forward = recorder.run  # the module calls its graph through forward
    output = pm(*inputs, **kwargs)
    loss = _loss_of(output)
    if loss is not None and loss.requires_grad:
        loss.backward()
    grads = {fqn: g for fqn, g in pm.full_grads().items() if g is not None} if loss is not None else {}
    return {"coordinate": coordinate, "values": recorder.values, "loss": None if loss is None else loss.item(), "grads": grads}


def _loss_of(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    return leaves[0] if leaves and leaves[0].numel() == 1 else None


def _eager_values(traced: TracedModel, model: torch.nn.Module, inputs, kwargs, names: set[str]) -> dict:
    flat = pytree.tree_leaves((inputs, kwargs))
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(dict(model.named_buffers(remove_duplicate=False)))
    user = iter(flat)
    values = []
    for gi in traced.inputs:
        if gi.kind in ("param", "buffer"):
            values.append(state[gi.fqn].detach().clone())
        elif gi.kind == "constant":
            values.append(traced.constants[gi.name])
        else:
            values.append(next(user))
    recorder = _Recorder(traced.gm, names)
    with torch.no_grad():
        recorder.run(*values)
    return recorder.values


def _check_runs(plan: Plan) -> None:
    """The plans the guard runs: one stage, nothing offloaded, fp32 (a ConfigError with the fix otherwise)."""
    if plan.pipeline is not None:
        raise ConfigError(
            "the numerics guard runs one-stage plans; a pipelined plan needs the pipeline runtime: check the same "
            "model planned with pipeline='off'"
        )
    if plan.memory is not None and (plan.memory.offload or plan.memory.offload_activations):
        raise ConfigError(
            "the numerics guard does not run plans that offload (they need an offload store): check the same "
            "model planned with offload='off'"
        )
    if plan.precision is not None and plan.precision.param_dtype is not None:
        raise ConfigError(
            f"the numerics guard compares with fp32 eager at 1e-4, and this plan runs precision="
            f"{plan.precision.name!r}: check the same sharding planned with precision='32-true'"
        )


def check_numerics(
    model: torch.nn.Module,
    plan: Plan,
    example_inputs: tuple[Any, ...] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    tolerance: float = 1e-4,
    timeout_s: float = 300.0,
) -> NumericsResult:
    """Run ``plan`` on every rank of its mesh in this process and compare with eager ``model``.

    ``model`` holds real tensors and is left as it is (copies run). The example inputs must be
    those the plan was made for (their shapes). Returns a ``NumericsResult``; ``.ok`` is False
    when the loss, a gradient or a planned node's value differs from eager by more than
    ``tolerance`` (relative to the largest magnitude of the eager value).
    """
    _check_runs(plan)
    example_kwargs = dict(example_kwargs or {})
    traced = trace(model, example_inputs, example_kwargs)
    check_plan_matches(plan, traced, plan.mesh_shape)
    names = {name for name, node in plan.nodes.items() if node.op not in ("param", "buffer", "constant", "user")}
    names &= {n.name for n in traced.gm.graph.nodes if n.op == "call_function"} - _undefined_nodes(traced.gm)
    eager_model = copy.deepcopy(model)
    want_values = _eager_values(traced, eager_model, example_inputs, example_kwargs, names)
    eager_out = eager_model(*example_inputs, **example_kwargs)
    want_loss = _loss_of(eager_out)
    if want_loss is not None and want_loss.requires_grad:
        want_loss.backward()
    world = math.prod(plan.mesh_shape)
    models = [copy.deepcopy(model) for _ in range(world)]
    ranks = run_ranks_in_threads(
        world,
        lambda rank: _rank_run(rank, models[rank], traced, plan, example_inputs, example_kwargs, names),
        timeout_s=timeout_s,
    )
    bad = []
    for node in traced.gm.graph.nodes:
        if node.name not in want_values or any(node.name not in r["values"] for r in ranks):
            continue
        spec = plan.nodes[node.name].outs[0] if plan.nodes[node.name].outs else None
        if spec is None:
            continue
        pieces = {tuple(r["coordinate"]): r["values"][node.name] for r in ranks}
        want = want_values[node.name]
        try:
            got = assemble(pieces, spec, plan.mesh_shape, atol=tolerance * max(1.0, _scale(want)))
            diff, detail = rel_diff(got, want), ""
        except AssertionError as error:
            diff, detail = math.inf, f" ({error})"
        except RuntimeError as error:  # local shapes that cannot be put together
            diff, detail = math.inf, f" (cannot reassemble: {error})"
        if diff > tolerance:
            bad.append(NodeDiff(node.name, str(node.target), diff, detail))
    grad_rel = {}
    eager_grads = {fqn: p.grad for fqn, p in eager_model.named_parameters(remove_duplicate=False) if p.grad is not None}
    scale = max((_scale(g) for g in eager_grads.values()), default=0.0)
    for fqn, want in eager_grads.items():
        if _scale(want) < 1e-6 * scale:
            # Zero in exact arithmetic (an attention key bias: softmax ignores a constant added
            # to every score): both runs hold rounding noise, whose relative error means nothing.
            continue
        got = ranks[0]["grads"].get(fqn)
        grad_rel[fqn] = math.inf if got is None else rel_diff(got, want)
    loss = None if want_loss is None or ranks[0]["loss"] is None else (ranks[0]["loss"], want_loss.item())
    return NumericsResult(
        tuple(plan.mesh_shape), len(want_values), loss, grad_rel, bad[0] if bad else None, tolerance, tuple(bad)
    )


# Ops whose values are not a function of their inputs: uninitialized memory (what a later
# write fills) and random draws. Their consumers are compared as usual.
_UNDEFINED_VALUE_OPS = (
    "empty",
    "empty_like",
    "new_empty",
    "empty_strided",
    "empty_permuted",
    "rand",
    "randn",
    "rand_like",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "bernoulli",
    "native_dropout",
    "dropout",
    "normal",
    "uniform",
    "multinomial",
)


def _undefined_values(node: torch.fx.Node) -> bool:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target.overloadpacket.__name__.rstrip("_") in _UNDEFINED_VALUE_OPS


def _undefined_nodes(gm: torch.fx.GraphModule) -> set[str]:
    """Nodes whose values need not agree with eager: those ops, what is computed from one of them
    alone (a slice of an uninitialized buffer), partial writes into one, and nodes nothing uses
    (functionalization leaves dead views behind). Their consumers are compared as usual."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        base = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if (
            _undefined_values(node)
            or not node.users
            or (len(inputs) == 1 and inputs[0].name in found)
            or (node.target in _SCATTERS and base is not None and base.name in found)
        ):
            found.add(node.name)
    return found


# Writes into part of a tensor: where the tensor was uninitialized, so is the part not written
# (a buffer filled by several slice_scatters holds undefined values until the last one).
_SCATTERS = {
    torch.ops.aten.slice_scatter.default,
    torch.ops.aten.select_scatter.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten.scatter.src,
    torch.ops.aten.scatter.value,
    torch.ops.aten.index_copy.default,
}


def _scale(tensor: torch.Tensor) -> float:
    if not (tensor.is_floating_point() or tensor.is_complex()) or not tensor.numel():
        return 1.0
    return float(tensor.detach().abs().max().double())
