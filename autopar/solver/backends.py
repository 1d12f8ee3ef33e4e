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
"""

from __future__ import annotations

import warnings

import pulp

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
        raise ValueError(f"unknown solver {name!r}: expected one of {', '.join(SOLVERS)}")
    if name == "highs" and not highs_available():
        raise ValueError("solver='highs' needs the highspy package: pip install highspy, or pass solver='cbc'")
    return name


def make(name: str, time_limit_s: float, *, mip: bool = True) -> pulp.LpSolver:
    """A PuLP solver object for backend ``name`` ("highs" or "cbc") with a time limit."""
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if name == "highs":
            return pulp.HiGHS(
                mip=mip, msg=False, timeLimit=float(time_limit_s), gapRel=MIP_REL_GAP, gapAbs=0.0, random_seed=1
            )
        if name == "cbc":
            return pulp.PULP_CBC_CMD(
                mip=mip, msg=False, timeLimit=time_limit_s, threads=1, gapRel=MIP_REL_GAP, gapAbs=0.0,
                options=["randomSeed 1", "randomCbcSeed 1"],
            )
    raise ValueError(f"no backend {name!r}: expected 'highs' or 'cbc'")


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
