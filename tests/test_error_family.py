"""autopar's errors stay one family: no plain ``raise ValueError``/``TypeError`` creeps back into the
package, every class is an ``AutoparError`` that docs/troubleshooting.md lists, and each can be
rebuilt from its message alone (a rank re-raises rank 0's planning error that way)."""

from __future__ import annotations

import ast
import inspect
import pickle
import re
from pathlib import Path

import pytest

import autopar
from autopar import errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autopar"

# The only plain builtin raises allowed, each a programming error of the caller, not a user's
# input to autopar: (file, function) -> why.
ALLOWED = {
    ("autopar/runtime/tools/launch.py", "rel_diff"): "a script comparing tensors of different shapes, as numpy's own",
}
BUILTINS = {"ValueError", "TypeError"}


def _plain_raises(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each ``raise ValueError``/``raise TypeError`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                    found.append((function, child.lineno))
            visit(child, name)

    visit(tree, "<module>")
    return found


def test_the_ast_check_finds_a_plain_raise(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f(x):\n    if x:\n        raise ValueError('no')\n    raise TypeError\n")
    assert _plain_raises(source) == [("f", 3), ("f", 4)]


def test_no_plain_value_or_type_error_is_raised_for_user_input():
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for function, line in _plain_raises(path):
            if (relative, function) not in ALLOWED:
                stray.append(f"{relative}:{line} in {function}()")
    assert not stray, (
        "raise an autopar.errors class (ConfigError, ModelError, InputError, PlanError, ... or InternalError "
        "for a broken invariant) that says what was passed, what was expected and the fix, not a plain "
        f"ValueError/TypeError: {stray}"
    )


def _family() -> list[type[BaseException]]:
    return [
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    ]


def test_every_error_class_is_an_autopar_error_listed_in_troubleshooting():
    listed = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "docs" / "troubleshooting.md").read_text(), re.M))
    for cls in _family():
        assert issubclass(cls, errors.AutoparError), cls
        assert cls.__name__ in listed or cls is errors.AutoparError, f"{cls.__name__} is not in docs/troubleshooting.md"
    assert listed <= {cls.__name__ for cls in _family()}, "the family table names a class errors.py lacks"


def test_the_moved_classes_keep_their_builtin_bases_and_old_import_paths():
    from autopar.cli.main import CliError
    from autopar.runtime.data import DataMismatchError
    from autopar.runtime.tools.launch import DistributedRankError

    assert issubclass(DataMismatchError, ValueError) and issubclass(DataMismatchError, errors.InputError)
    assert issubclass(DistributedRankError, RuntimeError) and issubclass(DistributedRankError, errors.AutoparError)
    assert CliError is errors.CliError
    assert issubclass(errors.ConfigTypeError, TypeError) and issubclass(errors.ConfigTypeError, ValueError)


@pytest.mark.parametrize("cls", _family(), ids=lambda cls: cls.__name__)
def test_each_class_is_rebuilt_from_its_message_alone(cls):
    error = cls("planned badly")
    again = type(error)(f"{error}\n(planned on rank 0)")  # as api re-raises rank 0's planning error
    assert str(again).count("planned badly") == 1 and "(planned on rank 0)" in str(again)
    sent = pickle.loads(pickle.dumps(error))  # as broadcast_object_list sends it to the other ranks
    assert type(sent) is cls and str(sent) == str(error)


def test_an_internal_error_names_the_report_once():
    error = errors.InternalError("spec lengths differ")
    assert str(error).startswith("spec lengths differ (this is a bug in autopar")
    assert "please report it with the plan JSON" in str(error)
    assert str(errors.InternalError(str(error))).count(errors.InternalError.FIX) == 1


def test_user_mistakes_raise_the_family_and_still_meet_except_value_error():
    with pytest.raises(errors.ConfigError, match="precision must be one of") as info:
        autopar.plan(autopar.zoo.models.build_model("mlp"), mesh=(2,), example_inputs=(), precision="fp7", cluster="cpu")
    assert isinstance(info.value, ValueError)
    with pytest.raises(errors.ClusterSpecError, match="unknown cluster 'no-such-gpu'"):
        autopar.plan(autopar.zoo.models.build_model("mlp"), mesh=(2,), example_inputs=(), cluster="no-such-gpu")
    with pytest.raises(errors.ConfigError, match="unknown model 'gpt5'"):
        autopar.zoo.models.build_model("gpt5")
