"""Simulation checks of the view rules (autopar/rules/views.py) on transformer-like shapes."""

from __future__ import annotations

import operator

import pytest
import torch

import autopar.rules  # noqa: F401  (registers every rule)
from autopar.ir.spec import P, R, S
from autopar.rules.registry import RULES
from autopar.rules.simulate import check_op
from autopar.rules.views import reshape_dim_map
from tests.conftest import strategy_text

aten = torch.ops.aten
MESHES = [(2,), (2, 2), (2, 4)]

torch.manual_seed(0)
X = torch.randn(8, 16, 32)
Y = torch.randn(8, 16, 32)
INTS = torch.randint(0, 99, (8, 16), dtype=torch.int32)  # small ints: no NaN bit patterns

CASES = {
    "view_split_heads": (aten.view.default, (X, [8, 16, 4, 8])),
    "view_merge_heads": (aten.view.default, (torch.randn(8, 16, 4, 8), [8, 16, 32])),
    "view_minus_one": (aten.view.default, (X, [-1, 32])),
    "view_bt_to_b_t": (aten.view.default, (torch.randn(64, 32), [4, 16, 32])),
    "view_reblock": (aten.view.default, (torch.randn(4, 6), [6, 4])),
    "view_size_one": (aten.view.default, (torch.randn(8, 1, 16), [8, 16, 1])),
    "unsafe_view": (aten._unsafe_view.default, (torch.randn(4, 16, 32), [64, 32])),
    "reshape_noncontiguous": (aten.reshape.default, (X.transpose(0, 1), [16, 256])),
    "flatten": (aten.flatten.using_ints, (torch.randn(2, 8, 4, 4), 1)),
    "unflatten": (aten.unflatten.int, (X, -1, [4, -1])),
    "squeeze_dim": (aten.squeeze.dim, (torch.randn(8, 1, 32), 1)),
    "squeeze_noop_dim": (aten.squeeze.dim, (torch.randn(8, 2, 32), 1)),
    "squeeze_dims": (aten.squeeze.dims, (torch.randn(1, 8, 1, 32), [0, 2])),
    "squeeze_all": (aten.squeeze.default, (torch.randn(1, 8, 1, 32),)),
    "unsqueeze": (aten.unsqueeze.default, (X, 1)),
    "view_as": (aten.view_as.default, (X, torch.randn(8, 16, 4, 8))),
    "view_dtype_same_size": (aten.view.dtype, (INTS, torch.float32)),
    "view_dtype_narrower": (aten.view.dtype, (INTS, torch.int16)),
    "permute": (aten.permute.default, (X, [2, 0, 1])),
    "transpose": (aten.transpose.int, (torch.randn(8, 16, 4, 8), 1, 2)),
    "t": (aten.t.default, (torch.randn(16, 32),)),
    "mT": (aten.mT.default, (X,)),
    "movedim": (aten.movedim.int, (X, 0, -1)),
    "expand_row": (aten.expand.default, (torch.randn(1, 16), [8, 16])),
    "expand_new_dims": (aten.expand.default, (torch.randn(16, 1), [4, 16, 8])),
    "expand_minus_one": (aten.expand.default, (torch.randn(8, 1, 32), [-1, 4, -1])),
    "expand_as": (aten.expand_as.default, (torch.randn(1, 16), torch.randn(8, 16))),
    "split_into_3": (aten.split.Tensor, (torch.randn(8, 16, 96), 32, 2)),
    "split_with_sizes": (aten.split_with_sizes.default, (X, [4, 12], 1)),
    "chunk": (aten.chunk.default, (X, 4, -1)),
    "unbind": (aten.unbind.int, (torch.randn(8, 3, 16), 1)),
    "cat": (aten.cat.default, ([X, Y], -1)),
    "cat_legacy_empty": (aten.cat.default, ([X, torch.randn(0)], 0)),
    "stack": (aten.stack.default, ([X, Y], 1)),
    "slice": (aten.slice.Tensor, (X, 1, 0, 3)),
    "slice_step": (aten.slice.Tensor, (X, 1, 2, 10, 2)),
    "slice_whole": (aten.slice.Tensor, (X, 0, 0, 9223372036854775807)),
    "select": (aten.select.int, (X, 0, 0)),
    "select_negative": (aten.select.int, (X, 1, -1)),
    "narrow": (aten.narrow.default, (X, 1, 2, 4)),
    "narrow_whole": (aten.narrow.default, (X, 1, 0, 16)),
    "slice_scatter": (aten.slice_scatter.default, (X, torch.randn(8, 15, 32), 1, 1)),
    "slice_scatter_step": (aten.slice_scatter.default, (X, torch.randn(8, 16, 8), 2, 0, 32, 4)),
    "slice_scatter_whole": (aten.slice_scatter.default, (X, Y, 0, 0, 9223372036854775807)),
    "select_scatter": (aten.select_scatter.default, (X, torch.randn(8, 32), 1, 0)),
    "select_scatter_negative": (aten.select_scatter.default, (X, torch.randn(16, 32), 0, -1)),
}


