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
    "autopar.models": "autopar.zoo.models",
    "autopar.model_specs": "autopar.zoo.shapes",
    "autopar.testing": "autopar.runtime.launch",
    "autopar.spec": "autopar.ir.spec",
    "autopar.materialize": "autopar.runtime.materialize",
    "autopar.html_report": "autopar.report.html",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old names and hands out the new modules under them."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path will be removed)",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(new)

    def exec_module(self, module):
        pass  # the new module was executed when it was imported


def install() -> None:
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
