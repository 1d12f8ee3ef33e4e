"""The compiled mode (``autopar.compile(..., compiler="inductor")``): the rewritten graph run by
``torch.compile`` with inductor, forward and backward.

The graph's collectives are functional collectives inside autograd.Functions (``ops.collectives``),
so dynamo traces them and AOTAutograd keeps them as graph nodes in both the forward and the
backward graph; the communication schedule is in the graph (``passes.schedule.schedule_in_graph``)
and inductor buckets and reorders it (``passes.schedule.inductor_options``). Inductor's own caches
(its FX graph cache and autotuning cache, on by default) make a second compile of the same graph
fast. The first call compiles; its time is logged.

A module compiled without ``compiler`` schedules its parameter communication in autograd hooks
(``ops.buckets``) that dynamo cannot follow: a user's ``torch.compile`` of it runs its graph
outside dynamo (``run_eager``), so its numbers stay eager's, and says so once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from autopar.errors import ConfigError, UsageError
from autopar.ir.options import CommOptions
from autopar.ops import collectives
from autopar.passes.schedule import inductor_options, saved_tensors_hooks

log = logging.getLogger("autopar")

COMPILERS = (None, "inductor")


class _DropCheckpointNotice(logging.Filter):
    """Drops dynamo's notice that a checkpoint with a ``context_fn`` must hold no in-place op:
    the compiled mode's resharded gathers (``collectives.gather_param_resharded``) hold only an
    all-gather and a cast, and the notice would read as a problem with the user's model."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


_CHECKPOINT_NOTICE = logging.getLogger("torch._higher_order_ops.wrap")


class CompiledGraph:
    """``gm`` under ``torch.compile(backend="inductor")`` with the schedule's inductor options;
    logs how long the first call (trace and compile of forward; backward compiles at the first
    backward) took."""

    def __init__(self, gm: torch.fx.GraphModule, comm: CommOptions | None):
        # gloo's reduce-scatter is slower than an all-to-all and a sum (ops.collectives._sums_exchanged)
        exchange_sums = dist.is_initialized() and dist.get_backend() == "gloo"
        self.compiled = torch.compile(gm, backend="inductor", dynamic=False, options=inductor_options(comm, exchange_sums))
        self.first_call_s: float | None = None
        if not any(isinstance(f, _DropCheckpointNotice) for f in _CHECKPOINT_NOTICE.filters):
            _CHECKPOINT_NOTICE.addFilter(_DropCheckpointNotice())

    def __call__(self, *values: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.compiled(*values)
        if self.first_call_s is not None:
            return self._run(values)
        start = time.perf_counter()
        out = self._run(values)
        self.first_call_s = time.perf_counter() - start
        log.info(
            "autopar: inductor traced and compiled the graph's forward in %.1f s (cached by inductor "
            "for the next compile of the same graph)",
            self.first_call_s,
        )
        return out

    def _run(self, values: Sequence[Any]) -> Any:
        """The compiled forward; a collective of it that fails (a rank died) raises the eager
        collectives' CollectiveError, which names the rank (``collectives.compiled_graph_error``).
        The compiled backward runs inside the user's ``loss.backward()``, where a failure comes
        out as the process group's own error."""
        try:
            outputs = self.compiled(*values)
        except (RuntimeError, dist.DistError) as error:
            diagnosed = collectives.compiled_graph_error("forward", error)
            if diagnosed is None:
                raise
            raise diagnosed from error
        if torch.is_grad_enabled():
            nodes = {id(out.grad_fn): out.grad_fn for out in outputs if isinstance(out, torch.Tensor) and out.grad_fn is not None}
            for node in nodes.values():
                node.register_prehook(_BackwardOnce())
        return outputs


class _BackwardOnce:
    """A prehook of a compiled graph's backward node that refuses its second run. A second
    backward through one forward (after ``retain_graph=True``) of an FSDP layout gave one layer's
    gradients 7e-3 off, without a word, where the communication is bucketed and reordered
    (``passes.schedule.inductor_options``; either alone, or aot_eager, was right: the cause in
    inductor was not found). torch's own check (donated buffers) refuses the first such backward
    of other layouts."""

    def __init__(self) -> None:
        self.ran = False

    def __call__(self, grad_outputs: Any) -> None:
        if self.ran:
            raise UsageError(
                "a second backward through one forward of a module compiled with compiler='inductor' (after "
                "backward(retain_graph=True)): its compiled backward runs once per forward, as torch.compile's "
                "does. Sum the losses and call backward once ((loss_a + loss_b).backward()), run a forward for "
                "each backward, or compile without compiler= (op by op, which runs it)"
            )
        self.ran = True


@torch._dynamo.disable(reason="autopar's eager schedule runs in autograd hooks that dynamo cannot follow")
def run_eager(gm: torch.fx.GraphModule, values: Sequence[Any], offloader: Any = None) -> Any:
    """Run ``gm`` op by op, outside any ``torch.compile`` (see the module docstring)."""
    if offloader is not None:
        with offloader.saved_tensor_hooks():
            return gm(*values)
    with saved_tensors_hooks(gm):  # frees resharded parameter gathers after forward
        return gm(*values)


_warned: list[bool] = []


@torch._dynamo.disable(reason="logs once, eagerly")
def warn_not_compiled() -> None:
    if not _warned:
        _warned.append(True)
        log.warning(
            "autopar: torch.compile of a ParallelModule compiled without compiler='inductor' runs its "
            "graph eagerly (its communication schedule lives in autograd hooks); compile it with "
            "autopar.compile(..., compiler='inductor') to have inductor compile the graph"
        )


def under_autocast(device: torch.device) -> bool:
    """Whether this call runs under the caller's ``torch.autocast`` for ``device``'s type. Inductor
    compiled the graph without it and would run it in the traced dtypes, ignoring it; op by op,
    autocast casts each ATen op as it does the eager model's, so the graph runs so then (said once)."""
    if not torch.is_autocast_enabled(device.type):
        return False
    if not _warned_autocast:
        _warned_autocast.append(True)
        log.warning(
            "autopar: a call under torch.autocast runs the graph op by op, not inductor's compiled graph, which "
            "was compiled without autocast and would ignore it. For bf16 compute under compiler='inductor', "
            "compile with precision='bf16-mixed' (bf16 compute over float32 master weights, planned and priced) "
            "and call without autocast"
        )
    return True


_warned_autocast: list[bool] = []


def check_compiler(compiler: str | None) -> None:
    if compiler not in COMPILERS:
        raise ConfigError(f"compiler must be None (run the graph op by op) or 'inductor', got {compiler!r}")


def graph_runner(gm: torch.fx.GraphModule, compiler: str | None, comm: CommOptions | None) -> Callable[..., Any] | None:
    """What runs ``gm`` under ``compiler``: None for op by op (``run_eager``)."""
    check_compiler(compiler)
    return CompiledGraph(gm, comm) if compiler == "inductor" else None
