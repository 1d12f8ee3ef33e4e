"""Specs and resharding: every transition between every pair of specs, simulated on all ranks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.ir.spec import (
    REPLICATE_KEY,
    SS,
    STEP_KINDS,
    PlacementNumbers,
    Step,
    format_spec,
    is_valid,
    local_shape,
    parse_placement,
    parse_spec,
    placement_key,
    routes_between,
    slot_axis,
    spec_key,
    steps_between,
    strided_piece,
    transition_steps,
    unstride,
)
from autopar.rules.simulate import local_inputs


def _apply(step: Step, pieces: dict, mesh_shape) -> dict:
    """Run one step on every simulated rank (coordinates → local tensors)."""
    out = {}
    for coord in pieces:
        group = [coord[: step.axis] + (i,) + coord[step.axis + 1 :] for i in range(mesh_shape[step.axis])]
        members = [pieces[c] for c in group]
        mine = coord[step.axis]
        if step.kind == "all_reduce":
            out[coord] = sum(members[1:], members[0])
        elif step.kind == "all_gather" and step.blocks > 1:
            out[coord] = unstride(torch.cat(members, step.dim), step.dim, len(group), step.blocks)
        elif step.kind == "all_gather":
            out[coord] = torch.cat(members, step.dim)
        elif step.kind == "chunk" and step.blocks > 1:
            out[coord] = strided_piece(pieces[coord], step.dim, len(group), mine, step.blocks)
        elif step.kind == "chunk":
            out[coord] = pieces[coord].chunk(len(group), step.dim)[mine]
        elif step.kind == "reduce_scatter":
            out[coord] = sum(members[1:], members[0]).chunk(len(group), step.dim)[mine]
        elif step.kind == "all_to_all":
            out[coord] = torch.cat(members, step.src_dim).chunk(len(group), step.dim)[mine]
    return out


def _specs(ndim: int, num_axes: int, with_partial: bool, blocks: tuple[int, ...] = ()):
    per_axis = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial()] if with_partial else [])
    per_axis += [SS(d, n) for n in blocks for d in range(ndim)]
    return list(itertools.product(per_axis, repeat=num_axes))


@pytest.mark.parametrize(
    ("mesh_shape", "blocks"),
    [((2,), ()), ((2, 2), ()), ((2, 3), ()), ((2,), (2, 3)), ((2, 2), (2, 3)), ((2, 3), (2, 3)), ((2, 2, 2), ())],
)
def test_every_transition_moves_the_right_data(mesh_shape, blocks):
    shape = (12, 6)
    tensor = torch.randn(shape, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for src in _specs(2, len(mesh_shape), True, blocks):
        if not is_valid(shape, src, mesh_shape):
            continue
        source = local_inputs(tensor, src, mesh_shape, generator)
        for dst in _specs(2, len(mesh_shape), False, blocks):
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


def test_placements_compare_by_value_not_by_object():
    """Equal placements held by other objects are the same spec, and move the same way."""
    fresh = (Shard(0), Shard(1), Replicate())
    assert transition_steps((Shard(0), Shard(1), Replicate()), fresh) == ()
    src, dst = (Partial(), Shard(0), Shard(0)), (Replicate(), Shard(1), Shard(0))
    copies = tuple(parse_placement(text) for text in format_spec(src)), tuple(parse_placement(t) for t in format_spec(dst))
    # Axis 2 shards dim 0 inside axis 1, whose dim changes: both are gathered and cut again.
    assert (
        transition_steps(src, dst)
        == transition_steps(*copies)
        == (
            Step("all_gather", 2, 0),
            Step("all_gather", 1, 0),
            Step("all_reduce", 0),
            Step("chunk", 1, 1),
            Step("chunk", 2, 0),
        )
    )
    assert transition_steps((SS(0, 2), Shard(1)), (parse_placement("S(0)/2"), Replicate())) == (Step("all_gather", 1, 1),)
    assert transition_steps((SS(0, 2),), (SS(0, 3),)) == (Step("all_gather", 0, 0, -1, 2), Step("chunk", 0, 0, -1, 3))


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


def test_strided_shard_holds_each_ranks_chunk_of_every_block():
    # q, k, v blocks of 4 columns each, cut 2 ways: rank r holds q_r, k_r, v_r, as DTensor's
    # _StridedShard lays them out.
    fused = torch.arange(12).reshape(1, 12)
    pieces = [strided_piece(fused, 1, 2, rank, 3) for rank in range(2)]
    assert pieces[0].tolist() == [[0, 1, 4, 5, 8, 9]]
    assert pieces[1].tolist() == [[2, 3, 6, 7, 10, 11]]
    dtensor_pieces, _ = SS(1, 3)._split_tensor(fused, 2, with_padding=False)
    assert all(torch.equal(a, b) for a, b in zip(pieces, dtensor_pieces))
    assert torch.equal(unstride(torch.cat(pieces, 1), 1, 2, 3), fused)
    for q, k, v in (piece.split(2, dim=1) for piece in pieces):
        assert q.max() < 4 <= k.min() and k.max() < 8 <= v.min(), "each rank's split is its own q, k, v"


def test_strided_spelling_validity_and_steps():
    spec = parse_spec(["S(1)/3", "S(0)"])
    assert spec == (SS(1, 3), Shard(0)) and format_spec(spec) == ["S(1)/3", "S(0)"]
    assert local_shape((8, 24), spec, (2, 2)) == (4, 12)
    assert is_valid((8, 24), spec, (2, 2))
    assert not is_valid((8, 9), (SS(1, 3),), (2,)), "9 columns are not 3 blocks of 2 chunks"
    assert not is_valid((8, 24), (SS(1, 3), Shard(1)), (2, 2)), "a strided dim is cut on one axis only"
    assert transition_steps((SS(1, 3),), (Replicate(),)) == (Step("all_gather", 0, 1, blocks=3),)
    assert transition_steps((Replicate(),), (SS(1, 3),)) == (Step("chunk", 0, 1, blocks=3),)
    assert transition_steps((SS(1, 3),), (Partial(),)) is None
    with pytest.raises(ValueError, match="at least 2 blocks"):
        SS(0, 1)


def test_a_mesh_axis_of_size_one_carries_only_replicate():
    from autopar.ir.spec import is_valid, replicate_size_one_axes

    assert not is_valid((4, 4), (Shard(0), Replicate()), (1, 2))
    assert not is_valid((4, 4), (Partial(), Replicate()), (1, 2))
    assert is_valid((4, 4), (Replicate(), Shard(0)), (1, 2))
    assert replicate_size_one_axes((Shard(0), Shard(1)), (1, 2)) == (Replicate(), Shard(1))


@pytest.mark.parametrize("num_axes", [3, 4])
def test_routes_between_are_steps_between_with_the_placements_before_each(num_axes):
    """``routes_between`` (numpy, many pairs at once) takes ``steps_between``'s steps, in order,
    each from the placements the walk has reached: every pair of specs over R, P, shards and
    strided shards, valid or not, possible or not."""
    placements = [Replicate(), Partial(), Shard(0), Shard(1), SS(1, 2), SS(2, 3)]
    specs = list(itertools.product(placements, repeat=num_axes))[:: 3 if num_axes == 3 else 17]
    numbers = PlacementNumbers()
    rows = np.array([[numbers.number(placement_key(p)) for p in spec] for spec in specs], dtype=numbers.dtype)
    src, dst = (a.ravel() for a in np.meshgrid(np.arange(len(specs)), np.arange(len(specs)), indexing="ij"))
    routes = routes_between(rows[src], rows[dst], numbers)
    assert routes.kinds.shape == (2 * num_axes, len(src)) and not routes.possible.all()
    for k, (i, j) in enumerate(zip(src.tolist(), dst.tolist())):
        steps = steps_between(spec_key(specs[i]), spec_key(specs[j]))
        assert routes.possible[k] == (steps is not None)
        taken = [
            (STEP_KINDS[kind], slot_axis(slot, num_axes), before)
            for slot, (kind, before) in enumerate(zip(routes.kinds[:, k].tolist(), routes.before[:, k].tolist()))
            if kind
        ]
        now, expected = list(spec_key(specs[i])), []
        for step in steps or ():
            expected.append((step.kind, step.axis, sum(numbers.number(key) * routes.base**a for a, key in enumerate(now))))
            now[step.axis] = spec_key(specs[j])[step.axis] if step.kind not in ("all_reduce", "all_gather") else REPLICATE_KEY
        assert taken == expected, (specs[i], specs[j])


def test_is_valid_divides_each_dim_by_the_product_of_its_axes():
    """Per dim, the product of the sizes of the axes that cut it must divide it; a strided dim
    also its blocks times its axis, on that axis alone; only R on an axis of size 1."""
    import itertools
    import math

    from autopar.ir.spec import SS, is_sharded, is_strided

    shape, mesh = (12, 6, 8), (2, 3, 2, 1)
    placements = [Replicate(), Partial(), Shard(0), Shard(1), Shard(2), Shard(3), SS(0, 3), SS(1, 2), SS(2, 2)]
    for spec in itertools.product(placements, repeat=len(mesh)):
        cuts = [(axis, p.dim) for axis, p in enumerate(spec) if is_sharded(p)]
        strided = [(axis, p) for axis, p in enumerate(spec) if is_strided(p)]
        expected = (
            all(isinstance(p, Replicate) for p, n in zip(spec, mesh) if n == 1)
            and all(dim < len(shape) for _, dim in cuts)
            and all(size % math.prod(mesh[axis] for axis, d in cuts if d == dim) == 0 for dim, size in enumerate(shape))
            and all(
                shape[p.dim] % (p.split_factor * mesh[axis]) == 0 and sum(d == p.dim for _, d in cuts) == 1
                for axis, p in strided
                if p.dim < len(shape)
            )
        )
        assert is_valid(shape, spec, mesh) == expected, spec


# -- padded parameter shards (FSDP2's uneven dim 0) ----------------------------------------------


def test_a_padded_shard_is_dim_0_on_one_axis_that_does_not_divide_it():
    from autopar.ir.spec import is_valid_param, padded_axis

    assert padded_axis((64, 8), (Shard(0),), (3,)) == 0
    assert padded_axis((2, 8), (Shard(0),), (3,)) == 0, "shorter than the axis: some pieces are empty"
    assert padded_axis((1, 4), (Replicate(), Shard(0)), (2, 3)) == 1
    assert padded_axis((66, 8), (Shard(0),), (3,)) is None, "even: not padded"
    assert padded_axis((8, 64), (Shard(1),), (3,)) is None, "only dim 0 is padded, as FSDP2 shards it"
    assert padded_axis((64, 8), (Shard(0), Shard(0)), (2, 3)) is None, "one axis only"
    assert padded_axis((64, 9), (Shard(1), Shard(0)), (3, 3)) == 1, "beside an even cut of another dim (FSDP + TP)"
    assert padded_axis((64, 8), (Shard(1), Shard(0)), (3, 3)) is None, "the other dim's cut is even"
    assert padded_axis((64, 8), (SS(1, 2), Shard(0)), (2, 3)) is None, "beside plain shards only"
    assert padded_axis((64,), (SS(0, 2),), (3,)) is None
    assert not is_valid((64, 8), (Shard(0),), (3,)), "ops never see uneven specs"
    assert is_valid_param((64, 8), (Shard(0),), (3,)) and is_valid_param((66, 8), (Shard(0),), (3,))
    assert not is_valid_param((8, 64), (Shard(1),), (3,))


def test_padded_local_shape_is_the_padded_piece_and_each_rank_holds_torch_chunks_piece():
    from autopar.ir.spec import chunk_piece, piece_rows, piece_shape, shard_tensor

    assert local_shape((64, 8), (Shard(0),), (3,)) == (22, 8), "ceil(64 / 3): what collectives move"
    assert local_shape((2, 8), (Shard(0),), (3,)) == (1, 8)
    assert [piece_shape((64, 8), (Shard(0),), (r,), (3,)) for r in range(3)] == [(22, 8), (22, 8), (20, 8)]
    assert [piece_rows(2, 3, r) for r in range(3)] == [1, 1, 0]
    assert [piece_rows(7, 4, r) for r in range(4)] == [2, 2, 2, 1]
    assert [piece_rows(4, 3, r) for r in range(3)] == [2, 2, 0], "torch.chunk: ceil-sized pieces, then empty"
    for size, k in ((64, 3), (2, 3), (4, 3), (7, 4), (48, 5)):
        whole = torch.arange(size * 2).reshape(size, 2)
        pieces = [shard_tensor(whole, (Shard(0),), (r,), (k,)) for r in range(k)]
        assert [p.shape[0] for p in pieces] == [piece_rows(size, k, r) for r in range(k)]
        assert torch.equal(torch.cat(pieces), whole)
        chunks = whole.chunk(k)
        for r in range(k):
            expected = chunks[r] if r < len(chunks) else whole[:0]
            assert torch.equal(chunk_piece(whole, 0, k, r), expected)


def test_a_padded_shard_moves_only_by_one_gather_to_replicated():
    from autopar.ir.spec import padded_transition_ok

    assert padded_transition_ok((64, 8), (Shard(0),), (Replicate(),), (3,))
    assert not padded_transition_ok((64, 8), (Shard(0),), (Shard(1),), (3,)), "an all-to-all of uneven pieces"
    assert not padded_transition_ok((64, 9), (Replicate(), Shard(0)), (Shard(1), Replicate()), (3, 3))
    # beside another axis's cut: gathered on its own axis, the other axis as it is
    assert padded_transition_ok((64, 9), (Shard(1), Shard(0)), (Shard(1), Replicate()), (3, 3))
    assert not padded_transition_ok((64, 9), (Shard(1), Shard(0)), (Replicate(), Replicate()), (3, 3))
    assert padded_transition_ok((66, 8), (Shard(0),), (Shard(1),), (3,)), "even shards move freely"
