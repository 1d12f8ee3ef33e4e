"""MILP/LP backends for the sharding ILP: HiGHS (``highspy``, through PuLP) and CBC.

``solver=`` names one of ``SOLVERS``:

- ``"auto"`` (the default): solve the LP relaxation with HiGHS first. The edge families make it
  tight (see ``ilp.py``), so rounding its solution usually gives an integer plan whose cost
  equals the LP bound, which proves it optimal without branching. Only when a gap remains is
  the MILP solved, by HiGHS. CBC replaces HiGHS where ``highspy`` is not installed.
- ``"highs"``: the MILP with HiGHS (in process, no files).
- ``"cbc"``: the MILP with CBC (PuLP's bundled binary, through an MPS file).

Every solve has a time limit. HiGHS and CBC are deterministic at one thread with fixed seeds,
which keeps plans identical across ranks.

No solver writes to stdout, which carries ``--json`` output and pipes: HiGHS's C library prints
its banner with ``printf`` whatever its options say, so each solve runs with file descriptor 1
sent to /dev/null, or to stderr, with the solver's log switched on, when ``AUTOPAR_LOG`` is set
(``autopar --verbose`` sets it).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import threading
import warnings
from collections.abc import Iterator

import pulp

from autopar.errors import ConfigError, InternalError

SOLVERS = ("auto", "highs", "cbc")

# A MILP solve stops once its plan is proven within this fraction of the optimum (HiGHS's
# default). Under a binding memory budget, closing the last 0.01% can take minutes; the gap
# actually reached is reported with the plan.
MIP_REL_GAP = 1e-4


def highs_available() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def check_solver(name: str) -> str:
    """Validate ``name`` and resolve HiGHS to CBC when ``highspy`` is missing (``"highs"`` asked
    for by name is an error then, since the caller chose it)."""
    if name not in SOLVERS:
        raise ConfigError(f"unknown solver {name!r}: expected one of {', '.join(SOLVERS)}")
    if name == "highs" and not highs_available():
        raise ConfigError("solver='highs' needs the highspy package: pip install highspy, or pass solver='cbc'")
    return name


def solver_log_enabled() -> bool:
    """Whether solvers print their logs (to stderr): ``AUTOPAR_LOG`` is set and not 0/false/off."""
    return os.environ.get("AUTOPAR_LOG", "").strip().lower() not in ("", "0", "false", "no", "off")


_stdout_lock = threading.RLock()


@contextlib.contextmanager
def solver_output() -> Iterator[None]:
    """File descriptor 1 goes to stderr (``AUTOPAR_LOG``) or /dev/null inside the block.

    A file-descriptor redirect, because HiGHS writes from C; C's buffered stdout is flushed before
    fd 1 is restored, so nothing printed inside leaks out later."""
    with _stdout_lock:
        try:
            sys.stdout.flush()
            saved = os.dup(1)
        except (OSError, ValueError, AttributeError):  # no fd 1 (embedded interpreters): nothing to guard
            yield
            return
        target = os.dup(2) if solver_log_enabled() else os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(target, 1)
            yield
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)
            os.close(target)


def _flush_c_stdio() -> None:
    try:
        _c_library().fflush(None)
    except (OSError, AttributeError):  # no libc by that name (Windows): C output is unbuffered there
        pass


@functools.cache
def _c_library() -> ctypes.CDLL:
    """The process's C library, loaded once: each ``ctypes.CDLL`` is a reference cycle (the
    library and its function type), left to full collections, which planning holds off."""
    return ctypes.CDLL(None)


class _QuietHiGHS(pulp.HiGHS):
    def actualSolve(self, lp, **kwargs):
        with solver_output():
            return super().actualSolve(lp, **kwargs)


class _QuietCBC(pulp.PULP_CBC_CMD):
    def actualSolve(self, lp, **kwargs):
        with solver_output():
            return super().actualSolve(lp, **kwargs)


# HiGHS's options for LP relaxations. Its presolve took 0.3 s of a 0.35 s cold solve of the
# sharding LP (LLaMA-2-70B on (128, 8), at any depth), most of it searching the edge rows (x-y
# equalities) for dependent equations, to remove a third of the rows; without it the dual
# simplex takes ~40% more iterations and 3-5x less time in all, to the same optimum. MILPs keep
# presolve: their search works on the reduced model.
# Nor do LPs get the dual simplex's cost perturbation. The sharding LP is dual-degenerate (many
# strategies and pairs at equal prices); perturbing their costs took 10-30% more iterations and
# 15-40% more time, to the same optimum (LLaMA-3-8B on (8, 8), (8, 2, 4) and (2, 2, 2, 8)).
# Without it a degenerate LP could stall: ``Relaxation.solve`` caps the iterations
# (``stall_iterations``) and finishes with the perturbation (``PERTURBED``).
LP_OPTIONS = {"presolve": "off", "dual_simplex_cost_perturbation_multiplier": 0.0}
PERTURBED = {"dual_simplex_cost_perturbation_multiplier": 1.0}  # HiGHS's default


def stall_iterations(num_rows: int) -> int:
    """The simplex iterations after which ``Relaxation.solve`` takes an LP without cost
    perturbation for stalled: 20 per row, at least 20,000. The sharding LPs take under one
    per row (LLaMA-3-8B on (8, 2, 4): 6,898 for 19,788 rows)."""
    return max(20 * num_rows, 20_000)


def make(name: str, time_limit_s: float, *, mip: bool = True) -> pulp.LpSolver:
    """A PuLP solver object for backend ``name`` ("highs" or "cbc") with a time limit, whose
    solves print nothing on stdout (``solver_output``)."""
    if not time_limit_s > 0:
        raise ConfigError(f"time_limit_s must be positive, got {time_limit_s!r}")
    msg = solver_log_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if name == "highs":
            return _QuietHiGHS(
                mip=mip,
                msg=msg,
                timeLimit=float(time_limit_s),
                gapRel=MIP_REL_GAP,
                gapAbs=0.0,
                random_seed=1,
                **({} if mip else LP_OPTIONS),
            )
        if name == "cbc":
            return _QuietCBC(
                mip=mip,
                msg=msg,
                timeLimit=time_limit_s,
                threads=1,
                gapRel=MIP_REL_GAP,
                gapAbs=0.0,
                options=["randomSeed 1", "randomCbcSeed 1"],
            )
    raise InternalError(f"no backend {name!r}: expected 'highs' or 'cbc'")


def lp_backend() -> str:
    """The backend for LP relaxations: HiGHS's simplex where available."""
    return "highs" if highs_available() else "cbc"


def mip_backend(name: str) -> str:
    """The MILP backend that ``solver=name`` uses."""
    if name == "auto":
        return "highs" if highs_available() else "cbc"
    return name


def mip_bound(problem: pulp.LpProblem, backend: str) -> float | None:
    """The solver's proven lower bound on the MILP optimum, where the backend reports one."""
    if backend != "highs" or getattr(problem, "solverModel", None) is None:
        return None
    bound = problem.solverModel.getInfo().mip_dual_bound
    return float(bound) if abs(bound) < 1e300 else None
