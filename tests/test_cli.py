"""The ``autopar`` command line: plan, show, diff, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main, parse_bytes, parse_mesh

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """gpt on mesh 2 (cpu), gpt on mesh 2 (h100-80g), gpt on mesh 4 (cpu), mlp on 2x2 (cpu)."""
    d = tmp_path_factory.mktemp("plans")
    paths = {
        "gpt2_cpu": d / "gpt2_cpu.json",
        "gpt2_h100": d / "gpt2_h100.json",
        "gpt4_cpu": d / "gpt4_cpu.json",
    }
    assert main(["plan", "gpt", "--mesh", "2", "--cluster", "cpu", "--out", str(paths["gpt2_cpu"])]) == 0
    assert main(["plan", "gpt", "--mesh", "2", "--cluster", "h100-80g", "--out", str(paths["gpt2_h100"])]) == 0
    assert main(["plan", "gpt", "--mesh", "4", "--cluster", "cpu", "--meta", "--out", str(paths["gpt4_cpu"])]) == 0
    return paths


def test_plan_builtin_mlp(capsys, tmp_path):
    out_path = tmp_path / "mlp.json"
    code, out, err = _run(capsys, "plan", "mlp", "--mesh", "2x2", "--cluster", "cpu", "--out", str(out_path))
    assert code == 0, err
    assert out.startswith("autopar plan  mesh=(2, 2)  cluster=cpu")
    assert "Parameter groups" in out
    assert "tracing" in err and "planning" in err and "traced" in err and " s" in err
    from autopar.plan import Plan

    plan = Plan.load(out_path)
    assert plan.mesh_shape == (2, 2)
    assert plan.cluster == "cpu"

    code, out, err = _run(capsys, "plan", "mlp", "--mesh", "2,2", "--cluster", "cpu", "--json",
                          "--memory-budget", "1GiB", "--batch-size", "4")
    assert code == 0, err
    data = json.loads(out)
    assert data["mesh"]["shape"] == [2, 2]
    assert data["solver"]["memory_budget_bytes"] == 2**30


def test_plan_module_callable(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_cli_model.py").write_text(
        "from autopar.models import build_model, example_batch\n"
        "def make():\n"
        "    return build_model('mlp'), example_batch('mlp', 8)\n"
        "def bad():\n"
        "    return 3\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = _run(capsys, "plan", "my_cli_model:make", "--mesh", "2", "--cluster", "cpu")
    assert code == 0, err
    assert "mesh=(2,)" in out
    code, out, err = _run(capsys, "plan", "my_cli_model.py:make", "--mesh", "2", "--cluster", "cpu")
    assert code == 0, err
    code, out, err = _run(capsys, "plan", "my_cli_model:bad", "--mesh", "2", "--cluster", "cpu")
    last = err.rstrip().splitlines()[-1]
    assert code == 1 and last.startswith("autopar: error:") and "(model, example_inputs)" in last


def test_show_text_and_json(capsys, plans):
    code, out, err = _run(capsys, "show", str(plans["gpt2_cpu"]))
    assert code == 0, err
    assert "autopar plan  mesh=(2,)" in out
    assert "Parameter groups" in out
    group_rows = [line for line in out.splitlines() if "transformer.h.*.attn.q_proj.weight" in line]
    assert len(group_rows) == 1 and group_rows[0].rstrip().endswith("x2")

    code, out, err = _run(capsys, "show", str(plans["gpt2_cpu"]), "--json")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1
    data = json.loads(out)
    assert set(data) >= {"mesh", "predicted", "solver", "params", "collectives"}
    assert data["mesh"] == [2]
    rows = {row["fqn"]: row for row in data["params"]}
    assert rows["transformer.h.*.attn.q_proj.weight"]["count"] == 2
    assert "transformer.h.0.attn.q_proj.weight" not in rows
    assert sum(row["count"] for row in data["params"]) == len(json.loads(plans["gpt2_cpu"].read_text())["params"])
    for row in data["collectives"]:
        assert set(row) == {"kind", "axis", "count"} and row["count"] > 0


def test_diff(capsys, plans):
    code, out, err = _run(capsys, "diff", str(plans["gpt2_cpu"]), str(plans["gpt2_cpu"]))
    assert code == 0, err
    assert "plans are identical" in out
    code, out, err = _run(capsys, "diff", str(plans["gpt2_cpu"]), str(plans["gpt2_cpu"]), "--json")
    assert json.loads(out) == {"identical": True}

    code, out, err = _run(capsys, "diff", str(plans["gpt2_cpu"]), str(plans["gpt4_cpu"]))
    assert code == 0, err
    assert "mesh: (2,) -> (4,)" in out
    assert "step_time_s" in out and "%" in out
    assert "plans are identical" not in out

    code, out, err = _run(capsys, "diff", str(plans["gpt2_cpu"]), str(plans["gpt2_h100"]), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["identical"] is False
    assert data["cluster"] == {"a": "cpu", "b": "h100-80g"}
    assert "mesh" not in data and "graph_hash" not in data
    assert "step_time_s" in data["predicted"]
    entry = data["predicted"]["step_time_s"]
    assert entry["rel_change"] == pytest.approx((entry["b"] - entry["a"]) / entry["a"])
    a = json.loads(plans["gpt2_cpu"].read_text())
    b = json.loads(plans["gpt2_h100"].read_text())
    changed = {fqn for fqn in a["params"] if a["params"][fqn] != b["params"][fqn]}
    assert {row["fqn"] for row in data.get("params", [])} == changed
    changed_nodes = {n for n in a["nodes"] if a["nodes"][n]["out"] != b["nodes"][n]["out"]}
    assert {row["name"] for row in data.get("nodes", [])} == changed_nodes


def test_parsers():
    assert parse_mesh("2x4") == (2, 4)
    assert parse_mesh("2,4") == (2, 4)
    assert parse_mesh("8") == (8,)
    assert parse_bytes("70GiB") == 70 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("1000") == 1000


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("case", [
    "no-args", "unknown-preset", "mesh-2x", "mesh-0x4", "mesh-abc", "missing-mesh", "bad-budget",
    "budget-unit", "unknown-model", "unimportable", "no-attr", "missing-plan", "malformed-plan",
    "not-json-plan", "missing-diff", "infeasible", "unknown-command", "missing-cluster-file",
])
def test_errors_are_one_line(capsys, tmp_path, plans, case):
    good = str(plans["gpt2_cpu"])
    argv = {
        "no-args": [],
        "unknown-preset": ["plan", "mlp", "--mesh", "2", "--cluster", "nope-99g"],
        "mesh-2x": ["plan", "mlp", "--mesh", "2x"],
        "mesh-0x4": ["plan", "mlp", "--mesh", "0x4"],
        "mesh-abc": ["plan", "mlp", "--mesh", "abc"],
        "missing-mesh": ["plan", "mlp"],
        "bad-budget": ["plan", "mlp", "--mesh", "2", "--memory-budget", "lots"],
        "budget-unit": ["plan", "mlp", "--mesh", "2", "--memory-budget", "70XB"],
        "unknown-model": ["plan", "no_such_model", "--mesh", "2", "--cluster", "cpu"],
        "unimportable": ["plan", "no_such_module_xyz:make", "--mesh", "2", "--cluster", "cpu"],
        "no-attr": ["plan", "autopar.models:no_such_fn", "--mesh", "2", "--cluster", "cpu"],
        "missing-plan": ["show", str(tmp_path / "absent.json")],
        "malformed-plan": ["show", _write(tmp_path / "bad.json", '{"version": 1, "mesh": {}}')],
        "not-json-plan": ["show", _write(tmp_path / "bad2.json", "this is not json")],
        "missing-diff": ["diff", good, str(tmp_path / "absent.json")],
        "infeasible": ["plan", "mlp", "--mesh", "2", "--cluster", "cpu", "--memory-budget", "1KiB"],
        "unknown-command": ["frobnicate"],
        "missing-cluster-file": ["plan", "mlp", "--mesh", "2", "--cluster", str(tmp_path / "c.json")],
    }[case]
    code, out, err = _run(capsys, *argv)
    assert code in (1, 2), (code, err)
    lines = [line for line in err.splitlines() if line.startswith("autopar: error:")]
    assert len(lines) == 1, err
    assert err.rstrip().splitlines()[-1] == lines[0]
    assert "Traceback" not in err and "Traceback" not in out
    if case in ("mesh-2x", "mesh-0x4", "mesh-abc", "bad-budget", "unknown-preset", "no-args"):
        assert code == 2
    if case == "infeasible":
        assert code == 1 and "InfeasibleError" in lines[0]


def test_python_dash_m(plans):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "autopar", "show", str(plans["gpt2_cpu"])],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "autopar plan  mesh=(2,)" in result.stdout
    assert "transformer.h.*.attn.q_proj.weight" in result.stdout
    result = subprocess.run([sys.executable, "-m", "autopar", "show", "/nonexistent/plan.json"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("autopar: error:") and len(result.stderr.strip().splitlines()) == 1
