"""autopar's own errors. Each message says what was given, what was expected, and the fix.

One family under ``AutoparError``. A class also derives from the builtin its errors used to be
(``ValueError``, ``TypeError``, ``RuntimeError``), so ``except ValueError`` in a user's script keeps
working. ``tests/test_error_family.py`` keeps plain ValueError and TypeError raises out of the
package; ``docs/troubleshooting.md`` lists the classes.
"""

from __future__ import annotations

import re
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the CLI imports this module and must not load torch
    import torch


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class TraceError(AutoparError):
    """The model could not be traced to a graph."""

    @classmethod
    def from_export_error(cls, model: torch.nn.Module, error: Exception) -> TraceError:
        text = str(error).strip()
        where = _user_frame(error)
        hint = (
            "autopar traces with torch.export.export(strict=False). Control flow that depends on "
            "tensor values (if x.sum() > 0, .item(), .tolist(), nonzero) cannot be traced: make the "
            "branch depend on shapes or Python values only, or use torch.cond / torch.where."
        )
        first = text.splitlines()[0] if text else type(error).__name__
        if "Cache" in first and "output" in first:
            hint = (
                "The model returns a key/value cache object (use_cache=True), which a traced graph cannot "
                "return; a training step reads none. Turn the cache off (use_cache=False in the config or "
                "the call; autopar does this itself for configs with a use_cache field)."
            )
        location = f"\n  at {where}" if where else ""
        return cls(f"could not trace {type(model).__name__}: {type(error).__name__}: {first}{location}\n{hint}")


class ConfigError(AutoparError, ValueError):
    """An option or argument has a value autopar does not take: a keyword of ``plan``/``compile``,
    a field of an options value (``PlanOptions``, ``MixedPrecision``, ``CommOptions``, ...), a
    hand-plan kind, a solver name, a zoo model's config."""


class ConfigTypeError(ConfigError, TypeError):
    """An option or argument of the wrong type (an ``int`` where an ``autopar.CommOptions`` goes)."""


class ClusterSpecError(AutoparError, ValueError):
    """A cluster (``cluster=``) is unknown, or its spec file or profiled measurements are malformed."""


class ModelError(AutoparError, ValueError):
    """The model or its example inputs cannot be planned or run as asked (a pipelined model without
    a scalar loss, buffers no checkpoint holds, ranks that built different weights, ...)."""


class InputError(AutoparError, ValueError):
    """A call of the compiled module passes other inputs than those it was compiled for
    (arguments, shapes, dtypes, inputs that share memory, ranks whose shapes differ)."""


class DataMismatchError(InputError):
    """Two ranks (``ranks``) passed data that the module's data layout says must be the same."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()):
        super().__init__(message)
        self.ranks = ranks


class InternalError(AutoparError, ValueError):
    """autopar's own code, or a rule or kernel registered into it, broke an invariant: a bug to
    report with the plan JSON, not a user mistake. The message ends with that fix."""

    FIX = "this is a bug in autopar (or in a rule or kernel registered into it): please report it with the plan JSON"

    def __init__(self, message: str):
        # Appended once: a rank that re-raises rank 0's error builds it again from its text.
        super().__init__(message if self.FIX in message else f"{message} ({self.FIX})")


class MeshError(AutoparError, ValueError):
    """The mesh does not fit the world or is malformed."""


class PlanError(AutoparError, ValueError):
    """A plan file is malformed or does not match the model, mesh or torch version."""


class InfeasibleError(AutoparError):
    """No sharding fits the constraints (a memory budget, say)."""


class CollectiveError(AutoparError, RuntimeError):
    """A collective failed: a peer rank died, or did not answer within the timeout."""


class CheckpointError(AutoparError, ValueError):
    """A checkpoint is missing, incomplete or damaged, or does not fit the module it is loaded into."""


class OffloadError(AutoparError, RuntimeError):
    """A torch optimizer would step parameters whose state the plan offloads (use ``autopar.optim.AdamW``)."""


class HookError(AutoparError, RuntimeError):
    """A module hook (after compile) or a parameter's tensor hook was registered where the compiled module
    would not run it."""


class PartialCallError(AutoparError, ValueError):
    """Ranks are in different calls of the compiled module: not every rank called it."""


class UsageError(AutoparError, RuntimeError):
    """The compiled module is used in a way it cannot run as asked: a mode it was not compiled in,
    an optimizer over the model's original parameters, a step inside ``no_sync()``."""


class PassError(AutoparError):
    """A rewrite pass failed; the message names the pass and those that ran before it."""


class DistributedRankError(AutoparError, RuntimeError):
    """One or more ranks of ``run_distributed`` raised, died, or did not report in time."""

    def __init__(self, message: str, failed_ranks: list[int] | None = None):
        super().__init__(message)
        self.failed_ranks = failed_ranks if failed_ranks is not None else []


class CliError(AutoparError):
    """A user mistake found while running a command (exit status 1)."""


def _user_frame(error: BaseException) -> str | None:
    """The last traceback frame outside torch and autopar, as 'file:line: code'."""
    best = None
    for frame in traceback.extract_tb(error.__traceback__):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or "/autopar/" in path or path.startswith("<"):
            continue
        best = f"{frame.filename}:{frame.lineno}: {frame.line}"
    if best is None:
        match = re.search(r'File "([^"]+)", line (\d+)', str(error))
        if match and "/torch/" not in match.group(1):
            best = f"{match.group(1)}:{match.group(2)}"
    return best
