"""Parallel op implementations that one collective cannot express.

A kernel stands in for one aten op under a strategy row that names it. It is called with the
op's arguments by schema name plus ``axis_groups``: the process-group names of the mesh axes on which
the kernel's row was chosen, outermost axis first. With ``axis_groups=()`` a kernel must compute
exactly the op. Kernels are built from local torch ops and ``autopar.ops.collectives``, so autograd
differentiates them under the replicated-loss convention without hand-written backwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.errors import InternalError

KERNELS: dict[str, Callable[..., Any]] = {}

# Ops that the trace keeps whole as custom ops whose autograd recomputes their forward
# (``trace.moe``): where no kernel stands in, a rewritten graph calls this differentiable
# implementation instead (same arguments, positional), which autograd differentiates directly.
EAGER_IMPLEMENTATIONS: dict[Any, Callable[..., Any]] = {}


def register_kernel(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in KERNELS:
            raise InternalError(f"duplicate kernel {name!r}")
        KERNELS[name] = fn
        fn.__autopar_kernel__ = name
        return fn

    return wrap
