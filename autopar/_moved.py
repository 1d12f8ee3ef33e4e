"""Old module paths that moved when autopar/ was laid out as its pipeline, kept importable.

``import autopar.models`` (and the others in ``MOVED``) still works: it loads the module's new
home under the old name, with a ``DeprecationWarning`` that names the new path. Only paths that
nothing in autopar/ uses any more are listed, so no old name shadows a live one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    # solver/strategies/ named for its role: the search for the ILP's solution (the package only:
    # import its modules from autopar.solver.search)
    "autopar.solver.strategies": "autopar.solver.search",
    # runtime/'s tools apart from its execution
    "autopar.runtime.check": "autopar.runtime.tools.check",
    "autopar.runtime.numerics": "autopar.runtime.tools.numerics",
    "autopar.runtime.profile": "autopar.runtime.tools.profile",
    "autopar.runtime.profile_rates": "autopar.runtime.tools.profile_rates",
    "autopar.runtime.launch": "autopar.runtime.tools.launch",
    "autopar.models": "autopar.zoo.models",
    "autopar.model_specs": "autopar.zoo.shapes",
    "autopar.testing": "autopar.runtime.tools.launch",
    "autopar.spec": "autopar.ir.spec",
    "autopar.materialize": "autopar.runtime.materialize",
    "autopar.html_report": "autopar.report.html",
    # solver/ laid out by role (problem, search, pricing, planners)
    "autopar.solver.choices": "autopar.solver.problem.choices",
    "autopar.solver.gathered": "autopar.solver.problem.gathered",
    "autopar.solver.ilp": "autopar.solver.problem.ilp",
    "autopar.solver.backends": "autopar.solver.search.backends",
    "autopar.solver.relaxation": "autopar.solver.search.relaxation",
    "autopar.solver.rounding": "autopar.solver.search.rounding",
    "autopar.solver.solving": "autopar.solver.search.solving",
    "autopar.solver.budget": "autopar.solver.search.budget",
    "autopar.solver.comm_schedule": "autopar.solver.pricing.comm_schedule",
    "autopar.solver.runner_ups": "autopar.solver.pricing.runner_ups",
    "autopar.solver.symbolic": "autopar.solver.pricing.symbolic",
    "autopar.solver.stages": "autopar.solver.planners.stages",
    "autopar.solver.stage_costs": "autopar.solver.planners.stage_costs",
    "autopar.solver.mesh_search": "autopar.solver.planners.mesh_search",
    "autopar.solver.hand_plans": "autopar.solver.planners.hand_plans",
    "autopar.solver.memory": "autopar.solver.planners.memory_plan",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names and hands out the new modules under them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path will be removed)", DeprecationWarning, stacklevel=3
        )
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the new module was executed when it was imported


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