def _check(target, args, mesh):
    results = check_op(target, args, {}, mesh)
    bad = [f"{strategy_text(r.strategy, bracketed=True)}: {r.detail}" for r in results if not r.ok]
    assert not bad, f"{target} on mesh {mesh}: wrong strategies:\n" + "\n".join(bad)
    assert all(r.strategy.source == "rule" for r in results)
    return results


def _pairs(results) -> set[tuple[tuple, tuple]]:
    """(input placements, output placements) on a one-axis mesh, first input and output."""
    return {(r.strategy.ins[0], r.strategy.outs[0]) for r in results}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_strategy_is_exact(name, mesh):
    target, args = CASES[name]
    results = _check(target, args, mesh)
    replicated = tuple((R,) * len(mesh) for _ in results[0].strategy.ins)
    assert any(r.strategy.ins == replicated for r in results)


def test_view_keeps_head_and_batch_sharding():
    pairs = _pairs(_check(aten.view.default, (torch.randn(4, 16, 32), [4, 16, 4, 8]), (2,)))
    assert ((S(2),), (S(2),)) in pairs  # hidden dim → heads
    assert ((S(0),), (S(0),)) in pairs
    assert ((S(1),), (S(1),)) in pairs
    assert ((P,), (P,)) in pairs


def test_view_unmerges_tokens():
    # [B*T, C] → [B, T, C]: a shard of the merged dim is a shard of the batch.
    pairs = _pairs(_check(aten.view.default, (torch.randn(64, 32), [4, 16, 32]), (2,)))
    assert ((S(0),), (S(0),)) in pairs
    assert ((S(1),), (S(2),)) in pairs
    assert ((S(0),), (S(1),)) not in pairs


def test_flatten_merges_into_leading_dim():
    pairs = _pairs(_check(aten.flatten.using_ints, (torch.randn(2, 8, 4, 4), 1), (2,)))
    assert ((S(1),), (S(1),)) in pairs
    assert ((S(2),), (S(1),)) not in pairs


def test_transpose_and_permute_move_the_shard():
    pairs = _pairs(_check(aten.transpose.int, (torch.randn(8, 16, 4, 8), 1, 2), (2,)))
    assert ((S(1),), (S(2),)) in pairs and ((S(2),), (S(1),)) in pairs
    pairs = _pairs(_check(aten.permute.default, (X, [2, 0, 1]), (2,)))
    assert ((S(2),), (S(0),)) in pairs and ((S(0),), (S(1),)) in pairs


def test_expand_shards_broadcast_dim_of_replicated_input():
    pairs = _pairs(_check(aten.expand.default, (torch.randn(1, 16), [8, 16]), (2,)))
    assert ((R,), (S(0),)) in pairs
    assert ((S(1),), (S(1),)) in pairs
    assert ((P,), (P,)) in pairs


