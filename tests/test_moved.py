"""Old module paths keep importing, with a warning that names the new one."""

import importlib
import importlib.machinery
import sys

import pytest

from autopar import _moved


@pytest.mark.parametrize("old, new", sorted(_moved.MOVED.items()))
def test_old_path_imports_the_new_module_with_a_warning(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_old_names_are_not_live_modules():
    """An alias is only for a path with no module of its own (a real one would win and the alias
    would be dead), and never a public name of the package (``autopar.plan`` is a function)."""
    import autopar

    for old in _moved.MOVED:
        parent = old.rpartition(".")[0]
        # Searched in the parent package's own folder (autopar/solver/ for autopar.solver.choices).
        assert importlib.machinery.PathFinder.find_spec(old, importlib.import_module(parent).__path__) is None, old
        assert old.removeprefix("autopar.") not in autopar._EXPORTS, old
