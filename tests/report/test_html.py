"""The HTML report: self-contained, and rendered by a real headless Chromium."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import pytest

import autopar
from autopar.ir.prediction import Prediction
from autopar.report.html import layer_rows, render_html, time_breakdown, write_html
from autopar.zoo.models import build_model, example_batch

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def sharded_plan():
    # A budget that forces some weights to be sharded, so the graph has more than one color.
    model = build_model("mlp", seed=0, d_hidden=256)
    return autopar.plan(model, (2, 2), example_inputs=example_batch("mlp", 32), cluster="h100-80g", memory_budget=600_000)


def test_layer_rows_collapse_repeated_layers():
    plan = autopar.plan(build_model("gpt", seed=0), (2,), example_inputs=example_batch("gpt", 8), cluster="cpu")
    rows = layer_rows(plan)
    names = [row["name"] for row in rows]
    assert "transformer.h.*.attn.q_proj" in names and "transformer.h.0.attn.q_proj" not in names
    assert next(r for r in rows if r["name"] == "transformer.h.*.attn.q_proj")["count"] == 2
    assert sum(len(r["params"]) * r["count"] for r in rows) == len(plan.params)
    assert names.index("transformer.wte") < names.index("transformer.h.*.attn.q_proj") < names.index("lm_head")


def test_page_is_self_contained(sharded_plan):
    page = render_html(sharded_plan)
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page), "the page must fetch nothing"
    assert "<link" not in page and "@import" not in page
    for row in layer_rows(sharded_plan):
        assert row["name"] in page
    specs = {spec for row in layer_rows(sharded_plan) for _, spec in row["params"]}
    assert len(specs) > 1, "the budget should shard some weight"
    labels = [label for label, _ in time_breakdown(sharded_plan)]
    assert labels[0].startswith("compute") and labels[-1] == "pipeline bubble"


def test_per_axis_and_timeline_keys_are_used_when_present(sharded_plan):
    import dataclasses

    predicted = Prediction.from_json(
        {
            **sharded_plan.predicted.to_json(),
            "comm_s_per_axis": [1e-4, 2e-4],
            "comm_bytes_per_axis": {"0": 4096, "1": 2 * 2**20},
            "memory_timeline_bytes": [10, 30, 20],
        }
    )
    # Without a recorded timeline (plans made before it was), the predicted keys are used.
    plan = dataclasses.replace(sharded_plan, predicted=predicted, memory_timeline=None)
    labels = [label for label, _ in time_breakdown(plan)]
    assert "communication axis 0" in labels and "communication axis 1" in labels
    page = render_html(plan)
    assert 'id="memory-timeline"' in page
    assert "<td>axis 1</td><td>2.00 MiB</td>" in page
    assert 'id="memory-timeline"' not in render_html(dataclasses.replace(sharded_plan, memory_timeline=None))


def test_memory_timeline_by_kind_with_the_peak(sharded_plan):
    timeline = sharded_plan.memory_timeline
    assert timeline is not None and timeline["times"] == sorted(timeline["times"])
    assert timeline["peak_time"] in timeline["times"]
    assert {"param", "grad", "optimizer_state"} <= set(timeline["kinds"])
    totals = [sum(row) for row in timeline["bytes"]]
    assert max(totals) == pytest.approx(sharded_plan.predicted.peak_memory_bytes, rel=1e-6, abs=len(timeline["kinds"]))
    assert totals[timeline["times"].index(timeline["peak_time"])] == max(totals)
    assert timeline["peak_at"] == sharded_plan.predicted.peak_memory_at
    page = render_html(sharded_plan)
    assert 'id="memory-timeline"' in page and 'id="memory-peak"' in page
    assert page.count('class="memory-kind"') == len(timeline["kinds"])
    assert ">forward<" in page and ">backward<" in page


def test_pipeline_stages_are_drawn(sharded_plan):
    import dataclasses

    from autopar.ir.pipeline import Stage, StagePlan

    stages = tuple(Stage(i, (i, i + 1), (), (2 * i, 2 * i + 1), 1e-3 * (i + 1), 2**20 * (2 - i)) for i in range(2))
    pipeline = StagePlan(4, "1F1B", (1, 2), stages, 5e-3, 0.2)  # sharded_plan is on (2, 2)
    page = render_html(dataclasses.replace(sharded_plan, pipeline=pipeline))
    assert 'id="pipeline-stages"' in page and page.count('class="stage-bar"') == 4
    assert "2.00 MiB" in page and "2.0000 ms" in page


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_chromium_renders_the_layer_names(sharded_plan, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium); .ci/run installs it")
    page = tmp_path / "report.html"
    write_html(sharded_plan, str(page))
    flags = CHROMIUM_FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]
    shot = tmp_path / "report.png"
    subprocess.run(
        [browser, *flags, f"--screenshot={shot}", "--window-size=900,1200", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    width, height = _png_size(shot.read_bytes())
    assert (width, height) == (900, 1200)
    assert shot.stat().st_size > 10_000, "a blank page compresses to almost nothing"
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    rows = layer_rows(sharded_plan)
    # The page's script counts the layer labels with a non-empty box after layout.
    drawn = re.search(r'data-layers-drawn="(\d+)/(\d+)"', dom)
    assert drawn, "the page's script did not run"
    assert int(drawn.group(1)) == int(drawn.group(2)) == len(rows)
    for row in rows:
        assert row["name"] in dom
    # The memory timeline: every kind's area has a non-empty box, and the peak line is drawn.
    memory = re.search(r'data-memory-drawn="(\d+)/(\d+)( peak)?"', dom)
    assert memory, "the page's script did not measure the memory timeline"
    assert int(memory.group(1)) == int(memory.group(2)) == len(sharded_plan.memory_timeline["kinds"]) > 0
    assert memory.group(3) == " peak"
