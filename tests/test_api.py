"""The facades take their options whole: ``autopar.plan(model, mesh, options=PlanOptions(...))``
plans as the keywords do, a keyword beside ``options`` must agree with it, and ``compile`` and
``hand_plan`` take the same value."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch.distributed as dist

import autopar
from autopar.ir import options as ir_options
from autopar.zoo.models import build_model, example_batch

API = Path(__file__).resolve().parents[1] / "autopar" / "api.py"


@pytest.fixture(scope="module")
def mlp():
    return build_model("mlp", seed=0), example_batch("mlp", 8, seed=1)


def test_the_options_are_exported_whole():
    for name in ("PlanOptions", "SolveOptions", "MemoryOptions", "PipelineOptions", "CommOptions", "MixedPrecision"):
        assert getattr(autopar, name) is getattr(ir_options, name)
        assert name in autopar.__all__


def test_options_whole_plan_as_the_keywords_do(mlp):
    model, batch = mlp
    by_keywords = autopar.plan(model, (2,), example_inputs=batch, cluster="cpu", memory_budget=2e6, solver="highs")
    options = autopar.PlanOptions(solve=autopar.SolveOptions(solver="highs"), memory=autopar.MemoryOptions(budget=2e6))
    whole = autopar.plan(model, (2,), example_inputs=batch, cluster="cpu", options=options)
    assert whole.hash == by_keywords.hash
    assert whole.solver.memory_budget_bytes == by_keywords.solver.memory_budget_bytes == 2e6
    # a keyword that agrees with options is the same option given twice
    again = autopar.plan(model, (2,), example_inputs=batch, cluster="cpu", memory_budget="2MB", options=options)
    assert again.hash == whole.hash


@pytest.mark.parametrize(
    "keyword, field",
    [
        (dict(memory_budget=1e9), "options.memory.budget=2000000.0"),
        (dict(time_limit_s=5), "options.solve.time_limit_s=60.0"),
        (dict(precision="bf16-mixed"), "options.precision="),
        (dict(checkpointing=False), "options.memory.checkpointing=None"),
    ],
)
def test_a_keyword_that_disagrees_with_options_names_both(mlp, keyword, field):
    model, batch = mlp
    options = autopar.PlanOptions(memory=autopar.MemoryOptions(budget=2e6))
    with pytest.raises(ValueError) as info:
        autopar.plan(model, (2,), example_inputs=batch, cluster="cpu", options=options, **keyword)
    name = next(iter(keyword))
    assert f"{name}=" in str(info.value) and field in str(info.value) and "pass each option once" in str(info.value)


def test_options_must_be_plan_options(mlp):
    model, batch = mlp
    with pytest.raises(TypeError, match="options must be an autopar.PlanOptions"):
        autopar.plan(model, (2,), example_inputs=batch, cluster="cpu", options={"memory_budget": 1e9})


def test_hand_plan_takes_options_whole(mlp):
    model, batch = mlp
    by_keywords = autopar.hand_plan("fsdp", model, (2,), example_inputs=batch, cluster="cpu", precision="bf16-mixed")
    options = autopar.PlanOptions(precision="bf16-mixed", memory=autopar.MemoryOptions(checkpointing=False))
    whole = autopar.hand_plan("fsdp", model, (2,), example_inputs=batch, cluster="cpu", options=options)
    assert whole.hash == by_keywords.hash and whole.precision.name == "bf16-mixed"
    with pytest.raises(ValueError, match="prices one layout on one mesh"):
        autopar.hand_plan("fsdp", model, (2,), example_inputs=batch, options=autopar.PlanOptions(symbolic_batch=True))


def test_compile_takes_options_whole(mlp):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized")
    model, batch = mlp
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        options = autopar.PlanOptions(data=autopar.DataOptions(batch="per_rank"), precision="bf16-mixed")
        pm = autopar.compile(model, (1,), example_inputs=batch, cluster="cpu", options=options)
        assert pm.plan.data_layout.batch == "per_rank" and pm.plan.precision.name == "bf16-mixed"
        with pytest.raises(ValueError, match="symbolic_batch prices an offline plan"):
            autopar.compile(model, (1,), example_inputs=batch, options=autopar.PlanOptions(symbolic_batch=True))
        with pytest.raises(autopar.MeshError, match="not devices=2"):
            autopar.compile(model, (1,), example_inputs=batch, options=autopar.PlanOptions(devices=2))
        # beside a plan, options' own precision must agree with the plan's
        with pytest.raises(autopar.PlanError, match="contradicts the plan"):
            autopar.compile(model, (1,), example_inputs=batch, plan=pm.plan, options=autopar.PlanOptions(precision="bf16-true"))
    finally:
        dist.destroy_process_group()


def test_api_is_the_facades_only():
    """``api.py`` checks arguments and calls down (issue #47): no planning, no runtime assembly."""
    tree = ast.parse(API.read_text())
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert {"plan", "compile", "hand_plan"} <= functions and len(functions) <= 4, functions
    assert len(API.read_text().splitlines()) < 300
