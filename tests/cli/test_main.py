"""The ``autopar`` command line: plan, show, diff, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.cli import main, parse_bytes, parse_mesh

ROOT = Path(__file__).resolve().parents[2]


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
    from autopar.ir.plan import Plan

    plan = Plan.load(out_path)
    assert plan.mesh_shape == (2, 2)
    assert plan.cluster == "cpu"

    code, out, err = _run(
        capsys, "plan", "mlp", "--mesh", "2,2", "--cluster", "cpu", "--json", "--memory-budget", "1GiB", "--batch-size", "4"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["mesh"]["shape"] == [2, 2]
    assert data["solver"]["memory_budget_bytes"] == 2**30


def test_plan_module_callable(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_cli_model.py").write_text(
        "from autopar.zoo.models import build_model, example_batch\n"
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


def _without(plan_path: Path, tmp_path: Path, key: str) -> str:
    data = json.loads(plan_path.read_text())
    data.pop(key)
    return _write(tmp_path / f"without_{key}.json", json.dumps(data))


def _write_bytes(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def _bad_placement(plan_path: Path, tmp_path: Path) -> str:
    """The plan with a weight sharded on a dim it does not have, as a hand edit might leave it."""
    data = json.loads(plan_path.read_text())
    data["params"]["transformer.h.0.attn.q_proj.weight"] = ["S(5)"]
    return _write(tmp_path / "bad_placement.json", json.dumps(data))


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "case",
    [
        "no-args",
        "unknown-preset",
        "mesh-2x",
        "mesh-0x4",
        "mesh-abc",
        "missing-mesh",
        "bad-budget",
        "budget-unit",
        "unknown-model",
        "unimportable",
        "no-attr",
        "missing-plan",
        "malformed-plan",
        "not-json-plan",
        "missing-diff",
        "infeasible",
        "unknown-command",
        "missing-cluster-file",
        "unknown-node",
        "explain-missing-file",
        "explain-no-decisions",
        "check-missing-file",
        "check-no-model",
        "check-unknown-model",
        "check-bad-rank",
        "devices-zero",
        "mesh-and-devices",
        "seq-len-on-mlp",
        "unknown-preset-model",
        "html-unwritable",
        "binary-plan",
        "truncated-plan",
        "show-bad-placement",
        "check-bad-placement",
        "out-unwritable",
    ],
)
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
        "no-attr": ["plan", "autopar.zoo.models:no_such_fn", "--mesh", "2", "--cluster", "cpu"],
        "missing-plan": ["show", str(tmp_path / "absent.json")],
        "malformed-plan": ["show", _write(tmp_path / "bad.json", '{"version": 1, "mesh": {}}')],
        "not-json-plan": ["show", _write(tmp_path / "bad2.json", "this is not json")],
        "missing-diff": ["diff", good, str(tmp_path / "absent.json")],
        "infeasible": ["plan", "mlp", "--mesh", "2", "--cluster", "cpu", "--memory-budget", "1KiB"],
        "unknown-command": ["frobnicate"],
        "missing-cluster-file": ["plan", "mlp", "--mesh", "2", "--cluster", str(tmp_path / "c.json")],
        "unknown-node": ["explain", good, "transformer.h.0.attn.q_proj.weigth"],
        "explain-missing-file": ["explain", str(tmp_path / "absent.json"), "linear"],
        "explain-no-decisions": ["explain", _without(plans["gpt2_cpu"], tmp_path, "decisions"), "linear"],
        "check-missing-file": ["check", str(tmp_path / "absent.json")],
        "check-no-model": ["check", _without(plans["gpt2_cpu"], tmp_path, "model")],
        "check-unknown-model": ["check", good, "--model", "no_such_model"],
        "check-bad-rank": ["check", good, "--rank", "9"],
        "devices-zero": ["plan", "mlp", "--devices", "0"],
        "mesh-and-devices": ["plan", "mlp", "--mesh", "2", "--devices", "2"],
        "seq-len-on-mlp": ["plan", "mlp", "--mesh", "2", "--seq-len", "4", "--cluster", "cpu"],
        "unknown-preset-model": ["plan", "llama-9-1t", "--mesh", "2"],
        "html-unwritable": ["show", good, "--html", str(tmp_path / "no" / "such" / "dir" / "r.html")],
        "binary-plan": ["show", _write_bytes(tmp_path / "plan.bin", bytes(range(256)))],
        "truncated-plan": ["show", _write(tmp_path / "cut.json", Path(good).read_text()[:300])],
        "show-bad-placement": ["show", _bad_placement(plans["gpt2_cpu"], tmp_path)],
        "check-bad-placement": ["check", _bad_placement(plans["gpt2_cpu"], tmp_path)],
        "out-unwritable": ["plan", "gpt", "--mesh", "2", "--cluster", "cpu", "--out", str(tmp_path / "no" / "p.json")],
    }[case]
    code, out, err = _run(capsys, *argv)
    assert code in (1, 2), (code, err)
    lines = [line for line in err.splitlines() if line.startswith("autopar: error:")]
    assert len(lines) == 1, err
    # The error ends stderr: its first line, then (multi-line messages keep their breaks) indented lines.
    tail = err.rstrip().splitlines()[err.rstrip().splitlines().index(lines[0]) :]
    assert tail[0] == lines[0] and all(line.startswith("  ") for line in tail[1:]), err
    assert "Traceback" not in err and "Traceback" not in out
    if case in ("mesh-2x", "mesh-0x4", "mesh-abc", "bad-budget", "unknown-preset", "no-args", "devices-zero", "mesh-and-devices"):
        assert code == 2
    if case in ("unknown-node", "check-no-model", "check-unknown-model", "check-bad-rank", "explain-no-decisions"):
        assert code == 1
    if case == "unknown-node":
        assert "did you mean 'transformer.h.0.attn.q_proj.weight'" in lines[0]
    if case == "binary-plan":
        assert "plan.bin' is not text" in lines[0]
    if case == "truncated-plan":
        assert "cut.json' is not valid JSON" in lines[0]
    if case in ("show-bad-placement", "check-bad-placement"):
        assert "parameter 'transformer.h.0.attn.q_proj.weight' has placements (S(5)), which shards dim 5" in lines[0]
    if case == "out-unwritable":
        assert "does not exist" in lines[0] and "planning" not in err and "building" not in err
    if case == "infeasible":
        assert code == 1 and "InfeasibleError" in lines[0]
        assert len(tail) > 3 and "Largest tensors" in err and "--offload auto" in tail[-1]


def test_python_dash_m(plans):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "autopar", "show", str(plans["gpt2_cpu"])], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "autopar plan  mesh=(2,)" in result.stdout
    assert "transformer.h.*.attn.q_proj.weight" in result.stdout
    result = subprocess.run(
        [sys.executable, "-m", "autopar", "show", "/nonexistent/plan.json"], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 1
    assert result.stderr.strip().startswith("autopar: error:") and len(result.stderr.strip().splitlines()) == 1


def test_plan_records_the_model_and_check_rebuilds_it(capsys, plans):
    data = json.loads(plans["gpt2_cpu"].read_text())
    assert data["model"] == {"spec": "gpt", "batch_size": 8, "meta": False}
    code, out, err = _run(capsys, "check", str(plans["gpt2_cpu"]), "--rank", "1")
    assert code == 0, err
    assert out.startswith("OK: rank 1 of 2")
    code, out, err = _run(capsys, "check", str(plans["gpt4_cpu"]), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] is True and data["world_size"] == 4 and data["mismatches"] == []
    # --model overrides the recorded spec; a different model is refused, saying re-plan.
    code, out, err = _run(capsys, "check", str(plans["gpt2_cpu"]), "--model", "mlp")
    # 2 progress lines, then the error: its first line and the differences, indented under it.
    lines = err.strip().splitlines()
    assert code == 1 and "re-plan" in err and lines[2].startswith("autopar: error: PlanError")
    assert all(line.startswith("  ") for line in lines[3:]) and "parameter 'layers.0.weight' is new" in err


def test_explain(capsys, plans):
    code, out, err = _run(capsys, "explain", str(plans["gpt2_cpu"]), "transformer.h.1.mlp.c_fc.weight")
    assert code == 0, err
    assert out.startswith("explain parameter transformer.h.1.mlp.c_fc.weight")
    assert "chosen: out" in out and "decided by" in out
    data = json.loads(plans["gpt2_cpu"].read_text())
    node = next(n for n, v in data["nodes"].items() if v["op"] == "aten.addmm.default" or v["op"] == "aten.linear.default")
    code, out, err = _run(capsys, "explain", str(plans["gpt2_cpu"]), node, "--json")
    assert code == 0, err
    record = json.loads(out)
    assert record["node"] == node and record["candidates"][0]["chosen"] is True
    assert record["binding"] in ("cost", "memory_budget", "time_limit", "coupled")


def test_show_html(capsys, plans, tmp_path):
    page = tmp_path / "report.html"
    code, out, err = _run(capsys, "show", str(plans["gpt2_cpu"]), "--html", str(page))
    assert code == 0, err
    text = page.read_text()
    assert "transformer.h.*.attn.q_proj" in text and "Step time" in text and "Memory per device" in text


def test_plan_devices_prints_the_mesh_table(capsys, tmp_path):
    out_path = tmp_path / "auto.json"
    code, out, err = _run(capsys, "plan", "mlp", "--devices", "4", "--cluster", "cpu", "--out", str(out_path))
    assert code == 0, err
    assert out.startswith("Mesh search (2 meshes)")
    assert "<- chosen" in out and "2x2" in out
    assert "mesh search 1/2" in err and "mesh search 2/2" in err
    for stage in ("tracing", "rules and costs", "solving the ILP", "solve: Optimal"):
        assert stage in err
    assert json.loads(out_path.read_text())["mesh"]["shape"] in ([4], [2, 2])


def test_two_layer_llama_70b_flow(capsys, tmp_path):
    """The 70B benchmark's flow (benchmarks/bench_cli_70b.sh) on the real widths, two layers deep."""
    small, large = tmp_path / "l4.json", tmp_path / "l8.json"
    common = ["--num-layers", "2", "--seq-len", "64", "--batch-size", "8", "--cluster", "h100-80g"]
    for path, mesh in ((small, "4"), (large, "8")):
        code, out, err = _run(capsys, "plan", "llama-2-70b", "--mesh", mesh, *common, "--out", str(path))
        assert code == 0, err
    data = json.loads(large.read_text())
    assert data["model"] == {"spec": "llama-2-70b", "batch_size": 8, "meta": True, "seq_len": 64, "num_layers": 2}
    assert data["nodes"]["p_model_layers_0_mlp_up_proj_weight"]["shape"] == [[28672, 8192]]
    code, out, err = _run(capsys, "show", str(large))
    assert code == 0 and "model.layers.*.mlp.up_proj.weight" in out
    code, out, err = _run(capsys, "explain", str(large), "model.layers.1.mlp.down_proj.weight")
    assert code == 0 and "decided by" in out, err
    code, out, err = _run(capsys, "diff", str(small), str(large))
    assert code == 0 and "mesh: (4,) -> (8,)" in out, err
    code, out, err = _run(capsys, "check", str(large), "--rank", "5")
    assert code == 0, err
    assert out.startswith("OK: rank 5 of 8")


