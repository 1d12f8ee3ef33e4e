"""What rewritten graphs call: differentiable collectives (``collectives``) and the parallel
kernels that one collective cannot express (``parallel``, ``losses``, ``attention``), registered by name
(``kernels``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopar.errors import PlanError
from autopar.ops import attention, losses, parallel  # noqa: F401  (registers the kernels)
from autopar.ops.kernels import KERNELS


def get_kernel(name: str) -> Callable[..., Any]:
    try:
        return KERNELS[name]
    except KeyError:
        raise PlanError(f"plan names kernel {name!r}, which this autopar does not have: re-plan with this autopar") from None
