"""Colossal-AI's ``parallel`` config: its checks, its meshes, and the placements of its layers."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cli.main import main
from autopar.ir.spec import SS
from autopar.solver.planners.colossal import ColossalParallel, colossal_specs
from autopar.solver.planners.hand_plans import param_specs
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch

R = Replicate()


def _config(world=None, **parallel) -> ColossalParallel:
    return ColossalParallel.from_dict(parallel, world)


@pytest.mark.parametrize(
    "parallel, message",
    [
        (dict(tensor=dict(mode="2d", size=8)), "mode '2d' needs size = q²"),
        (dict(tensor=dict(mode="3d", size=9)), "mode '3d' needs size = q³"),
        (dict(tensor=dict(mode="2.5d", size=8, depth=3)), "mode '2.5d' needs size = depth · q²"),
        (dict(tensor=dict(mode="2.5d", size=18, depth=3)), "mode '2.5d' needs size = depth · q²"),
        (dict(tensor=dict(mode="2d", size=4, depth=2)), "depth is for mode '2.5d' only"),
        (dict(tensor=dict(mode="4d", size=4)), "tensor mode must be one of 1d, 2d, 2.5d, 3d"),
        (dict(tensor=dict(mode="2d", size=4), sequence=2), "unknown keys ['sequence']"),
        (dict(pipeline=0), "pipeline must be a positive int"),
        (dict(tensor=dict(mode="2d", size=4, degree=2)), "unknown tensor keys ['degree']"),
    ],
)
def test_config_errors_name_the_rule(parallel, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _config(**parallel)


def test_world_must_be_pipeline_times_tensor_times_data():
    with pytest.raises(ValueError, match=r"world of 6 ranks must be pipeline \(2\) × tensor size \(4\)"):
        _config(6, pipeline=2, tensor=dict(mode="2d", size=4))
    with pytest.raises(ValueError, match="data"):
        _config(16, pipeline=2, tensor=dict(mode="2d", size=4), data=4)


@pytest.mark.parametrize(
    "parallel, world, mesh, stage",
    [
        (dict(pipeline=2, tensor=dict(mode="2.5d", depth=1, size=4)), None, (4, 2), (2, 2)),  # the seed's example
        (dict(tensor=dict(mode="2d", size=4)), None, (2, 2), (2, 2)),
        (dict(tensor=dict(mode="2.5d", depth=2, size=8)), None, (2, 2, 2), (2, 2, 2)),
        (dict(tensor=dict(mode="3d", size=8)), None, (2, 2, 2), (2, 2, 2)),
        (dict(tensor=dict(mode="1d", size=4)), 8, (2, 4), (2, 4)),
        (dict(tensor=dict(mode="2d", size=4)), 16, (4, 2, 2), (4, 2, 2)),
        (dict(pipeline=dict(size=2), tensor=dict(mode="2d", size=4)), 16, (4, 2, 2), (2, 2, 2)),
    ],
)
def test_mesh_puts_pipeline_outermost_and_tensor_innermost(parallel, world, mesh, stage):
    config = _config(world, **parallel)
    assert config.mesh_shape() == mesh and config.stage_mesh() == stage
    assert config.world_size == (world or config.pipeline * config.size)


def _traced(fused_qkv: bool = False):
    model = build_model("gpt", seed=0, n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=8, fused_qkv=fused_qkv)
    return trace(model, example_batch("gpt", 8, seed=1, vocab_size=64, block_size=8))


def _by_fqn(traced, specs):
    return {gi.fqn: specs[gi.name] for gi in traced.placeholders("param")}


def test_2d_and_2p5d_place_linears_as_summa():
    traced = _traced()
    specs = _by_fqn(traced, colossal_specs(_config(tensor=dict(mode="2d", size=4)), traced))
    # torch's (out, in) weight: in over the row index, out over the col index; vectors over col.
    assert specs["transformer.h.0.mlp.c_fc.weight"] == (Shard(1), Shard(0))
    assert specs["transformer.h.0.mlp.c_proj.weight"] == (Shard(1), Shard(0))
    assert specs["transformer.h.0.mlp.c_fc.bias"] == (R, Shard(0))
    assert specs["transformer.h.0.ln_1.weight"] == (R, Shard(0))
    specs = _by_fqn(traced, colossal_specs(_config(tensor=dict(mode="2.5d", depth=2, size=8)), traced))
    assert specs["transformer.h.0.attn.q_proj.weight"] == (R, Shard(1), Shard(0))  # copied over depth


def test_a_fused_qkv_is_split_by_head():
    traced = _traced(fused_qkv=True)
    forced = colossal_specs(_config(tensor=dict(mode="2d", size=4)), traced)
    specs = _by_fqn(traced, forced)
    assert specs["transformer.h.0.attn.c_attn.weight"] == (Shard(1), SS(0, 3))
    assert specs["transformer.h.0.attn.c_attn.bias"] == (R, SS(0, 3))
    qkv = next(n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    assert forced[qkv.name] == (Shard(0), SS(2, 3))


def test_3d_swaps_input_and_output_groups_between_linears():
    traced = _traced()
    config = _config(tensor=dict(mode="3d", size=8))  # axes: weight, input, output
    forced = colossal_specs(config, traced)
    specs = _by_fqn(traced, forced)
    assert specs["transformer.h.0.mlp.c_fc.weight"] == (Shard(1), Shard(0), Shard(1))
    assert specs["transformer.h.0.mlp.c_proj.weight"] == (Shard(1), Shard(1), Shard(0))
    assert specs["transformer.h.0.mlp.c_fc.bias"] == (R, Shard(0), R)
    assert specs["transformer.h.0.mlp.c_proj.bias"] == (R, R, Shard(0))
    # The residual stream: batch over the weight and input groups, hidden over the output group.
    adds = [n.name for n in traced.gm.graph.nodes if n.target == torch.ops.aten.add.Tensor and n.name in forced]
    assert adds and all(forced[name] == (Shard(0), Shard(0), Shard(2)) for name in adds)


def test_1d_is_megatron():
    traced = _traced()
    config = _config(8, tensor=dict(mode="1d", size=4))
    specs = colossal_specs(config, traced)
    megatron = param_specs("megatron", traced, config.mesh_shape())
    assert {name: specs[name] for name in megatron} == megatron


def test_a_batch_the_grid_cannot_split_is_an_error():
    model = build_model("gpt", seed=0, n_layer=1, n_embd=32, n_head=4, vocab_size=64, block_size=8)
    with pytest.raises(ValueError, match="must divide by 4"):
        autopar.hand_plan(
            "colossal",
            model,
            example_inputs=example_batch("gpt", 2, seed=1, vocab_size=64, block_size=8),
            parallel=dict(tensor=dict(mode="3d", size=8)),
            cluster="cpu",
        )
    with pytest.raises(ValueError, match="needs parallel=dict"):
        autopar.hand_plan("colossal", model, 4)


def test_cli_plans_a_colossal_config_and_compares_it_with_the_solver(tmp_path, capsys):
    config = tmp_path / "config.py"
    config.write_text("parallel = dict(tensor=dict(mode='2d', size=4))\n")
    out = tmp_path / "plan.json"
    assert (
        main(["plan", "gpt", "--num-layers", "1", "--colossal-config", str(config), "--cluster", "cpu", "--out", str(out)]) == 0
    )
    text = capsys.readouterr().out
    assert "vs the solver's plan" in text and "Colossal-AI's layout: predicted step" in text
    plan = autopar.Plan.load(out)
    assert plan.mesh_shape == (2, 2)
    assert plan.params["transformer.h.0.mlp.c_fc.weight"] == (Shard(1), Shard(0))
    solver_path = tmp_path / "solver.json"
    assert main(["plan", "gpt", "--num-layers", "1", "--mesh", "2x2", "--cluster", "cpu", "--out", str(solver_path)]) == 0
    capsys.readouterr()
    assert main(["diff", str(out), str(solver_path)]) == 0
    assert "b on mesh (2, 2)" in capsys.readouterr().out  # by how much and why the faster plan is faster
    (tmp_path / "bad.py").write_text("tensor = 4\n")
    assert main(["plan", "gpt", "--colossal-config", str(tmp_path / "bad.py")]) == 1
    assert "defines no parallel = dict(...)" in capsys.readouterr().err