def test_json_stdout_holds_the_plan_only():
    """`autopar plan ... --json | python -c 'json.load(sys.stdin)'` works: no solver banner or log on
    stdout. With --verbose the solver's log goes to stderr, and stdout is still the JSON alone."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("AUTOPAR_LOG", None)
    command = [sys.executable, "-m", "autopar", "plan", "gpt", "--mesh", "2x2", "--cluster", "cpu", "--json"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("{") and result.stdout.rstrip().endswith("}")
    assert json.loads(result.stdout)["mesh"]["shape"] == [2, 2]
    assert "HiGHS" not in result.stdout + result.stderr
    result = subprocess.run(command + ["--verbose"], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["mesh"]["shape"] == [2, 2]
    assert "HiGHS" in result.stderr


def test_help_loads_no_torch():
    """`autopar --help` is fast because it imports no torch (timed in benchmarks/bench_cli_startup.py)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code = (
        "import sys, autopar\nfrom autopar.cli import main\n"
        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'help imported torch'\n"
        "from autopar import Plan, plan, compile, hand_plan, InfeasibleError, checkpoint, optim\n"
        "assert autopar.Plan is Plan and autopar.compile is compile and callable(plan)\n"
        "assert set(autopar.__all__) <= set(dir(autopar))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "MODEL_SPEC" in result.stdout


def test_help_names_equal_the_zoo_and_cluster_lists():
    from autopar.cli import catalog
    from autopar.cost.cluster import DEFAULT_PRESET, preset_names
    from autopar.zoo.models import MODEL_NAMES
    from autopar.zoo.shapes import PRESETS

    assert catalog.MODEL_NAMES == MODEL_NAMES
    assert tuple(PRESETS) == catalog.MODEL_PRESETS
    assert catalog.DEFAULT_CLUSTER == DEFAULT_PRESET
    assert catalog.cluster_presets() == preset_names()


def test_check_numerics_runs_every_rank_against_eager(capsys, plans):
    code, out, err = _run(capsys, "check", str(plans["gpt2_cpu"]), "--numerics")
    assert code == 0, err
    assert out.startswith("OK: mesh (2,):") and "loss" in out and "compared with eager" in out
    code, out, err = _run(capsys, "check", str(plans["gpt2_cpu"]), "--numerics", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] is True and data["first_bad"] is None and data["num_nodes"] > 20
    # A plan for a published shape on the meta device holds no values to compare.
    code, out, err = _run(capsys, "check", str(plans["gpt4_cpu"]), "--numerics")
    assert code != 0 and "meta device" in err


def test_plan_checkpointing_policy(capsys):
    code, out, err = _run(capsys, "plan", "gpt", "--mesh", "1", "--cluster", "cpu", "--json", "--checkpointing", "selective")
    assert code == 0, err
    segments = json.loads(out)["memory"]["checkpoint"]
    assert segments and {s["policy"] for s in segments} == {"selective"}
    code, out, err = _run(capsys, "plan", "gpt", "--mesh", "1", "--cluster", "cpu", "--json", "--checkpointing", "selective-op")
    assert code == 0, err
    assert {s["policy"] for s in json.loads(out)["memory"]["checkpoint"]} == {"selective-op"}
    code, out, err = _run(capsys, "plan", "gpt", "--mesh", "1", "--checkpointing", "some")
    assert code != 0 and "auto, off, selective, selective-op, full" in err
