"""Solver backends print nothing on stdout; with AUTOPAR_LOG their log goes to stderr."""

from __future__ import annotations

import os

import pulp
import pytest

from autopar.solver.search import backends


def _tiny_problem() -> pulp.LpProblem:
    problem = pulp.LpProblem("tiny", pulp.LpMinimize)
    x = problem.add_variable("x", 0, 3, cat="Integer")
    y = problem.add_variable("y", 0, 3, cat="Integer")
    problem += x + 2 * y
    problem += x + y >= 2, "cover"
    return problem


@pytest.mark.parametrize("name", ["highs", "cbc"])
@pytest.mark.parametrize("log", [False, True])
def test_solves_print_nothing_on_stdout(capfd, monkeypatch, name, log):
    if name == "highs" and not backends.highs_available():
        pytest.skip("highspy is not installed")
    if log:
        monkeypatch.setenv("AUTOPAR_LOG", "1")
    else:
        monkeypatch.delenv("AUTOPAR_LOG", raising=False)
    problem = _tiny_problem()
    problem.solve(backends.make(name, 10.0, mip=True))
    os.write(1, b"after\n")  # fd 1 is back where it was
    out, err = capfd.readouterr()
    assert pulp.LpStatus[problem.status] == "Optimal"
    assert out == "after\n", out
    if log:
        assert err.strip(), f"{name} printed no log to stderr with AUTOPAR_LOG=1"


def test_solver_output_restores_stdout_after_an_error(capfd):
    with pytest.raises(RuntimeError), backends.solver_output():
        os.write(1, b"hidden\n")
        raise RuntimeError("boom")
    os.write(1, b"shown\n")
    out, _ = capfd.readouterr()
    assert out == "shown\n"
