"""Plan JSON: round trips, summaries, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.zoo.models import build_model, example_batch


@pytest.fixture(scope="module")
def gpt_plan(gpt_plan_2x2) -> autopar.Plan:
    return gpt_plan_2x2


def test_json_round_trip_is_exact(gpt_plan, tmp_path):
    path = tmp_path / "plan.json"
    gpt_plan.save(path)
    loaded = autopar.Plan.load(path)
    assert loaded.to_json() == gpt_plan.to_json()
    assert loaded == gpt_plan
    assert loaded.hash == gpt_plan.hash


def test_required_keys(gpt_plan):
    data = json.loads(gpt_plan.to_json())
    assert data["version"] == 1
    assert data["mesh"]["shape"] == [2, 2]
    assert set(data["predicted"]) >= {"step_time_s", "peak_memory_bytes", "comm_bytes"}
    assert data["params"]["transformer.wte.weight"] == data["params"]["lm_head.weight"], "tied weights share a spec"
    linear = next(node for node in data["nodes"].values() if node["op"] == "aten.linear.default")
    assert {"op", "out", "in"} <= set(linear)


def test_summary_lists_params_ops_and_fallbacks(gpt_plan):
    text = gpt_plan.summary()
    assert "predicted step time" in text
    assert "transformer.h.0.attn.q_proj.weight" in text
    assert "aten.scaled_dot_product_attention.default" in text
    assert "Fallbacks" in text


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(version=99), "version"),
        (lambda d: d.pop("nodes"), "malformed plan"),
        (lambda d: d["params"].update({"x": ["S(a)"]}), "unknown placement|malformed"),
        (lambda d: d["params"].update({"x": ["R", "R", "R"]}), "placements"),
    ],
)
def test_malformed_plans_are_refused(gpt_plan, mutate, message):
    data = json.loads(gpt_plan.to_json())
    mutate(data)
    with pytest.raises(PlanError, match=message):
        autopar.Plan.from_json(json.dumps(data))


def test_not_json_and_missing_file(tmp_path):
    with pytest.raises(PlanError, match="not valid JSON"):
        autopar.Plan.from_json("{nope")
    with pytest.raises(PlanError, match="does not exist"):
        autopar.Plan.load(tmp_path / "missing.json")


def test_plan_for_another_graph_or_mesh_is_refused(gpt_plan):
    from autopar.passes import check_plan_matches
    from autopar.trace import trace

    model = build_model("gpt", seed=0)
    traced = trace(model, example_batch("gpt", 8, seed=1))
    check_plan_matches(gpt_plan, traced, (2, 2))
    with pytest.raises(PlanError, match="mesh"):
        check_plan_matches(gpt_plan, traced, (4,))
    other = trace(model, example_batch("gpt", 4, seed=1))
    with pytest.raises(PlanError, match="different graph"):
        check_plan_matches(gpt_plan, other, (2, 2))


def test_bad_mesh_is_a_clear_error():
    model = build_model("mlp", seed=0)
    for mesh in [(0, 2), (-1,), (), "2x4"]:
        with pytest.raises(autopar.MeshError, match="positive ints"):
            autopar.plan(model, mesh, example_inputs=example_batch("mlp", 8))


def test_compile_without_process_group_is_a_clear_error():
    model = build_model("mlp", seed=0)
    with pytest.raises(autopar.MeshError, match="initialized process group"):
        autopar.compile(model, (2,), example_inputs=example_batch("mlp", 8))


def test_schema_ships_and_accepts_real_plans(gpt_plan):
    import jsonschema

    from autopar.ir.plan import SCHEMA_PATH, plan_schema

    assert SCHEMA_PATH.parent.parent.name == "autopar" and SCHEMA_PATH.is_file()  # autopar/ir/plan.schema.json
    jsonschema.Draft202012Validator.check_schema(plan_schema())
    data = json.loads(gpt_plan.to_json())
    jsonschema.validate(data, plan_schema())
    assert data["decisions"], "a solved plan explains its decisions"


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda d: d["mesh"].update(shape=[2, 0]), "mesh/shape/1"),
        (lambda d: d["params"].update({"x": ["R", "X"]}), "params/x/1"),
        (lambda d: next(iter(d["nodes"].values())).pop("out"), "nodes/"),
        (lambda d: d.update(graph_hash=7), "graph_hash"),
        (lambda d: next(iter(d["decisions"].values())).update(binding="luck"), "decisions/"),
    ],
)
def test_schema_errors_say_where(gpt_plan, mutate, where):
    data = json.loads(gpt_plan.to_json())
    mutate(data)
    with pytest.raises(PlanError, match="malformed plan") as info:
        autopar.Plan.from_json(json.dumps(data))
    assert where in str(info.value) and "re-plan" in str(info.value)


def test_plan_from_another_torch_is_refused(gpt_plan):
    import dataclasses

    from autopar.passes import check_plan_matches
    from autopar.trace import trace

    traced = trace(build_model("gpt", seed=0), example_batch("gpt", 8, seed=1))
    old = dataclasses.replace(gpt_plan, torch_version="1.13.0")
    with pytest.raises(PlanError, match=r"torch 1\.13\.0.*re-plan"):
        check_plan_matches(old, traced, (2, 2))


def test_graph_hash_ignores_the_device():
    # A plan made on the meta device applies to the model on its real device.
    from autopar.trace import trace

    real = trace(build_model("llama", seed=0), example_batch("llama", 2))
    with torch.device("meta"):
        model = build_model("llama", seed=0)
    meta_inputs = tuple(torch.empty_like(t, device="meta") for t in example_batch("llama", 2))
    assert trace(model, meta_inputs).graph_hash == real.graph_hash


def test_memory_timeline_round_trips_and_the_schema_checks_it(gpt_plan):
    from autopar.ir.plan import Plan, validate_plan_json

    timeline = gpt_plan.memory_timeline
    assert timeline is not None and timeline["peak_at"] == gpt_plan.predicted.peak_memory_at
    assert len(timeline["bytes"]) == len(timeline["times"]) and all(len(r) == len(timeline["kinds"]) for r in timeline["bytes"])
    again = Plan.from_json(gpt_plan.to_json())
    assert again.memory_timeline == timeline and again.hash == gpt_plan.hash
    data = json.loads(gpt_plan.to_json())
    data["memory_timeline"]["times"] = "not a list"
    with pytest.raises(PlanError, match="memory_timeline"):
        validate_plan_json(data)


def test_memory_summary_leaves_out_decisions_that_save_nothing():
    from autopar.ir.memory import CheckpointSegment, MemoryPlan, OffloadEntry

    memory = MemoryPlan(
        "disk",
        True,
        checkpoint=(CheckpointSegment("h.0", "a", "b", 3.4 * 2**20, 1e-3), CheckpointSegment("h.1", "c", "d", 0.0, 1e-3)),
        offload=(OffloadEntry("grad", "w", 0.0, 0.0, 0.0),),
        peak_before_bytes=2**30,
        peak_bytes=2**29,
        added_s=1e-3,
    )
    lines = memory.summary_lines()
    assert lines[0].startswith("memory decisions: peak 1.0 GiB -> 512.0 MiB")
    assert "checkpoint h.0 (a .. b): saves 3.4 MiB" in lines[1]
    assert not any("saves 0" in line for line in lines)
    assert lines[-1] == "  (2 more decisions that save nothing at the peak)"


def test_precision_policies_are_checked_values():
    import torch

    from autopar.ir.options import PRECISIONS, MixedPrecision, precision_policy

    assert precision_policy(None) is PRECISIONS["32-true"]
    mixed = precision_policy("bf16-mixed")
    assert (mixed.param_dtype, mixed.master_dtype, mixed.reduce_dtype, mixed.optimizer_dtype, mixed.casts) == (
        "bfloat16",
        "float32",
        "float32",
        "float32",
        True,
    )
    assert not precision_policy("bf16-true").casts and not precision_policy("32-true").casts
    custom = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, master_dtype=torch.float32)
    assert custom.reduce_dtype == "bfloat16" and MixedPrecision.from_json(custom.to_json()) == custom
    with pytest.raises(ValueError, match="precision must be one of"):
        precision_policy("fp8")
    with pytest.raises(ValueError, match="precision dtypes"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(ValueError, match="needs a param_dtype"):
        MixedPrecision(master_dtype="float32")


def test_the_optimizer_dtype_is_the_stored_dtype_or_refused():
    """Torch's optimizers keep their state in the dtype of what they step: a policy that names
    another optimizer dtype would be priced and recorded for state nothing keeps."""
    from autopar.errors import ConfigError
    from autopar.ir.options import PRECISIONS, MixedPrecision

    assert PRECISIONS["32-true"].optimizer_dtype is None  # the model's own, as its parameters
    assert PRECISIONS["bf16-true"].optimizer_dtype == "bfloat16"
    assert MixedPrecision("bfloat16", "float32", "float32", "float32").optimizer_dtype == "float32"
    for wrong, stored in (
        (MixedPrecision, "the model's own dtype"),  # "32-true" with float32 state named
        (lambda **kw: MixedPrecision("bfloat16", **kw), "bfloat16"),  # bf16 weights, no master copy
    ):
        with pytest.raises(ConfigError, match=f"stores parameters in {stored}.*master_dtype='float32'"):
            wrong(optimizer_dtype="float32")
    # A plan written before recorded "float32" whatever the state took: it loads as what it was.
    old = {"name": "32-true", "param_dtype": None, "reduce_dtype": None, "master_dtype": None, "optimizer_dtype": "float32"}
    assert MixedPrecision.from_json(old) == PRECISIONS["32-true"]
    assert MixedPrecision.from_json(PRECISIONS["bf16-mixed"].to_json()) == PRECISIONS["bf16-mixed"]


def _edited(gpt_plan, edit) -> str:
    data = json.loads(gpt_plan.to_json())
    edit(data)
    return json.dumps(data)


def _set_node_out(name: str, placements: list[str]):
    def edit(data):
        data["nodes"][name]["out"][0] = placements

    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda d: d["params"].update({"transformer.h.0.attn.q_proj.weight": ["S(5)", "R"]}),
            r"parameter 'transformer.h.0.attn.q_proj.weight' has placements \(S\(5\), R\), which shards dim 5 of a 2-dim tensor",
        ),
        (
            _set_node_out("p_transformer_h_0_attn_q_proj_weight", ["R", "S(5)"]),
            r"node 'p_transformer_h_0_attn_q_proj_weight' \(param\), output 0 has placements \(R, S\(5\)\)",
        ),
        (
            _set_node_out("p_transformer_h_0_attn_q_proj_weight", ["S(0)/7", "R"]),
            r"cuts dim 0 \(size 64\) into 7 blocks of 2 shards",
        ),
        (_set_node_out("p_transformer_h_0_attn_q_proj_weight", ["R"]), r"are 1 for a 2-axis mesh \(2, 2\)"),
    ],
)
def test_placements_that_cannot_hold_their_tensor_are_refused_naming_it(gpt_plan, edit, message, tmp_path):
    with pytest.raises(PlanError, match=message + r".*re-plan"):
        autopar.Plan.from_json(_edited(gpt_plan, edit))
    path = tmp_path / "edited.json"
    path.write_text(_edited(gpt_plan, edit))
    with pytest.raises(PlanError, match=f"plan file '{path}': invalid plan"):
        autopar.Plan.load(path)


def test_an_input_placement_is_checked_against_its_producers_shape(gpt_plan):
    data = json.loads(gpt_plan.to_json())
    name, node = next((n, v) for n, v in data["nodes"].items() if v["op"] == "aten.linear.default")
    node["in"][0] = ["S(9)", "R"]
    with pytest.raises(PlanError, match=f"node '{name}' \\(aten.linear.default\\), input 0 \\(from '{node['inputs'][0][0]}'\\)"):
        autopar.Plan.from_json(json.dumps(data))


def test_a_truncated_a_binary_and_a_folder_plan_file_name_the_file(gpt_plan, tmp_path):
    truncated = tmp_path / "truncated.json"
    truncated.write_text(gpt_plan.to_json()[:500])
    with pytest.raises(PlanError, match=f"plan file '{truncated}' is not valid JSON.*truncated.*re-plan"):
        autopar.Plan.load(truncated)
    binary = tmp_path / "plan.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(PlanError, match=f"plan file '{binary}' is not text"):
        autopar.Plan.load(binary)
    with pytest.raises(PlanError, match="is a directory"):
        autopar.Plan.load(tmp_path)


def test_memory_budgets_are_read_as_the_cli_reads_them():
    from autopar.cost.cluster import get_cluster, resolve_budget
    from autopar.ir.options import MemoryOptions

    assert MemoryOptions(budget="80GB").budget == 80e9
    assert MemoryOptions(budget="inf").budget == float("inf")
    assert resolve_budget("70GiB", get_cluster("cpu")) == 70 * 2**30
    with pytest.raises(ValueError, match="invalid memory budget 'lots'"):
        MemoryOptions(budget="lots")
