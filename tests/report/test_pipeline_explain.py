"""``autopar explain plan.json`` on a pipelined plan: its schedule, stages, microbatches and bubble."""

from __future__ import annotations

import json

import pytest

from autopar.cli.main import main


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    path = tmp_path_factory.mktemp("plans") / "gpt_pp.json"
    assert (
        main(["plan", "gpt", "--mesh", "4", "--pipeline", "2", "--num-microbatches", "4", "--cluster", "cpu", "--out", str(path)])
        == 0
    )
    return path


def test_explain_a_pipelined_plan(capsys, pipelined):
    capsys.readouterr()
    assert main(["explain", str(pipelined)]) == 0
    out = capsys.readouterr().out
    plan = json.loads(pipelined.read_text())["pipeline"]
    assert out.startswith("explain pipeline  mesh=(4,)")
    assert "schedule 1F1B: 2 rank groups" in out and "stage mesh (2,)" in out and "4 microbatches per step" in out
    assert f"bubble {plan['bubble_fraction']:.1%}" in out and "warm-up and drain" in out
    assert "with 8 microbatches" in out, "1F1B's bubble shrinks with more microbatches: say by how much"
    assert f"why: {plan['reason']}" in out
    predicted = json.loads(pipelined.read_text())["predicted"]
    assert f"predicted step {predicted['step_time_s'] * 1e3:.4f} ms: the schedule's {plan['step_time_s'] * 1e3:.4f} ms" in out
    assert f"then the optimizer step's {predicted['optimizer_s'] * 1e3:.4f} ms" in out
    assert f"{predicted['step_time_s']:.4g} s per step" in plan["reason"], "the search compares whole steps"
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [row[:2] for row in rows] == [["0", "0"], ["1", "1"]] and [row[-1] for row in rows] == ["no", "no"]

    assert main(["explain", str(pipelined), "pipeline", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["schedule"] == "1F1B" and record["num_microbatches"] == 4 and record["rank_groups"] == 2
    assert record["bubble_with_twice_the_microbatches"] < record["bubble_fraction"]
    assert [s["ranks"] for s in record["stages"]] == [[0, 1], [2, 3]]


def test_explain_a_node_of_a_pipelined_plan_points_to_the_pipeline(capsys, pipelined):
    assert main(["explain", str(pipelined), "embedding"]) != 0
    assert f"`autopar explain {pipelined}` explains its schedule" in capsys.readouterr().err


def test_explain_says_when_the_stages_hold_their_gathered_parameters(capsys, pipelined, tmp_path):
    capsys.readouterr()
    assert main(["explain", str(pipelined)]) == 0
    assert "hold_gathered" not in capsys.readouterr().out
    data = json.loads(pipelined.read_text())
    data["pipeline"]["hold_gathered"] = True
    held = tmp_path / "held.json"
    held.write_text(json.dumps(data))
    assert main(["explain", str(held)]) == 0
    assert "gather the parameters they shard once a step and hold them" in capsys.readouterr().out
    assert main(["explain", str(held), "pipeline", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hold_gathered"] is True


def test_the_step_line_says_what_of_the_gradient_sync_the_backward_does_not_hide():
    from autopar.report.pipeline_explain import _sync_words

    assert _sync_words(None, None) == ""
    assert _sync_words(0.002, 0.002) == " (gradient sync 2.0000 ms of it)"  # one stage a rank group: all of it
    assert _sync_words(0.002, 0.0005) == " (gradient sync 2.0000 ms, 0.5000 ms of it after the last backward)"
