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

    root = autopar.__path__[0]
    for old in _moved.MOVED:
        leaf = old.removeprefix("autopar.")
        assert importlib.machinery.PathFinder.find_spec(leaf, [root]) is None, old
        assert leaf not in autopar._EXPORTS, old
