"""FSDP2's order for a padded parameter under a precision policy: cast the piece, gather the cast.

The rules offer even shards only (``ir.spec.is_valid``), so a precision policy's cast of a
parameter held as a padded shard (``ir.spec.padded_axis``) would take it only replicated: the plan
would gather the master (fp32, twice bf16's bytes) and cast the whole tensor, and its price
would see two gathers of one parameter (the cast's and its readers'), none of them the scheduled
FSDP gather. A cast is elementwise, so the cast of a rank's piece is that rank's piece of the cast
(padding included: zeros cast to zeros). ``padded_cast_strategies`` offers the cast exactly
that, ``padded → padded`` on the parameter's own spec, as the rules offer ``S(0) → S(0)`` where the
axis divides. The cast then follows its parameter (``choices._mark_followers``), its readers
gather it in ``param_dtype`` (the edge, ``cost.comm``, padded to ``k`` pieces), and the runtime
does the same: ``passes.precision`` moves the cast past the gather and ``ParamGathers`` gathers
the cast pieces. Any other op that reads a padded piece still takes it only replicated
(``ir.spec.padded_transition_ok``): gathered first, as before.
"""

from __future__ import annotations

import torch
import torch.fx

from autopar.ir.spec import Spec, padded_axis
from autopar.rules.registry import Strategy
from autopar.trace import is_param_cast


def padded_cast_strategies(
    node: torch.fx.Node, kind: str, shape: tuple[int, ...], specs: list[Spec], mesh_shape: tuple[int, ...]
) -> tuple[Strategy, ...]:
    """The strategies ``padded → padded`` for ``node`` where it is a policy's cast of a parameter
    (its one input, of ``kind`` "param", ``shape`` and offered ``specs``) and some of those specs
    are padded shards; none otherwise."""
    if kind != "param" or not is_param_cast(node):
        return ()
    return tuple(Strategy((spec,), (spec,)) for spec in specs if padded_axis(shape, spec, mesh_shape) is not None)


__all__ = ["padded_cast_strategies"]
