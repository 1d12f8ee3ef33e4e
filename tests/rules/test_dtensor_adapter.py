"""The DTensor adapter (autopar/rules/dtensor_adapter.py): every row it returns is exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar.rules  # noqa: F401  (registers every rule)
from autopar.ir.spec import P, R, S
from autopar.rules import dtensor_adapter
from autopar.rules.registry import (
    RULES,
    call_with_kw,
    expand_rows,
    op_info_from_values,
    replicate_row,
)
from autopar.rules.simulate import _normalize, check_op, check_strategy
from tests.conftest import strategy_text

aten = torch.ops.aten

torch.manual_seed(0)
X = torch.randn(8, 12)
X3 = torch.randn(4, 8, 12)

# Ops that autopar has no rule for today; the adapter is tested on them directly, so a rule
# registered for one of them later does not weaken these tests.
CASES = {
    "index_select_rows": (aten.index_select.default, (X, 0, torch.tensor([0, 3, 5, 1]))),
    "index_select_mid": (aten.index_select.default, (X3, 1, torch.tensor([0, 3, 5, 1]))),
    "gather": (aten.gather.default, (X3, 2, torch.randint(0, 12, (4, 8, 4)))),
    "sort": (aten.sort.default, (X3, 1)),
    "topk": (aten.topk.default, (X3, 3, -1)),
    "flip": (aten.flip.default, (X3, [1])),
    "index_tensor": (aten.index.Tensor, (X3, [None, torch.tensor([1, 2, 5])])),
    "tril": (aten.tril.default, (X3,)),
}


def _info(target, args):
    kw = _normalize(target, args, {})
    return kw, op_info_from_values("sim", target, kw, call_with_kw(target, kw))


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_adapter_strategy_is_exact(name, mesh):
    target, args = CASES[name]
    kw, info = _info(target, args)
    rows = dtensor_adapter.rows_for(info)
    assert rows, f"DTensor gave no strategy for {target}"
    assert replicate_row(info) in rows
    bad = []
    for strategy in expand_rows(info, rows, mesh, "dtensor"):
        result = check_strategy(target, kw, strategy, mesh)
        if not result.ok:
            bad.append(f"{strategy_text(strategy, bracketed=True)}: {result.detail}")
    assert not bad, f"{target} on mesh {mesh}: wrong DTensor strategies:\n" + "\n".join(bad)


def test_useful_strategies_come_through():
    _, info = _info(*CASES["index_select_rows"])
    rows = {(row.ins, row.outs) for row in dtensor_adapter.rows_for(info)}
    assert ((S(1), R), (S(1),)) in rows  # shard the columns of the table
    assert ((R, S(0)), (S(0),)) in rows  # shard the indices
    assert ((P, R), (P,)) in rows  # index_select is linear in the table
    _, info = _info(*CASES["sort"])
    rows = {(row.ins, row.outs) for row in dtensor_adapter.rows_for(info)}
    assert ((S(0),), (S(0), S(0))) in rows


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=str)
def test_check_op_routes_unregistered_ops_through_the_adapter(mesh):
    for name in ("gather", "flip", "topk"):
        target, args = CASES[name]
        if target in RULES:
            continue
        results = check_op(target, args, {}, mesh)
        assert {r.strategy.source for r in results} == {"dtensor"}
        assert len(results) > 1
        bad = [f"{strategy_text(r.strategy, bracketed=True)}: {r.detail}" for r in results if not r.ok]
        assert not bad, f"{target} on mesh {mesh}:\n" + "\n".join(bad)


def test_mask_partial_and_other_reductions_are_dropped():
    # DTensor shards an embedding table by rows into a MaskPartial output, which needs DTensor's
    # masking; flip also offers Partial("avg"/"max"/"min"). Only Partial("sum") comes through.
    _, info = _info(aten.embedding.default, (X, torch.randint(0, 8, (4, 6))))
    rows = dtensor_adapter.rows_for(info)
    assert rows and not any(row.ins[0] == S(0) for row in rows)
    _, info = _info(*CASES["flip"])
    partials = [p for row in dtensor_adapter.rows_for(info) for p in row.ins + row.outs if p == P]
    assert all(p.reduce_op == "sum" for p in partials)


def test_rows_that_need_rewritten_arguments_are_dropped():
    # DTensor shards group norm on the batch by rewriting N; autopar runs the op as it is.
    args = (torch.randn(4, 8, 6), torch.randn(8), torch.randn(8), 4, 8, 6, 2, 1e-5)
    _, info = _info(aten.native_group_norm.default, args)
    rows = dtensor_adapter.rows_for(info)
    assert rows and all(p == R for row in rows for p in row.ins)


def test_ops_with_custom_dtensor_handlers_are_not_asked():
    _, info = _info(aten.argmax.default, (X3, 1))
    assert dtensor_adapter.rows_for(info) is None
    _, info = _info(aten.native_dropout.default, (X3, 0.5, True))
    assert dtensor_adapter.rows_for(info) is None


def test_unknown_or_failing_ops_give_none():
    _, info = _info(aten.unfold.default, (X3, 1, 4, 4))
    assert dtensor_adapter.rows_for(info) is None  # no DTensor strategy
    _, good = _info(*CASES["gather"])
    broken = type(good)(good.name, good.target, {}, good.inputs, good.out_shapes, good.out_is_tuple)
    dtensor_adapter.clear_cache()
    assert dtensor_adapter.rows_for(broken) is None  # the strategy function raises


def test_results_are_cached():
    dtensor_adapter.clear_cache()
    _, info = _info(*CASES["gather"])
    first = dtensor_adapter.rows_for(info)
    assert dtensor_adapter._CACHE
    assert dtensor_adapter.rows_for(info) == first


def test_adapter_leaves_torch_distributed_uninitialized():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dtensor_adapter.clear_cache()
    _, info = _info(*CASES["gather"])
    assert dtensor_adapter.rows_for(info)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.ones(3))
    finally:
        dist.destroy_process_group()
