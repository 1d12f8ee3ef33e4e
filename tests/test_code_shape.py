"""The code's shape (issue #31, STYLE.md): no function in ``autopar/`` over 80 lines or over 10
parameters (but the public keyword facades), and no private name imported across modules.

Static (``ast`` only, no import of autopar): well under a second."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "autopar"
MAX_LINES = 80  # from ``def`` to its last line, docstring and decorators' body included
MAX_PARAMS = 10  # ``self`` and ``cls`` not counted; ``*args`` and ``**kwargs`` count one each
# The public keyword facades: one keyword per documented option, which ``PlanOptions`` then
# carries whole (docs/plans-offline.md, docs/training.md).
WIDE_FACADES = {("api.py", "plan"), ("api.py", "compile"), ("api.py", "hand_plan")}
# Over 80 lines, being split on another branch: an entry must go once its function is short
# (test_no_function_is_over_80_lines fails until it does).
LONG_FOR_NOW: set[tuple[str, str]] = set()


@functools.cache
def _modules() -> list[tuple[str, ast.Module]]:
    return [(path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), str(path))) for path in sorted(ROOT.rglob("*.py"))]


def _functions():
    for where, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield where, node


def _num_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    count = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) + bool(args.vararg) + bool(args.kwarg)
    positional = args.posonlyargs + args.args
    return count - (1 if positional and positional[0].arg in ("self", "cls") else 0)


def test_no_function_is_over_80_lines():
    lengths = {(where, node.name): node.end_lineno - node.lineno + 1 for where, node in _functions()}
    long = sorted(
        f"{where} {name}: {n} lines"
        for (where, name), n in lengths.items()
        if n > MAX_LINES and (where, name) not in LONG_FOR_NOW
    )
    assert not long, "split these into steps, each a function with its own docstring (STYLE.md 14):\n  " + "\n  ".join(long)
    done = sorted(f"{where} {name}" for where, name in LONG_FOR_NOW if lengths.get((where, name), 0) <= MAX_LINES)
    assert not done, f"these are short now (or gone): take them out of LONG_FOR_NOW: {done}"


def test_no_function_takes_more_than_10_parameters_but_the_facades():
    wide = sorted(
        f"{where}:{node.lineno} {node.name}: {_num_params(node)} parameters"
        for where, node in _functions()
        if _num_params(node) > MAX_PARAMS and (where, node.name) not in WIDE_FACADES
    )
    assert not wide, "group related parameters into a frozen dataclass (STYLE.md 11):\n  " + "\n  ".join(wide)


def test_no_private_name_is_imported_across_modules():
    found = []
    for where, tree in _modules():
        package = ("autopar." + where.removesuffix(".py").replace("/", ".")).removesuffix(".__init__")
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("autopar"):
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name.startswith("__"):
                    continue
                # A package may import its own private submodule (autopar/__init__.py: ``_moved``).
                own_submodule = where.endswith("__init__.py") and node.module == package
                if not own_submodule:
                    found.append(f"{where}:{node.lineno} from {node.module} import {alias.name}")
    assert not found, "make these public (and name them so) or move them where they are used:\n  " + "\n  ".join(found)


def test_the_checks_see_what_they_check():
    """The walk finds the code: a check over no functions would pass whatever the code was."""
    functions = list(_functions())
    assert len(functions) > 1000
    assert max(_num_params(node) for where, node in functions if (where, node.name) in WIDE_FACADES) > MAX_PARAMS


def test_every_execution_module_of_the_runtime_is_kept_from_its_tools():
    """The import-linter contract that keeps ``runtime/tools/`` out of the execution names each
    execution module (a forbidden contract on ``autopar.runtime`` would cover the tools too): a
    new module in ``runtime/`` must join it."""
    import tomllib

    config = tomllib.loads((ROOT.parent / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in config if c["name"] == "The runtime's execution does not import its tools"]
    execution = {f"autopar.runtime.{p.stem}" for p in (ROOT / "runtime").glob("*.py") if p.stem != "__init__"}
    assert set(contract["source_modules"]) == execution
    assert contract["forbidden_modules"] == ["autopar.runtime.tools"]
