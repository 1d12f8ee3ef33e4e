"""Simulation checks of the matmul, pointwise, reduction, nn and factory rules, and the kernels.

Every plain strategy of every op is run on simulated ranks (``check_op``) and compared with the
unsharded op. Kernel strategies are checked twice: with ``axis_groups=()`` each kernel must equal its
aten op, and one multi-process test runs every kernel on two gloo ranks against eager, forward
and gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.ir.spec import SS, P, R, S, format_spec
from autopar.ops import get_kernel
from autopar.rules.registry import RULES, Strategy, node_strategies, offering_strided, op_info_from_values
from autopar.rules.simulate import _normalize, check_op, check_strategy
from tests.conftest import strategy_text

aten = torch.ops.aten


def check(target, args, kwargs=None, mesh=(2,), atol=1e-5):
    """Assert every strategy of the op is correct on ``mesh``; return the strategies."""
    results = check_op(target, args, kwargs, mesh, atol=atol)
    bad = [f"{strategy_text(r.strategy)}: {r.detail}" for r in results if not r.ok]
    assert not bad, f"{target} on mesh {mesh}: wrong strategies:\n" + "\n".join(bad)
    assert all(r.strategy.source == "rule" for r in results), f"{target} has no rule of ours"
    return [r.strategy for r in results]


def has(strategies, ins, out, kernel=None):
    """True when some strategy has these per-input and output specs (1-axis lists accepted)."""
    ins = tuple(tuple(spec) for spec in ins)
    outs = tuple(tuple(o) for o in out) if isinstance(out, tuple) else (tuple(out),)
    return any(s.ins == ins and s.outs == outs and s.kernel == kernel for s in strategies)


def strategies_for(target, args, kwargs=None, mesh=(2,)):
    kw = _normalize(target, args, kwargs or {})
    info = op_info_from_values("t", target, kw, aten_call(target, kw))
    return node_strategies(info, mesh)


def aten_call(target, kw):
    from autopar.rules.registry import call_with_kw

    return call_with_kw(target, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


MESHES = [(2,), (2, 2)]


@pytest.fixture(autouse=True)
def _seed():
    # Not 0: check_op draws its Partial pieces from a generator seeded with 0, and inputs drawn
    # from the same stream would make one piece the whole tensor and the other zero, which
    # hides every wrong Partial row.
    torch.manual_seed(1234)


# --------------------------------------------------------------------------------------------
# The simulator catches a wrong row (so passing checks mean something)


def test_simulator_rejects_wrong_rows():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kw = _normalize(aten.add.Tensor, (x, y), {})
    wrong = Strategy(ins=((P,), (R,)), outs=((P,),))
    assert not check_strategy(aten.add.Tensor, kw, wrong, (2,)).ok
    kw = _normalize(aten.relu.default, (x,), {})
    assert not check_strategy(aten.relu.default, kw, Strategy(ins=((P,),), outs=((P,),)), (2,)).ok


# --------------------------------------------------------------------------------------------
# matmul


@pytest.mark.parametrize("mesh", MESHES + [(2, 4)])
def test_linear(mesh):
    x, w, b = torch.randn(4, 8, 16), torch.randn(8, 16), torch.randn(8)
    with_bias = check(aten.linear.default, (x, w, b), mesh=mesh)
    no_bias = check(aten.linear.default, (x, w), mesh=mesh)
    if mesh == (2,):
        assert has(with_bias, [[S(0)], [R], [R]], [S(0)])  # data parallel
        assert has(with_bias, [[R], [S(0)], [S(0)]], [S(2)])  # column parallel
        assert has(with_bias, [[S(2)], [S(1)], [R]], [P], "linear_bias_split")  # row parallel
        assert has(no_bias, [[S(2)], [S(1)]], [P])
        assert has(no_bias, [[P], [R]], [P])
    if mesh == (2, 2):
        # Megatron on one axis, data parallel on the other.
        assert has(with_bias, [[S(0), R], [R, S(0)], [R, S(0)]], [S(0), S(2)])


@pytest.mark.parametrize("mesh", MESHES)
def test_mm_bmm_addmm_baddbmm(mesh):
    strategies = check(aten.mm.default, (torch.randn(4, 8), torch.randn(8, 6)), mesh=mesh)
    assert has(strategies, [[S(1)] * len(mesh), [S(0)] * len(mesh)], [P] * len(mesh))
    strategies = check(aten.bmm.default, (torch.randn(4, 4, 8), torch.randn(4, 8, 6)), mesh=mesh)
    if mesh == (2,):
        assert has(strategies, [[S(0)], [S(0)]], [S(0)])
        assert has(strategies, [[S(2)], [S(1)]], [P])
    for bias in (torch.randn(6), torch.randn(4, 6), torch.randn(4, 1)):
        strategies = check(
            aten.addmm.default, (bias, torch.randn(4, 8), torch.randn(8, 6)), {"beta": 0.5, "alpha": 2.0}, mesh=mesh
        )
        if mesh == (2,):
            assert has(strategies, [[R], [S(1)], [S(0)]], [P], "addmm_bias_split")
    for bias in (torch.randn(4, 4, 6), torch.randn(1, 1, 6)):
        strategies = check(aten.baddbmm.default, (bias, torch.randn(4, 4, 8), torch.randn(4, 8, 6)), {"beta": 0.5}, mesh=mesh)
        if mesh == (2,):
            bias_batch = S(0) if bias.shape[0] == 4 else R
            assert has(strategies, [[bias_batch], [S(0)], [S(0)]], [S(0)])
            assert has(strategies, [[P], [S(2)], [S(1)]], [P])
            assert not has(strategies, [[R], [S(2)], [S(1)]], [P])


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize(
    "shapes",
    [
        ((4, 8), (8, 6)),
        ((2, 4, 8), (8, 6)),
        ((4, 8), (2, 8, 6)),
        ((2, 4, 8), (2, 8, 6)),
        ((2, 1, 4, 8), (4, 8, 6)),
        ((8,), (8, 6)),
        ((2, 4, 8), (8,)),
    ],
)
def test_matmul(mesh, shapes):
    a, b = torch.randn(*shapes[0]), torch.randn(*shapes[1])
    strategies = check(aten.matmul.default, (a, b), mesh=mesh)
    if mesh == (2,) and a.ndim >= 2 and b.ndim >= 2:
        assert has(strategies, [[S(a.ndim - 1)], [S(b.ndim - 2)]], [P])


# --------------------------------------------------------------------------------------------
# pointwise


def test_training_ir_scalar_overloads():
    """`x * 0.5` and `x + 1` reach the rules as the Tensor overloads with a python number."""

    class Scale(nn.Module):
        def forward(self, x):
            return (x * 0.5 + 1) / 2.0 - 3

    graph = torch.export.export(Scale(), (torch.randn(2, 4),), strict=False).graph_module.graph
    targets = [n.target for n in graph.nodes if n.op == "call_function"]
    assert targets == [aten.mul.Tensor, aten.add.Tensor, aten.div.Tensor, aten.sub.Tensor]


@pytest.mark.parametrize("mesh", MESHES)
def test_pointwise_binary(mesh):
    x, row, col = torch.randn(4, 8), torch.randn(8), torch.randn(4, 1)
    for target in (
        aten.add.Tensor,
        aten.sub.Tensor,
        aten.mul.Tensor,
        aten.div.Tensor,
        aten.rsub.Tensor,
        aten.maximum.default,
        aten.pow.Tensor_Tensor,
        aten.atan2.default,
        aten.eq.Tensor,
        aten.lt.Tensor,
        aten.masked_fill.Tensor,
    ):
        for other in (x.clone(), row, col, torch.tensor(1.5)):
            if target is aten.masked_fill.Tensor:
                check(target, (x, other > 0, torch.tensor(2.0)), mesh=mesh)
                continue
            base = x.abs() + 0.1 if target is aten.pow.Tensor_Tensor else x  # no NaN from pow
            strategies = check(target, (base, other), mesh=mesh)
            if mesh == (2,) and other.shape == (4, 1):
                assert has(strategies, [[S(1)], [R]], [S(1)])  # broadcast input stays R
                assert has(strategies, [[S(0)], [S(0)]], [S(0)])
    s = check(aten.add.Tensor, (x, row), mesh=(2,))
    assert has(s, [[P], [P]], [P]) and not has(s, [[P], [R]], [P])
    s = check(aten.mul.Tensor, (x, row), mesh=(2,))
    assert has(s, [[P], [R]], [P]) and has(s, [[R], [P]], [P]) and not has(s, [[P], [P]], [P])
    s = check(aten.div.Tensor, (x, row.abs() + 1), mesh=(2,))
    assert has(s, [[P], [R]], [P]) and not has(s, [[R], [P]], [P])


@pytest.mark.parametrize("mesh", MESHES)
def test_pointwise_with_python_numbers(mesh):
    x = torch.randn(4, 8)
    s = check(aten.mul.Tensor, (x, 0.5), mesh=mesh)
    assert has(s, [[P] * len(mesh)], [P] * len(mesh))
    s = check(aten.div.Tensor, (x, 2.0), mesh=mesh)
    assert has(s, [[P] * len(mesh)], [P] * len(mesh))
    for target, scalar in (
        (aten.add.Tensor, 1),
        (aten.sub.Tensor, 3.0),
        (aten.add.Scalar, 1.0),
        (aten.rsub.Scalar, 1.0),
        (aten.pow.Tensor_Scalar, 2),
        (aten.gt.Scalar, 0.0),
        (aten.clamp_min.default, 0.0),
    ):
        s = check(target, (x, scalar), mesh=mesh)
        assert not any(P in spec for st in s for spec in st.ins), f"{target} with a number takes P"
    for target in (aten.mul.Scalar, aten.div.Scalar):
        s = check(target, (x, 3.0), mesh=mesh)
        assert has(s, [[P] * len(mesh)], [P] * len(mesh))


UNARY_SAMPLES = [
    aten.relu.default,
    aten.gelu.default,
    aten.silu.default,
    aten.tanh.default,
    aten.sigmoid.default,
    aten.exp.default,
    aten.abs.default,
    aten.sin.default,
    aten.cos.default,
    aten.erf.default,
    aten.neg.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
    aten.square.default,
    aten.hardtanh.default,
    aten.leaky_relu.default,
    aten.logical_not.default,
    aten.isnan.default,
]


@pytest.mark.parametrize("mesh", MESHES)
def test_pointwise_unary(mesh):
    x = torch.randn(4, 6, 8)
    for target in UNARY_SAMPLES:
        check(target, (x,), mesh=mesh)
    positive = x.abs() + 0.5
    for target in (aten.log.default, aten.sqrt.default, aten.rsqrt.default):
        check(target, (positive,), mesh=mesh)
    check(aten.pow.Tensor_Scalar, (x, 3), mesh=mesh)
    check(aten.clamp.default, (x, -0.5, 0.5), mesh=mesh)
    linear = check(aten.neg.default, (x,), mesh=(2,))
    assert has(linear, [[P]], [P])
    nonlinear = check(aten.gelu.default, (x,), mesh=(2,))
    assert not has(nonlinear, [[P]], [P]) and has(nonlinear, [[S(2)]], [S(2)])


@pytest.mark.parametrize("mesh", MESHES)
def test_casts(mesh):
    x = torch.randn(4, 8)
    s = check(aten._to_copy.default, (x,), {"dtype": torch.float64}, mesh=mesh)
    assert has(s, [[P] * len(mesh)], [P] * len(mesh))
    s = check(aten._to_copy.default, (x * 10,), {"dtype": torch.int64}, mesh=mesh)
    assert not any(P in spec for st in s for spec in st.ins)
    check(aten.to.dtype, (x, torch.float64), mesh=mesh)
    check(aten._to_copy.default, (torch.randint(0, 5, (4, 8)),), {"dtype": torch.float32}, mesh=mesh)


@pytest.mark.parametrize("mesh", MESHES)
def test_selection_and_fills(mesh):
    x, y, cond = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8) > 0
    s = check(aten.where.self, (cond, x, y), mesh=mesh)
    check(aten.where.self, (cond[:, :1], x, torch.randn(8)), mesh=mesh)
    if mesh == (2,):
        assert has(s, [[R], [P], [P]], [P])
    s = check(aten.where.ScalarOther, (cond, x, 0.0), mesh=mesh)
    assert has(s, [[R] * len(mesh), [P] * len(mesh)], [P] * len(mesh))
    s = check(aten.where.ScalarOther, (cond, x, float("-inf")), mesh=mesh)
    assert not any(P in spec for st in s for spec in st.ins)
    check(aten.where.ScalarSelf, (cond, 0.0, x), mesh=mesh)
    s = check(aten.masked_fill.Scalar, (x, cond, 0.0), mesh=mesh)
    assert has(s, [[P] * len(mesh), [R] * len(mesh)], [P] * len(mesh))
    check(aten.masked_fill.Scalar, (x, cond[:1], -1e9), mesh=mesh)
    check(aten.addcmul.default, (x, y, torch.randn(8)), {"value": 0.5}, mesh=mesh)
    check(aten.addcdiv.default, (x, y, torch.rand(4, 8) + 1), {"value": 0.5}, mesh=mesh)
    check(aten.copy.default, (x, torch.randn(8)), mesh=mesh)
    for target in (aten.zeros_like.default, aten.ones_like.default):
        s = check(target, (x,), mesh=mesh)
        assert not any(P in spec for st in s for spec in st.outs)
    check(aten.full_like.default, (x, 3.0), mesh=mesh)
    check(aten.fill.Scalar, (x, 2.0), mesh=mesh)
    check(aten.zero.default, (x,), mesh=mesh)


@pytest.mark.parametrize("mesh", MESHES)
def test_positional_masks_type_as_and_metadata_checks(mesh):
    x = torch.randn(4, 8, 8)
    for target in (aten.triu.default, aten.tril.default):
        s = check(target, (x, 1), mesh=mesh)
        assert not any(S(1) in st.ins[0] or S(2) in st.ins[0] for st in s)
        assert any(P in st.ins[0] for st in s) and any(S(0) in st.ins[0] for st in s)
    s = check(aten.type_as.default, (x, torch.randn(4, 8, 8).double()), mesh=mesh)
    assert any(st.ins[1] == st.ins[0] == (S(2),) * len(mesh) for st in s)
    check(aten.type_as.default, (x, torch.ones(2, dtype=torch.int32)), mesh=mesh)
    s = strategies_for(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32}, mesh=mesh)
    assert any(S(1) in st.ins[0] for st in s) and all(st.outs == () for st in s)
    s = strategies_for(aten._assert_tensor_metadata.default, (x, [4, 8, 8]), mesh=mesh)
    assert [st.ins for st in s] == [((R,) * len(mesh),)]
    o = check(aten.outer.default, (torch.randn(4), torch.randn(8)), mesh=mesh)
    if mesh == (2,):
        assert has(o, [[S(0)], [R]], [S(0)]) and has(o, [[R], [S(0)]], [S(1)]) and has(o, [[P], [R]], [P])


def test_like_ops_without_fixed_values_have_rules():
    x = torch.randn(4, 8)
    for target in (aten.empty_like.default, aten.rand_like.default, aten.randn_like.default):
        s = strategies_for(target, (x,), mesh=(2,))
        assert all(st.source == "rule" for st in s)
        assert has(s, [[S(1)]], [S(1)]) and not has(s, [[P]], [P])


def test_inplace_variants_keep_self_in_place():
    x, row = torch.randn(4, 8), torch.randn(8)
    for functional, inplace, args in (
        (aten.add.Tensor, aten.add_.Tensor, (x, row)),
        (aten.mul.Tensor, aten.mul_.Tensor, (x, row)),
        (aten.mul.Tensor, aten.mul_.Tensor, (x, 2.0)),
        (aten.div.Tensor, aten.div_.Tensor, (x, row.abs() + 1)),
        (aten.relu.default, aten.relu_.default, (x,)),
        (aten.masked_fill.Scalar, aten.masked_fill_.Scalar, (x, x > 0, 0.0)),
        (aten.pow.Tensor_Scalar, aten.pow_.Scalar, (x, 2)),
        (aten.copy.default, aten.copy_.default, (x, row)),
        (aten.fill.Scalar, aten.fill_.Scalar, (x, 1.0)),
    ):
        assert inplace in RULES
        for mesh in MESHES:
            full = strategies_for(functional, args, mesh=mesh)
            mine = strategies_for(inplace, args, mesh=mesh)
            assert mine and all(s in full for s in mine), inplace
            assert all(s.out == s.ins[0] for s in mine), f"{inplace} moves self"
            # The simulated functional op vouches for the rows the in-place op keeps.
            check(functional, args, mesh=mesh)
    s = strategies_for(aten.mul_.Tensor, (x, row), mesh=(2,))
    assert has(s, [[P], [R]], [P]) and not has(s, [[R], [P]], [P])


# --------------------------------------------------------------------------------------------
# reductions


@pytest.mark.parametrize("mesh", MESHES + [(2, 4)])
def test_sum_and_mean(mesh):
    x = torch.randn(4, 8, 8)
    for dim, keepdim in (([1], False), ([-1], True), ([0, 2], False), (None, False), ([], False)):
        s = check(aten.sum.dim_IntList, (x, dim, keepdim), mesh=mesh)
        m = check(aten.mean.dim, (x, dim, keepdim), mesh=mesh)
        if mesh == (2,) and dim == [1]:
            assert has(s, [[S(1)]], [P]) and has(s, [[S(2)]], [S(1)]) and has(s, [[P]], [P])
            assert has(m, [[S(1)]], [P], "mean_partial") and has(m, [[S(2)]], [S(1)])
        if mesh == (2,) and dim == [-1] and keepdim:
            assert has(s, [[S(1)]], [S(1)])
    s = check(aten.sum.default, (x,), mesh=mesh)
    m = check(aten.mean.default, (x,), mesh=mesh)
    if mesh == (2,):
        assert has(s, [[S(0)]], [P]) and has(m, [[S(0)]], [P], "mean_partial")
    check(aten.sum.dim_IntList, (x, [1]), {"dtype": torch.float64}, mesh=mesh)


@pytest.mark.parametrize("mesh", MESHES)
def test_other_reductions(mesh):
    x = torch.randn(4, 6, 8)
    for target, args, kwargs in (
        (aten.amax.default, (x, [1]), None),
        (aten.amin.default, (x, [-1], True), None),
        (aten.amax.default, (x,), None),
        (aten.max.dim, (x, 1), None),
        (aten.min.dim, (x, 2, True), None),
        (aten.argmax.default, (x, 1), None),
        (aten.argmin.default, (x,), None),
        (aten.var.correction, (x, [1]), {"correction": 1}),
        (aten.var.correction, (x, [2]), {"correction": 0, "keepdim": True}),
        (aten.var.dim, (x, [1]), None),
        (aten.std.dim, (x, [-1]), None),
        (aten.std.correction, (x, [1]), None),
        (aten.var_mean.correction, (x, [1]), None),
        (aten.prod.dim_int, (x, 1), None),
        (aten.prod.default, (x,), None),
        (aten.logsumexp.default, (x, [2]), None),
        (aten.cumsum.default, (x, 1), None),
        (aten.any.dim, (x > 0, 1), None),
    ):
        s = check(target, args, kwargs, mesh=mesh)
        if target is not aten.cumsum.default:
            assert not any(P in spec for st in s for spec in st.outs), target
    s = check(aten.max.dim, (x, 1), mesh=(2,))
    assert has(s, [[S(2)]], ([S(1)], [S(1)])) and not has(s, [[S(1)]], ([P], [P]))
    s = check(aten.cumsum.default, (x, 1), mesh=(2,))
    assert has(s, [[P]], [P]) and has(s, [[S(2)]], [S(2)])


# --------------------------------------------------------------------------------------------
# nn ops


@pytest.mark.parametrize("mesh", MESHES)
def test_softmax(mesh):
    x = torch.randn(4, 6, 8)
    for target, args in (
        (aten.softmax.int, (x, -1)),
        (aten._softmax.default, (x, 1, False)),
        (aten.log_softmax.int, (x, 2)),
        (aten._log_softmax.default, (x, -1, False)),
    ):
        s = check(target, args, mesh=mesh)
        dim = args[1] % 3
        assert not any(S(dim) in st.ins[0] for st in s)


@pytest.mark.parametrize("mesh", MESHES + [(2, 4)])
def test_norms(mesh):
    x = torch.randn(4, 8, 16)
    w, b = torch.randn(16), torch.randn(16)
    s = check(aten.layer_norm.default, (x, [16], w, b), mesh=mesh)
    check(aten.layer_norm.default, (x, [8, 16], torch.randn(8, 16), None), mesh=mesh)
    check(aten.native_layer_norm.default, (x, [16], w, b, 1e-5), mesh=mesh)
    r = check(aten.rms_norm.default, (x, [16], w, 1e-6), mesh=mesh)
    check(aten.rms_norm.default, (x, [16]), mesh=mesh)
    if mesh == (2,):
        assert has(s, [[S(1)], [R], [R]], [S(1)]) and not has(s, [[S(2)], [R], [R]], [S(2)])
        assert has(r, [[S(0)], [R]], [S(0)])


@pytest.mark.parametrize("mesh", MESHES + [(2, 4)])
def test_embedding(mesh):
    weight, indices = torch.randn(16, 8), torch.randint(0, 16, (4, 8))
    s = check(aten.embedding.default, (weight, indices), mesh=mesh)
    check(aten.embedding.default, (weight, indices, 3), mesh=mesh)
    if mesh == (2,):
        assert has(s, [[R], [S(0)]], [S(0)]) and has(s, [[S(1)], [R]], [S(2)])
        assert has(s, [[S(0)], [R]], [P], "embedding_vocab_split")
    s = strategies_for(aten.embedding.default, (weight, indices, -1, True), mesh=(2,))
    assert not any(st.kernel for st in s)


@pytest.mark.parametrize("mesh", MESHES)
def test_scaled_dot_product_attention(mesh):
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    causal = check(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": True}, mesh=mesh)
    plain = check(aten.scaled_dot_product_attention.default, (q, k, v), mesh=mesh)
    for mask in (torch.randn(8, 8), torch.randn(2, 1, 8, 8), torch.rand(2, 4, 8, 8) > 0.2, torch.randn(1, 4, 1, 8)):
        check(aten.scaled_dot_product_attention.default, (q, k, v, mask), mesh=mesh)
    gqa = (q, torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16))
    g = check(aten.scaled_dot_product_attention.default, gqa, {"enable_gqa": True}, mesh=mesh)
    check(aten.scaled_dot_product_attention.default, (torch.randn(4, 8, 16),) * 3, mesh=mesh)
    if mesh == (2,):
        assert has(causal, [[S(1)]] * 3, [S(1)]) and has(causal, [[S(0)]] * 3, [S(0)])
        assert not has(causal, [[S(2)], [R], [R]], [S(2)])
        assert has(plain, [[S(2)], [R], [R]], [S(2)])
        assert has(g, [[S(1)]] * 3, [S(1)])
        # Causal attention splits its sequence only through the context-parallel kernel (its
        # math is checked per rank in tests/ops/test_attention.py and on ranks in
        # tests/runtime/test_context_parallel.py), and GQA keeps it.
        assert has(causal, [[S(2)]] * 3, [S(2)], "sdpa_context_parallel")
        assert has(g, [[S(2)]] * 3, [S(2)]) is False
        gqa_causal = strategies_for(aten.scaled_dot_product_attention.default, gqa, {"is_causal": True, "enable_gqa": True})
        assert has(gqa_causal, [[S(2)]] * 3, [S(2)], "sdpa_context_parallel")
        # Not offered without is_causal (the query split serves), with a mask, or with dropout
        # (its backward recomputes, which would draw a second mask).
        assert not any(st.kernel for st in plain)
        for kwargs in ({"is_causal": True, "dropout_p": 0.1}, {}):
            assert not any(st.kernel for st in strategies_for(aten.scaled_dot_product_attention.default, (q, k, v), kwargs))


@pytest.mark.parametrize("mesh", MESHES)
def test_cross_entropy(mesh):
    logits, target = torch.randn(8, 5), torch.randint(0, 5, (8,))
    target[1] = -100
    weight = torch.rand(5) + 0.5
    for reduction in (0, 1, 2):
        s = check(aten.cross_entropy_loss.default, (logits, target, None, reduction), mesh=mesh)
        check(aten.cross_entropy_loss.default, (logits, target, weight, reduction), mesh=mesh)
        if mesh == (2,):
            expected = {0: ([S(0)], None), 1: ([R], "cross_entropy_mean"), 2: ([P], None)}[reduction]
            assert has(s, [[S(0)], [S(0)]], *expected)
            even = check(aten.cross_entropy_loss.default, (torch.randn(8, 6), target, None, reduction), mesh=mesh)
            assert has(even, [[S(1)], [R]], [R], "cross_entropy_vocab_split"), "vocab-parallel row (6 classes)"
    spatial, spatial_target = torch.randn(4, 5, 6), torch.randint(0, 5, (4, 6))
    for reduction in (0, 1, 2):
        s = check(aten.cross_entropy_loss.default, (spatial, spatial_target, None, reduction), mesh=mesh)
    assert any(S(2) in st.ins[0] for st in s)
    probabilities = torch.softmax(torch.randn(8, 5), -1)
    check(aten.cross_entropy_loss.default, (logits, probabilities, None, 0), mesh=mesh)
    check(aten.cross_entropy_loss.default, (logits, probabilities, weight, 2, -100, 0.1), mesh=mesh)
    s = strategies_for(aten.cross_entropy_loss.default, (logits, target, weight, 1, -100, 0.1))
    assert not any(st.kernel for st in s)  # weighted label smoothing: no exact partial mean


@pytest.mark.parametrize("mesh", MESHES)
def test_conv(mesh):
    x, w, b = torch.randn(4, 4, 6, 6), torch.randn(6, 4, 3, 3), torch.randn(6)
    s = check(aten.conv2d.default, (x, w, b, [1, 1], [1, 1]), mesh=mesh)
    n = check(aten.conv2d.default, (x, w, None, [2, 2]), mesh=mesh)
    check(aten.conv2d.default, (x, torch.randn(4, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], 2), mesh=mesh)
    check(aten.conv2d.default, (torch.randn(4, 6, 6), w, b), mesh=mesh)
    check(aten.conv1d.default, (torch.randn(4, 4, 8), torch.randn(6, 4, 3), torch.randn(6)), mesh=mesh)
    if mesh == (2,):
        assert has(s, [[S(0)], [R], [R]], [S(0)]) and has(s, [[R], [S(0)], [S(0)]], [S(1)])
        assert has(s, [[S(1)], [S(1)], [R]], [P], "conv2d_bias_split")
        assert has(n, [[S(1)], [S(1)]], [P]) and has(n, [[P], [R]], [P])
    g = strategies_for(aten.conv2d.default, (x, torch.randn(4, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], 2))
    assert not has(g, [[R], [S(0)]], [S(1)])  # grouped conv: output channels don't split plainly


@pytest.mark.parametrize("mesh", MESHES)
def test_batch_norm(mesh):
    x = torch.randn(4, 4, 6, 6)
    stats = lambda: (torch.randn(4), torch.randn(4), torch.randn(4), torch.rand(4) + 0.5)  # noqa: E731
    ev = check(aten.batch_norm.default, (x, *stats(), False, 0.1, 1e-5, False), mesh=mesh)
    tr = check(aten.batch_norm.default, (x, *stats(), True, 0.1, 1e-5, False), mesh=mesh)
    check(aten.batch_norm.default, (x, None, None, None, None, True, 0.1, 1e-5, False), mesh=mesh)
    if mesh == (2,):
        assert has(ev, [[S(0)], [R], [R], [R], [R]], [S(0)])
        assert has(tr, [[S(0)], [R], [R], [R], [R]], [S(0)], "sync_batch_norm")
        assert has(tr, [[S(1)], [S(0)], [S(0)], [S(0)], [S(0)]], [S(1)])
        assert not has(tr, [[S(0)], [R], [R], [R], [R]], [S(0)])


@pytest.mark.parametrize("mesh", MESHES)
def test_pools_and_dropout(mesh):
    x = torch.randn(4, 4, 6, 6)
    m = check(aten.max_pool2d.default, (x, [2, 2]), mesh=mesh)
    check(aten.max_pool2d_with_indices.default, (x, [3, 3], [2, 2], [1, 1]), mesh=mesh)
    a = check(aten.avg_pool2d.default, (x, [2, 2], [2, 2], [1, 1]), mesh=mesh)
    check(aten.adaptive_avg_pool2d.default, (x, [2, 2]), mesh=mesh)
    check(aten.adaptive_avg_pool2d.default, (torch.randn(4, 6, 6), [1, 1]), mesh=mesh)
    check(aten.adaptive_max_pool2d.default, (x, [3, 3]), mesh=mesh)
    check(aten.avg_pool1d.default, (torch.randn(4, 4, 8), [2]), mesh=mesh)
    if mesh == (2,):
        assert has(m, [[S(1)]], [S(1)]) and not has(m, [[S(2)]], [S(2)]) and not has(m, [[P]], [P])
        assert has(a, [[P]], [P]) and has(a, [[S(0)]], [S(0)])
    # Random masks are drawn per rank, so only the deterministic settings are simulated.
    d = check(aten.dropout.default, (x, 0.5, False), mesh=mesh)
    check(aten.dropout.default, (x, 0.0, True), mesh=mesh)
    check(aten.native_dropout.default, (x, 0.0, True), mesh=mesh)
    if mesh == (2,):
        assert has(d, [[P]], [P])
    t = strategies_for(aten.dropout.default, (x, 0.5, True))
    assert not has(t, [[P]], [P]) and has(t, [[S(0)]], [S(0)])


# --------------------------------------------------------------------------------------------
# factory


@pytest.mark.parametrize("mesh", MESHES)
def test_factories(mesh):
    for target, args in ((aten.arange.default, (8,)), (aten.arange.start_step, (0, 16, 2)), (aten.scalar_tensor.default, (2.0,))):
        s = check(target, args, mesh=mesh)
        assert [st.out for st in s] == [(R,) * len(mesh)]
    for target, args in ((aten.zeros.default, ([4, 8],)), (aten.ones.default, ([4, 8],)), (aten.full.default, ([4, 8], 1.5))):
        s = check(target, args, mesh=mesh)
        assert any(st.out[0] == S(1) for st in s)
    x = torch.randn(4, 8)
    check(aten.new_zeros.default, (x, [6, 4]), mesh=mesh)
    check(aten.new_full.default, (x, [6, 4], 2.0), mesh=mesh)
    for target in (aten.randn.default, aten.rand.default):
        s = strategies_for(target, ([4, 8],), mesh=mesh)
        assert [st.out for st in s] == [(R,) * len(mesh)] and s[0].source == "rule"


# --------------------------------------------------------------------------------------------
# The training IR keeps these ops whole, and each has a rule


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, tokens, image, labels):
        h = self.rms(self.norm(self.emb(tokens)))
        q, k, v = self.proj(h).view(2, 4, 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 4, 8)
        logits = self.head(F.dropout(F.gelu(a) * 0.5 + h, 0.1, self.training))
        loss = F.cross_entropy(logits.reshape(-1, 16), labels.reshape(-1))
        c = F.max_pool2d(torch.relu(self.bn(self.conv(image))), 2)
        return loss + F.adaptive_avg_pool2d(c, 1).mean() + logits.softmax(-1).amax(-1).sum()


def test_training_ir_ops_have_rules():
    net = _Net()
    args = (torch.randint(0, 16, (2, 4)), torch.randn(2, 3, 8, 8), torch.randint(0, 16, (2, 4)))
    graph = torch.export.export(net, args, strict=False).graph_module.graph
    targets = {n.target for n in graph.nodes if n.op == "call_function"}
    whole = {
        aten.embedding.default,
        aten.linear.default,
        aten.layer_norm.default,
        aten.rms_norm.default,
        aten.scaled_dot_product_attention.default,
        aten.cross_entropy_loss.default,
        aten.conv2d.default,
        aten.batch_norm.default,
        aten.max_pool2d.default,
        aten.adaptive_avg_pool2d.default,
        aten.dropout.default,
        aten.gelu.default,
        aten.mul.Tensor,
        aten.add.Tensor,
        aten.softmax.int,
        aten.amax.default,
        aten.mean.default,
        aten.sum.default,
        aten.relu.default,
        aten.add_.Tensor,
    }
    assert whole <= targets, f"not in the training IR: {whole - targets}"
    assert all(t in RULES for t in whole)


# --------------------------------------------------------------------------------------------
# Kernels: with axis_groups=() each is exactly its op


def _kernel(name, **kw):
    return get_kernel(name)(axis_groups=(), **kw)


def test_kernels_equal_their_op_without_groups():
    x, w, b = torch.randn(4, 6, 8), torch.randn(5, 8), torch.randn(5)
    torch.testing.assert_close(_kernel("linear_bias_split", input=x, weight=w, bias=b), aten.linear(x, w, b))
    bias, m1, m2 = torch.randn(5), torch.randn(4, 8), torch.randn(8, 5)
    torch.testing.assert_close(
        _kernel("addmm_bias_split", self=bias, mat1=m1, mat2=m2, beta=0.5, alpha=2.0),
        aten.addmm(bias, m1, m2, beta=0.5, alpha=2.0),
    )
    img, cw, cb = torch.randn(2, 4, 7, 7), torch.randn(3, 4, 3, 3), torch.randn(3)
    conv_kw = dict(input=img, weight=cw, bias=cb, stride=[2, 2], padding=[1, 1], dilation=[1, 1])
    torch.testing.assert_close(_kernel("conv2d_bias_split", **conv_kw), aten.conv2d(img, cw, cb, [2, 2], [1, 1], [1, 1], 1))
    for dim, keepdim in (([1], False), ([0, 2], True), (None, False)):
        torch.testing.assert_close(
            _kernel("mean_partial", self=x, dim=dim, keepdim=keepdim, dtype=None), aten.mean.dim(x, dim, keepdim)
        )
    torch.testing.assert_close(_kernel("mean_partial", self=x, dtype=torch.float64), aten.mean.default(x, dtype=torch.float64))
    table, idx = torch.randn(10, 4), torch.randint(0, 10, (3, 5))
    for padding_idx in (-1, 3):
        torch.testing.assert_close(
            _kernel(
                "embedding_vocab_split",
                weight=table,
                indices=idx,
                padding_idx=padding_idx,
                scale_grad_by_freq=False,
                sparse=False,
            ),
            aten.embedding(table, idx, padding_idx),
        )
    logits, target, weight = torch.randn(8, 5, 3), torch.randint(0, 5, (8, 3)), torch.rand(5) + 0.5
    target[0, 0] = target[3, 2] = -100
    probabilities = torch.softmax(torch.randn(8, 5, 3), 1)
    for tgt, wt, smoothing in (
        (target, None, 0.0),
        (target, weight, 0.0),
        (target, None, 0.2),
        (probabilities, None, 0.0),
        (probabilities, weight, 0.1),
    ):
        torch.testing.assert_close(
            _kernel(
                "cross_entropy_mean",
                self=logits,
                target=tgt,
                weight=wt,
                reduction=1,
                ignore_index=-100,
                label_smoothing=smoothing,
            ),
            aten.cross_entropy_loss(logits, tgt, wt, 1, -100, smoothing),
        )


def test_sync_batch_norm_without_groups_matches_eager():
    x = torch.randn(6, 3, 4, 4)
    bn_eager = nn.BatchNorm2d(3)
    nn.init.normal_(bn_eager.weight)
    nn.init.normal_(bn_eager.bias)
    weight = bn_eager.weight.detach().clone().requires_grad_()
    bias = bn_eager.bias.detach().clone().requires_grad_()
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    xe, xk = x.clone().requires_grad_(), x.clone().requires_grad_()
    grad_out = torch.randn_like(x)
    ref = bn_eager(xe)
    out = _kernel(
        "sync_batch_norm",
        input=xk,
        weight=weight,
        bias=bias,
        running_mean=running_mean,
        running_var=running_var,
        training=True,
        momentum=0.1,
        eps=1e-5,
        cudnn_enabled=False,
    )
    torch.testing.assert_close(out, ref)
    (ref * grad_out).sum().backward()
    (out * grad_out).sum().backward()
    torch.testing.assert_close(xk.grad, xe.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weight.grad, bn_eager.weight.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(bias.grad, bn_eager.bias.grad)
    torch.testing.assert_close(running_mean, bn_eager.running_mean)
    torch.testing.assert_close(running_var, bn_eager.running_var)


# --------------------------------------------------------------------------------------------
# Kernels on two gloo ranks against eager, forward and gradients


def _kernels_on_ranks(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from autopar.ops import collectives

    group = dist.group.WORLD.group_name
    torch.manual_seed(0)  # the same global tensors on every rank

    def chunk(t, dim):
        return t.chunk(world_size, dim)[rank].detach().clone().requires_grad_()

    def close(got, want, what):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")

    def partial_grad(t):  # an R input's gradient is a partial sum across ranks
        return collectives.no_grad_all_reduce(t.grad, group)

    # linear_bias_split: x S(last), weight S(1), bias R -> P
    x, w, b = (
        torch.randn(4, 3, 8, requires_grad=True),
        torch.randn(6, 8, requires_grad=True),
        torch.randn(6, requires_grad=True),
    )
    c = torch.randn(4, 3, 6)
    (F.linear(x, w, b) * c).sum().backward()
    xl, wl, bl = chunk(x, 2), chunk(w, 1), b.detach().clone().requires_grad_()
    out = get_kernel("linear_bias_split")(axis_groups=(group,), input=xl, weight=wl, bias=bl)
    out = collectives.all_reduce(out, group)
    close(out, F.linear(x, w, b).detach(), "linear forward")
    (out * c).sum().backward()
    close(xl.grad, x.grad.chunk(world_size, 2)[rank], "linear x grad")
    close(wl.grad, w.grad.chunk(world_size, 1)[rank], "linear weight grad")
    close(bl.grad, b.grad, "linear bias grad (whole on every rank, no all-reduce)")

    # addmm_bias_split: bias R, mat1 S(1), mat2 S(0) -> P
    bias, m1, m2 = (
        torch.randn(5, requires_grad=True),
        torch.randn(4, 8, requires_grad=True),
        torch.randn(8, 5, requires_grad=True),
    )
    c = torch.randn(4, 5)
    (torch.addmm(bias, m1, m2, beta=0.5, alpha=2.0) * c).sum().backward()
    biasl, m1l, m2l = bias.detach().clone().requires_grad_(), chunk(m1, 1), chunk(m2, 0)
    out = get_kernel("addmm_bias_split")(axis_groups=(group,), self=biasl, mat1=m1l, mat2=m2l, beta=0.5, alpha=2.0)
    out = collectives.all_reduce(out, group)
    close(out, torch.addmm(bias, m1, m2, beta=0.5, alpha=2.0).detach(), "addmm forward")
    (out * c).sum().backward()
    close(m1l.grad, m1.grad.chunk(world_size, 1)[rank], "addmm mat1 grad")
    close(biasl.grad, bias.grad, "addmm bias grad (whole on every rank, no all-reduce)")

    # conv2d_bias_split: input S(1), weight S(1), bias R -> P (the op's `groups` is replaced)
    img, cw, cb = (
        torch.randn(2, 4, 6, 6, requires_grad=True),
        torch.randn(3, 4, 3, 3, requires_grad=True),
        torch.randn(3, requires_grad=True),
    )
    c = torch.randn(2, 3, 6, 6)
    (F.conv2d(img, cw, cb, 1, 1) * c).sum().backward()
    imgl, cwl, cbl = chunk(img, 1), chunk(cw, 1), cb.detach().clone().requires_grad_()
    out = get_kernel("conv2d_bias_split")(
        axis_groups=(group,), input=imgl, weight=cwl, bias=cbl, stride=[1, 1], padding=[1, 1], dilation=[1, 1]
    )
    out = collectives.all_reduce(out, group)
    close(out, F.conv2d(img, cw, cb, 1, 1).detach(), "conv2d forward")
    (out * c).sum().backward()
    close(imgl.grad, img.grad.chunk(world_size, 1)[rank], "conv2d input grad")
    close(cwl.grad, cw.grad.chunk(world_size, 1)[rank], "conv2d weight grad")
    close(cbl.grad, cb.grad, "conv2d bias grad (whole on every rank, no all-reduce)")

    # mean_partial: self S(1) reduced over dim 1 -> P
    x = torch.randn(4, 6, 3, requires_grad=True)
    c = torch.randn(4, 3)
    (x.mean(1) * c).sum().backward()
    xl = chunk(x, 1)
    out = get_kernel("mean_partial")(axis_groups=(group,), self=xl, dim=[1], keepdim=False, dtype=None)
    out = collectives.all_reduce(out, group)
    close(out, x.mean(1).detach(), "mean forward")
    (out * c).sum().backward()
    close(xl.grad, x.grad.chunk(world_size, 1)[rank], "mean grad")

    # embedding_vocab_split: weight S(0), indices R -> P; a trivial second group checks nesting
    solo = [dist.new_group([r]) for r in range(world_size)][rank].group_name
    table = torch.randn(10, 4, requires_grad=True)
    idx = torch.randint(0, 10, (3, 5))
    idx[0, 0] = 7
    c = torch.randn(3, 5, 4)
    (F.embedding(idx, table, padding_idx=7) * c).sum().backward()
    tablel = chunk(table, 0)
    out = get_kernel("embedding_vocab_split")(
        axis_groups=(group, solo), weight=tablel, indices=idx, padding_idx=7, scale_grad_by_freq=False, sparse=False
    )
    out = collectives.all_reduce(out, group)
    close(out, F.embedding(idx, table).detach(), "embedding forward")
    (out * c).sum().backward()
    close(tablel.grad, table.grad.chunk(world_size, 0)[rank], "embedding weight grad")

    # cross_entropy_mean: self S(0), target S(0) -> R (whole), with ignored targets and class weights
    for weight, smoothing in ((None, 0.0), (torch.rand(5) + 0.5, 0.0), (None, 0.1)):
        logits = torch.randn(8, 5, requires_grad=True)
        target = torch.randint(0, 5, (8,))
        target[0] = target[1] = target[5] = -100  # uneven across ranks: the denominator is global
        loss = F.cross_entropy(logits, target, weight, label_smoothing=smoothing)
        loss.backward()
        logitsl = chunk(logits, 0)
        out = get_kernel("cross_entropy_mean")(
            axis_groups=(group,),
            self=logitsl,
            target=target.chunk(world_size)[rank],
            weight=weight,
            reduction=1,
            ignore_index=-100,
            label_smoothing=smoothing,
        )
        close(out, loss.detach(), f"cross entropy forward (weight={weight is not None}, ls={smoothing})")
        out.backward()
        close(logitsl.grad, logits.grad.chunk(world_size, 0)[rank], "cross entropy grad")

    # cross_entropy_vocab_split: self S(1) (classes split), target R -> R, ignored targets
    for reduction, name in ((0, "none"), (1, "mean"), (2, "sum")):
        logits = torch.randn(6, 10, requires_grad=True)
        target = torch.randint(0, 10, (6,))
        target[2] = -100
        ref = F.cross_entropy(logits, target, reduction=name)
        c = torch.randn(6) if reduction == 0 else torch.tensor(1.7)
        (ref * c).sum().backward()
        logitsl = chunk(logits, 1)
        out = get_kernel("cross_entropy_vocab_split")(
            axis_groups=(group, solo),
            self=logitsl,
            target=target,
            weight=None,
            reduction=reduction,
            ignore_index=-100,
            label_smoothing=0.0,
        )
        close(out, ref.detach(), f"vocab-parallel cross entropy forward ({name})")
        (out * c).sum().backward()
        close(logitsl.grad, logits.grad.chunk(world_size, 1)[rank], f"vocab-parallel cross entropy grad ({name})")
    # masked classes (-inf): rank 0's whole block of row 0 (its target is on rank 1), one class elsewhere
    logits = torch.randn(4, 10)
    logits[0, :5] = -math.inf
    logits[1, 7] = -math.inf
    logits.requires_grad_()
    target = torch.tensor([6, 2, 9, -100])
    ref = F.cross_entropy(logits, target)
    ref.backward()
    logitsl = chunk(logits, 1)
    out = get_kernel("cross_entropy_vocab_split")(axis_groups=(group,), self=logitsl, target=target, reduction=1)
    close(out, ref.detach(), "vocab-parallel cross entropy forward (masked classes)")
    out.backward()
    close(logitsl.grad, logits.grad.chunk(world_size, 1)[rank], "vocab-parallel cross entropy grad (masked classes)")

    # sync_batch_norm: input S(0) (and a trivial second group), weight/bias/stats R -> S(0)
    bn = nn.BatchNorm2d(3)
    nn.init.normal_(bn.weight)
    nn.init.normal_(bn.bias)
    x = torch.randn(4, 3, 2, 2, requires_grad=True)
    c = torch.randn(4, 3, 2, 2)
    ref = bn(x)
    (ref * c).sum().backward()
    xl = chunk(x, 0)
    weight = bn.weight.detach().clone().requires_grad_()
    bias = bn.bias.detach().clone().requires_grad_()
    running_mean, running_var = torch.zeros(3), torch.ones(3)
    out = get_kernel("sync_batch_norm")(
        axis_groups=(group, solo),
        input=xl,
        weight=weight,
        bias=bias,
        running_mean=running_mean,
        running_var=running_var,
        training=True,
        momentum=0.1,
        eps=1e-5,
        cudnn_enabled=False,
    )
    close(out, ref.detach().chunk(world_size, 0)[rank], "batch norm forward")
    full = collectives.all_gather(out, 0, group)
    (full * c).sum().backward()
    close(xl.grad, x.grad.chunk(world_size, 0)[rank], "batch norm input grad")
    close(partial_grad(weight), bn.weight.grad, "batch norm weight grad")
    close(partial_grad(bias), bn.bias.grad, "batch norm bias grad")
    close(running_mean, bn.running_mean, "running mean")
    close(running_var, bn.running_var, "running var")
    return "ok"


@pytest.mark.multiproc
def test_kernels_on_two_gloo_ranks(rank_pool):
    assert rank_pool(2).run(_kernels_on_ranks, timeout_s=60) == ["ok", "ok"]


# --------------------------------------------------------------------------------------------
# Strided shards (fused projections): every row that names one is simulated like any other.

STRIDED_CASES = {
    "split_qkv": (aten.split.Tensor, lambda: (torch.randn(4, 2, 24), 8, 2), 3),
    "split_with_sizes": (aten.split_with_sizes.default, lambda: (torch.randn(4, 24), [8, 8, 8], 1), 3),
    "chunk_gate_up": (aten.chunk.default, lambda: (torch.randn(4, 2, 24), 2, -1), 2),
    "addmm_conv1d": (aten.addmm.default, lambda: (torch.randn(24), torch.randn(4, 6), torch.randn(6, 24)), 3),
    "linear": (aten.linear.default, lambda: (torch.randn(2, 4, 6), torch.randn(24, 6), torch.randn(24)), 3),
    "view_keeps_dim": (aten.view.default, lambda: (torch.randn(8, 24), [2, 4, 24]), 3),
}


def _strided(result) -> bool:
    return any("/" in text for spec in result.strategy.ins + result.strategy.outs for text in format_spec(spec))


@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["mesh2", "mesh2x2"])
@pytest.mark.parametrize("case", list(STRIDED_CASES))
def test_strided_rows_are_exact(case, mesh):
    op, make_args, blocks = STRIDED_CASES[case]
    torch.manual_seed(0)
    with offering_strided((blocks,)):
        results = check_op(op, make_args(), mesh_shape=mesh)
    strided = [r for r in results if _strided(r)]
    assert strided, f"{case}: no strided strategy offered"
    bad = [(r.strategy, r.detail) for r in results if not r.ok]
    assert not bad, f"{case}: {bad}"


def test_strided_rows_only_where_the_graph_splits():
    torch.manual_seed(0)
    results = check_op(aten.addmm.default, (torch.randn(24), torch.randn(4, 6), torch.randn(6, 24)), mesh_shape=(2,))
    assert not any(_strided(r) for r in results), "no strided rows outside offering_strided"


def test_simulator_catches_a_plain_shard_split_as_if_strided():
    # The wrong row a strided rule stands in for: a plain S(1) cut of a fused [q | k | v] dim,
    # split locally, gives rank 0 all of q and half of k, not q_0, k_0, v_0.
    x = torch.randn(4, 24)
    kw = {"self": x, "split_size": 8, "dim": 1}
    wrong = Strategy(ins=((S(1),),), outs=((S(1),),) * 3)
    assert not check_strategy(aten.split.Tensor, kw, wrong, (2,)).ok
    right = Strategy(ins=((SS(1, 3),),), outs=((S(1),),) * 3)
    assert check_strategy(aten.split.Tensor, kw, right, (2,)).ok


@pytest.mark.parametrize("mesh", [(1, 2), (2, 1), (1, 1, 4)], ids=str)
def test_size_one_mesh_axes_carry_only_replicate_and_keep_the_rule_source(mesh):
    # On a mesh axis of size 1 S and P would only rename R, and plans mixing the names asked
    # the rewrite for S -> P (a pipelined Mistral's stage mesh (1, 2), issue 15).
    from torch.distributed.tensor import Replicate

    x, w = torch.randn(8, 16), torch.randn(32, 16)
    for target, args in [
        (torch.ops.aten.linear.default, (x, w)),
        (torch.ops.aten.add.Tensor, (x, x)),
        (torch.ops.aten.sum.dim_IntList, (x, [1])),
    ]:
        kw = _normalize(target, args, {})
        info = op_info_from_values("op", target, kw, target(*args))
        strategies = node_strategies(info, mesh)
        assert all(s.source == "rule" for s in strategies)
        for strategy in strategies:
            for spec in strategy.ins + strategy.outs:
                assert all(isinstance(spec[a], Replicate) for a, n in enumerate(mesh) if n == 1), strategy
        assert any(any(not isinstance(p, Replicate) for p in s.outs[0]) for s in strategies) or max(mesh) == 1


def test_expand_rows_keeps_valid_combinations_once_each_in_product_order():
    """Per-axis rows combine over the mesh in ``itertools.product`` order; a combination with an
    uneven shard is dropped, and one that repeats a kept strategy (its rows equal up to how
    they spell one output) is kept once."""
    from autopar.rules.registry import Row, expand_rows

    x = torch.randn(8, 6)
    info = op_info_from_values("t", torch.ops.aten.neg.default, {"self": x}, torch.neg(x))
    rows = [Row((R,), R), Row((S(0),), S(0)), Row((S(1),), (S(1),)), Row((S(1),), S(1)), Row((P,), P)]
    mesh = (2, 1, 4)
    strategies = expand_rows(info, rows, mesh)
    specs = [strategy.ins[0] for strategy in strategies]
    # Dim 1 (6) takes at most the axis of 2; the middle axis, of size 1, only R; S(1) once, spelt twice.
    assert specs == [(a, R, b) for a in (R, S(0), S(1), P) for b in (R, S(0), P)]
    assert all(strategy.outs[0] == strategy.ins[0] for strategy in strategies)
    assert len(set(specs)) == len(specs)


def _expand_by_product(info, rows, mesh):
    """``expand_rows`` as its docstring defines it: every combination of the product, kept where
    each spec ``is_valid``, with one kernel at most (a single-axis one on one axis), once each."""
    import itertools

    from autopar.ir.spec import is_valid
    from autopar.rules.registry import SINGLE_AXIS_KERNELS, replicate_row

    kept, seen = [], set()
    per_axis = [[replicate_row(info)] if size == 1 else rows for size in mesh]
    shapes = [arg.shape for arg in info.inputs] + list(info.out_shapes)
    for combo in itertools.product(*per_axis):
        kernels = {row.kernel for row in combo} - {None}
        kernel = kernels.pop() if len(kernels) == 1 else None
        kernel_axes = tuple(a for a, row in enumerate(combo) if kernel and row.kernel == kernel)
        ins = tuple(tuple(row.ins[i] for row in combo) for i in range(len(info.inputs)))
        outs = tuple(tuple(row.outs[i] for row in combo) for i in range(len(info.out_shapes)))
        if len(kernels) > 0 or (kernel in SINGLE_AXIS_KERNELS and len(kernel_axes) > 1):
            continue
        if not all(is_valid(shape, spec, mesh) for shape, spec in zip(shapes, ins + outs)):
            continue
        whole_grad = tuple((i, a) for a, row in enumerate(combo) for i in row.whole_grad)
        key = (ins, outs, kernel, kernel_axes, whole_grad)
        if key not in seen:
            seen.add(key)
            kept.append(Strategy(ins, outs, kernel, kernel_axes, "rule", whole_grad))
    return kept


@pytest.mark.parametrize("mesh", [(2, 3, 2), (4, 2, 2, 2), (2, 1, 4), (3, 4)], ids=str)
def test_expand_rows_equals_the_filtered_product(mesh):
    """Walking the axes with the divisibility checked per axis keeps exactly the combinations,
    in the order, that checking each combination of the product whole keeps: strided shards,
    kernels (one on one axis only among them), whole gradients and twice-spelt rows included."""
    import random

    from autopar.rules.registry import SINGLE_AXIS_KERNELS, Row, expand_rows

    x, y = torch.randn(12, 8, 6), torch.randn(12, 8, 6)
    info = op_info_from_values("t", torch.ops.aten.add.Tensor, {"self": x, "other": y}, x + y)
    placements = [R, P, S(0), S(1), S(2), S(3), SS(1, 2), SS(2, 3), SS(0, 4)]
    rng = random.Random(34)
    SINGLE_AXIS_KERNELS.add("test_single_axis")
    try:
        for _ in range(12):
            rows = []
            for _ in range(rng.randint(3, 9)):
                ins = (rng.choice(placements), rng.choice(placements))
                out = rng.choice(placements)
                kernel = rng.choice([None, None, "k", "other", "test_single_axis"])
                whole_grad = (1,) if ins[1] == R and rng.random() < 0.3 else ()
                rows.append(Row(ins, out if rng.random() < 0.7 else (out,), kernel, whole_grad))
            rows.append(Row((R, R), R))
            assert expand_rows(info, rows, mesh) == _expand_by_product(info, rows, mesh)
    finally:
        SINGLE_AXIS_KERNELS.discard("test_single_axis")
