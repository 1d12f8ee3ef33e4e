"""The CLI's views: layouts equal across meshes, readable diffs, the grouped show, plain tables."""

from __future__ import annotations

import io
import json

import pytest

from autopar.cli import main
from autopar.cli.console import Table, emit, render
from autopar.cli.views import format_value, mesh_search_table, same_layout


def test_same_layout_across_mesh_shapes():
    assert same_layout(["R", "R"], (2, 2), ["R"], (4,))
    assert same_layout(["R"], (2,), ["R"], (8,))  # replicated means the same on any mesh
    assert same_layout(["S(0)", "S(0)"], (2, 2), ["S(0)"], (4,))
    assert same_layout(["R", "S(1)"], (1, 4), ["S(1)"], (4,))
    assert not same_layout(["S(0)", "R"], (2, 2), ["S(0)"], (4,))
    assert not same_layout(["S(0)", "S(1)"], (2, 2), ["S(0)"], (4,))
    assert not same_layout(["S(0)"], (2,), ["S(0)"], (4,))
    assert not same_layout(["P", "R"], (2, 2), ["R"], (4,))
    assert same_layout(None, (2,), None, (4,)) and not same_layout(["R"], (2,), None, (4,))


def test_plain_tables_fit_long_names():
    table = Table(
        "Operators",
        ("node", "op", "cost ms"),
        (
            ("scaled_dot_product_attention_1", "aten.scaled_dot_product_attention.default", "1.5000"),
            ("mm", "aten.mm.default", "12.2500"),
        ),
        right=frozenset({2}),
    )
    lines = render(table).splitlines()
    assert lines[0] == "Operators"
    # Every column starts at the same offset in every row, however long a name is.
    starts = {line.index("aten.") for line in lines[2:]}
    assert len(starts) == 1 and lines[1].index("op") == starts.pop()
    assert lines[2].endswith(" 1.5000") and lines[3].endswith("12.2500")
    out = io.StringIO()  # not a terminal: plain text, no escape codes
    emit(["head", table], out)
    assert "\x1b[" not in out.getvalue() and out.getvalue().startswith("head\n\nOperators\n")


def test_units_are_human_scaled():
    assert format_value("peak_memory_bytes", 3.4 * 2**20) == "3.4 MiB"
    assert format_value("comm_bytes_per_axis", [0, 2048]) == "[0 B, 2.0 KiB]"
    assert format_value("memory_at_peak_bytes", {"param": 2**30, "grad": 512}) == "param 1.0 GiB, grad 512 B"
    assert format_value("step_time_s", 0.0123) == "12.300 ms"
    rows = [
        {
            "mesh": [2, 2],
            "status": "ok",
            "step_time_s": 1e-3,
            "peak_memory_bytes": int(3.4 * 2**20),
            "plan_time_s": 1.0,
            "reason": "",
        },
        {
            "mesh": [4],
            "status": "infeasible",
            "step_time_s": None,
            "peak_memory_bytes": None,
            "plan_time_s": 2.0,
            "reason": "no plan",
        },
    ]
    text = render(mesh_search_table(rows))
    assert text.startswith("Mesh search (2 meshes)") and "3.4 MiB" in text and "0.00 GiB" not in text
    assert "<- chosen" in text.splitlines()[2] and "infeasible: no plan" in text


@pytest.fixture(scope="module")
def mlp_plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("views")
    paths = {mesh: folder / f"mlp_{mesh}.json" for mesh in ("2x2", "4")}
    for mesh, path in paths.items():
        assert main(["plan", "mlp", "--mesh", mesh, "--cluster", "cpu", "--out", str(path)]) == 0
    return paths


def test_diff_across_mesh_shapes_is_readable(capsys, mlp_plans):
    capsys.readouterr()
    assert main(["diff", str(mlp_plans["2x2"]), str(mlp_plans["4"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    a, b = (json.loads(p.read_text()) for p in (mlp_plans["2x2"], mlp_plans["4"]))
    assert data["mesh"] == {"a": [2, 2], "b": [4]}
    replicated = [fqn for fqn in a["params"] if set(a["params"][fqn]) == {"R"} and set(b["params"][fqn]) == {"R"}]
    assert replicated, "the mlp should replicate something on both meshes"
    assert not {row["fqn"] for row in data.get("params", [])} & set(replicated)  # (R, R) is (R)
    assert main(["diff", str(mlp_plans["2x2"]), str(mlp_plans["4"])]) == 0
    out = capsys.readouterr().out
    assert "mesh: (2, 2) -> (4,)" in out and "{" not in out and "'" not in out  # no raw dicts or lists


def test_show_leads_with_the_grouped_view(capsys, mlp_plans):
    capsys.readouterr()
    assert main(["show", str(mlp_plans["2x2"])]) == 0
    out = capsys.readouterr().out
    before_groups = out[: out.index("Parameter groups")]
    assert "layers.0.weight" not in before_groups and "Operators" not in before_groups
    assert main(["show", str(mlp_plans["2x2"]), "--all"]) == 0
    everything = capsys.readouterr().out
    assert everything.index("Parameter groups") < everything.index("Parameters (6)")
    assert "layers.0.weight" in everything[everything.index("Parameters (6)") :]
