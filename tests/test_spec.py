"""Specs and resharding: every transition between every pair of specs, simulated on all ranks."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.rules.simulate import local_inputs
from autopar.spec import (
    Step,
    format_spec,
    is_valid,
    local_shape,
    parse_placement,
    parse_spec,
    transition_steps,
)


def _apply(step: Step, pieces: dict, mesh_shape) -> dict:
    """Run one step on every simulated rank (coordinates → local tensors)."""
    out = {}
    for coord in pieces:
        group = [coord[: step.axis] + (i,) + coord[step.axis + 1 :] for i in range(mesh_shape[step.axis])]
        members = [pieces[c] for c in group]
        mine = coord[step.axis]
        if step.kind == "all_reduce":
            out[coord] = sum(members[1:], members[0])
        elif step.kind == "all_gather":
            out[coord] = torch.cat(members, step.dim)
        elif step.kind == "chunk":
            out[coord] = pieces[coord].chunk(len(group), step.dim)[mine]
        elif step.kind == "reduce_scatter":
            out[coord] = sum(members[1:], members[0]).chunk(len(group), step.dim)[mine]
        elif step.kind == "all_to_all":
            out[coord] = torch.cat(members, step.src_dim).chunk(len(group), step.dim)[mine]
    return out


def _specs(ndim: int, num_axes: int, with_partial: bool):
    per_axis = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial()] if with_partial else [])
    return list(itertools.product(per_axis, repeat=num_axes))


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2), (2, 3)])
def test_every_transition_moves_the_right_data(mesh_shape):
    shape = (12, 6)
    tensor = torch.randn(shape, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for src in _specs(2, len(mesh_shape), True):
        if not is_valid(shape, src, mesh_shape):
            continue
        source = local_inputs(tensor, src, mesh_shape, generator)
        for dst in _specs(2, len(mesh_shape), False):
            if not is_valid(shape, dst, mesh_shape):
                continue
            steps = transition_steps(src, dst)
            assert steps is not None, f"{format_spec(src)} → {format_spec(dst)} should be possible"
            pieces = source
            for step in steps:
                pieces = _apply(step, pieces, mesh_shape)
            want = local_inputs(tensor, dst, mesh_shape, generator)
            for coord, piece in pieces.items():
                assert torch.allclose(piece, want[coord]), (
                    f"{format_spec(src)} → {format_spec(dst)} via {steps}: rank {coord} holds the wrong data"
                )
            checked += 1
    assert checked > 10


def test_nested_shard_resets_inner_axis_first():
    # (S(0), S(0)) → (R, S(0)): axis 1's chunks are nested inside axis 0's, so both move.
    steps = transition_steps((Shard(0), Shard(0)), (Replicate(), Shard(0)))
    assert [s.kind for s in steps] == ["all_gather", "all_gather", "chunk"]


def test_cheapest_single_collectives():
    assert transition_steps((Partial(),), (Replicate(),)) == (Step("all_reduce", 0),)
    assert transition_steps((Partial(),), (Shard(1),)) == (Step("reduce_scatter", 0, 1),)
    assert transition_steps((Shard(0),), (Shard(1),)) == (Step("all_to_all", 0, 1, 0),)
    assert transition_steps((Replicate(),), (Shard(0),)) == (Step("chunk", 0, 0),)
    assert transition_steps((Replicate(), Shard(0)), (Replicate(), Shard(0))) == ()


def test_into_partial_is_impossible():
    assert transition_steps((Replicate(),), (Partial(),)) is None
    assert transition_steps((Shard(0),), (Partial(),)) is None


def test_parse_and_format_round_trip():
    for text in ("R", "P", "S(0)", "S(12)"):
        assert format_spec((parse_placement(text),)) == [text]
    assert parse_spec(["S(1)", "R"]) == (Shard(1), Replicate())
    with pytest.raises(ValueError, match="unknown placement"):
        parse_placement("S(-1)")


def test_validity_and_local_shape():
    assert is_valid((8, 6), (Shard(0), Shard(0)), (2, 4))
    assert not is_valid((6, 6), (Shard(0), Shard(0)), (2, 4))
    assert not is_valid((8,), (Shard(1),), (2,))
    assert local_shape((8, 6), (Shard(0), Shard(1)), (2, 3)) == (4, 2)