def test_split_and_cat_keep_other_dims():
    results = _check(aten.split.Tensor, (torch.randn(8, 16, 96), 32, 2), (2,))
    outs = {(r.strategy.ins[0], r.strategy.outs) for r in results}
    assert ((S(0),), ((S(0),),) * 3) in outs
    assert not any(r.strategy.ins[0] == (S(2),) for r in results)
    results = _check(aten.cat.default, ([X, Y], -1), (2,))
    ins = {r.strategy.ins for r in results}
    assert ((S(1),), (S(1),)) in ins and ((P,), (P,)) in ins
    assert ((S(2),), (S(2),)) not in ins


def test_select_and_slice():
    pairs = _pairs(_check(aten.select.int, (X, 0, 0), (2,)))
    assert ((S(1),), (S(0),)) in pairs and ((S(0),), (S(0),)) not in pairs
    pairs = _pairs(_check(aten.slice.Tensor, (X, 1, 0, 3), (2,)))
    assert ((S(2),), (S(2),)) in pairs and ((S(1),), (S(1),)) not in pairs
    pairs = _pairs(_check(aten.slice.Tensor, (X, 0, 0, 9223372036854775807), (2,)))
    assert ((S(0),), (S(0),)) in pairs  # x[:] is the identity


def test_squeeze_never_shards_a_squeezed_dim():
    # A shard of a size-2 dim on 2 ranks has local size 1 and would be squeezed away.
    pairs = _pairs(_check(aten.squeeze.dim, (torch.randn(8, 2, 32), 1), (2,)))
    assert ((S(1),), (S(1),)) not in pairs and ((S(0),), (S(0),)) in pairs
    pairs = _pairs(_check(aten.squeeze.default, (torch.randn(1, 8, 1, 32),), (2,)))
    assert pairs == {((R,), (R,)), ((P,), (P,))}


def test_reshape_dim_map():
    assert reshape_dim_map((8, 16, 32), (8, 16, 4, 8)) == {0: 0, 1: 1, 2: 2}
    assert reshape_dim_map((2, 8, 4, 4), (2, 128)) == {0: 0, 1: 1}
    assert reshape_dim_map((4, 6), (6, 4)) == {0: 0}
    assert reshape_dim_map((1, 8, 1, 32), (8, 32)) == {1: 0, 3: 1}
    assert reshape_dim_map((0, 4), (4, 0)) == {}


def test_training_ir_view_ops_have_rules():
    class Model(torch.nn.Module):
        def forward(self, x, y):
            return (
                x.view(8, 16, 4, 8),
                x.reshape(128, 32),
                torch.flatten(x, 1),
                x.transpose(1, 2),
                x.permute(2, 0, 1),
                x.split(8, dim=1),
                torch.cat([x, y]),
                x[:, :3],
                x[0],
                x.unsqueeze(1),
                x[:, :1].expand(8, 4, 32),
                x[:, :1].squeeze(1),
                x.chunk(2, -1),
                x.unbind(0),
                torch.stack([x, y]),
                x.narrow(1, 2, 4),
                x[0].t(),
                x.unflatten(2, (4, 8)),
                x.view_as(y),
                x.split([4, 12], dim=1),
                x.mT,
                x[:1, :1].squeeze(),
                x.movedim(0, 2),
            )

    exported = torch.export.export(Model(), (X, Y), strict=False)
    targets = {n.target for n in exported.graph.nodes if n.op == "call_function"}
    targets.discard(operator.getitem)  # handled by the solver
    missing = {t for t in targets if t not in RULES}
    assert not missing, f"training IR view ops without a rule: {missing}"


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_broadcast_tensors(mesh):
    a, b = torch.randn(8, 1, 6), torch.randn(4, 6)
    results = check_op(aten.broadcast_tensors.default, ([a, b],), mesh_shape=mesh)
    bad = [r for r in results if not r.ok]
    assert not bad, bad
    outs = {r.strategy.outs[0] for r in results}
    assert any(spec[0] == S(0) for spec in outs) and any(spec[0] == S(1) for spec in outs)
