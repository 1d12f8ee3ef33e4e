"""``trace.attention``: a traced mask that is provably causal becomes SDPA's ``is_causal=True``.

Hand-written attention builds its mask in many ways; each case traces the model, says whether its
SDPA call must come out causal and maskless, and runs the traced graph against eager (float64).
The rewritten call of a Hugging Face LLaMA then runs under the numerics guard on the plans its
rule allows (``test_attention_compiled.py`` trains compiled Hugging Face models against eager).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from autopar.cost.cluster import get_cluster
from autopar.ir.spec import S as Shard
from autopar.runtime.tools.numerics import check_numerics
from autopar.solver import solve
from autopar.trace import trace
from autopar.trace.attention import EXAMPLE_MASK, causal_attention

L, S, E, HEADS = 6, 6, 8, 2
SDPA = torch.ops.aten.scaled_dot_product_attention.default
NEG = float("-inf")


def _positions(x: torch.Tensor, length: int) -> torch.Tensor:
    return torch.arange(length, device=x.device)


def _tril_bool(x, q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool, device=x.device).tril()


def _triu_inf(x, q_len, k_len):
    return torch.full((q_len, k_len), NEG, dtype=x.dtype, device=x.device).triu(1)


def _comparison(x, q_len, k_len):
    return _positions(x, q_len)[:, None] >= _positions(x, k_len)[None, :]


def _where_finfo_min(x, q_len, k_len):
    # Hugging Face's additive convention, expanded over the batch as its masks are.
    allowed = _positions(x, k_len)[None, :] <= _positions(x, q_len)[:, None]
    mask = torch.where(allowed, x.new_zeros(()), torch.finfo(x.dtype).min)
    return mask[None, None].expand(x.shape[0], 1, q_len, k_len)


def _masked_fill_in_place(x, q_len, k_len):
    mask = torch.zeros(q_len, k_len, dtype=x.dtype)
    mask.masked_fill_(torch.ones(q_len, k_len, dtype=torch.bool).triu(1), NEG)
    return mask


def _vmap(x, q_len, k_len):
    return torch.vmap(lambda row: _positions(x, k_len) <= row)(_positions(x, q_len))


def _top_left_short_query(x, q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril()


CAUSAL = {
    "tril-bool": _tril_bool,
    "triu-inf": _triu_inf,
    "comparison": _comparison,
    "where-finfo-min-batch": _where_finfo_min,
    "masked-fill-in-place": _masked_fill_in_place,
    "vmap": _vmap,
}


def _sliding_window(x, q_len, k_len):
    query, key = _positions(x, q_len)[:, None], _positions(x, k_len)[None, :]
    return (key <= query) & (key > query - 3)


def _bottom_right(x, q_len, k_len):
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)


def _large_negative(x, q_len, k_len):
    return torch.full((q_len, k_len), -1e4, dtype=x.dtype).triu(1)  # shifts scores; not exact


def _random(x, q_len, k_len):
    return torch.rand(q_len, k_len) < 2  # all True, but drawn: nothing proves it


def _from_data(x, q_len, k_len):
    return _tril_bool(x, q_len, k_len) & (x.sum(-1)[:, :, :, None] > -1e9)


def _written_by_data(x, q_len, k_len):
    mask = torch.ones(q_len, k_len, dtype=torch.bool).tril()
    mask.logical_and_(x[0, 0].sum(-1)[:, None] > -1e9)  # an in-place write of data into a constant
    return mask


KEPT = {
    "sliding-window": _sliding_window,
    "additive-1e4": _large_negative,
    "random": _random,
    "from-data": _from_data,
    "written-by-data": _written_by_data,
}


class _Attention(nn.Module):
    """Two layers share one mask built by ``build(x, q_len, k_len)``; ``q_len`` may be shorter."""

    def __init__(self, build, q_len: int = L, extra_use: bool = False, dropout: float = 0.0):
        super().__init__()
        self.build, self.q_len, self.extra_use, self.dropout = build, q_len, extra_use, dropout
        self.layers = nn.ModuleList(nn.Linear(E, 3 * E) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        heads = x.view(batch, S, HEADS, E // HEADS).transpose(1, 2)
        mask = self.build(heads, self.q_len, S)
        for layer in self.layers:
            q, k, v = layer(x).view(batch, S, 3 * HEADS, E // HEADS).transpose(1, 2).chunk(3, 1)
            out = F.scaled_dot_product_attention(q[:, :, : self.q_len], k, v, attn_mask=mask, dropout_p=self.dropout)
            x = x + F.pad(out.transpose(1, 2).reshape(batch, self.q_len, E), (0, 0, 0, S - self.q_len))
        return x.sum() + (mask.float().sum() if self.extra_use else 0)


def _run_traced(traced, model: nn.Module, args: tuple) -> torch.Tensor:
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    users = iter(pytree.tree_leaves(args))
    values = [
        state[gi.fqn] if gi.kind in ("param", "buffer") else traced.constants[gi.name] if gi.kind == "constant" else next(users)
        for gi in traced.inputs
    ]
    return traced.gm(*values)[0]


def _sdpa_calls(traced) -> list[str]:
    """For each SDPA call of the traced graph: "mask" (it passes one), "causal" or "plain"."""
    kinds = []
    for call in (n for n in traced.gm.graph.nodes if n.target is SDPA):
        has_mask, causal = len(call.args) > 3 and call.args[3] is not None, bool(call.kwargs.get("is_causal"))
        assert not (has_mask and causal), call.format_node()
        kinds.append("mask" if has_mask else "causal" if causal else "plain")
    return kinds


def _traced_against_eager(model: nn.Module):
    torch.manual_seed(0)
    model = model.double()
    x = torch.randn(2, S, E, dtype=torch.float64)
    traced = trace(model, (x,))
    torch.testing.assert_close(_run_traced(traced, model, (x,)), model(x), rtol=1e-12, atol=1e-12)
    return traced


@pytest.mark.parametrize("build", CAUSAL.values(), ids=CAUSAL.keys())
def test_a_causal_mask_however_built_becomes_is_causal_and_its_construction_goes(build):
    traced = _traced_against_eager(_Attention(build))
    assert _sdpa_calls(traced) == ["causal"] * 2
    ops = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not ops & {"aten.tril.default", "aten.triu.default", "aten.ge.Tensor", "aten.le.Tensor", "aten.where.self"}


def test_torch_aligns_is_causal_top_left_so_a_shorter_query_may_still_be_causal():
    assert _sdpa_calls(_traced_against_eager(_Attention(_top_left_short_query, q_len=4))) == ["causal"] * 2
    assert _sdpa_calls(_traced_against_eager(_Attention(_bottom_right, q_len=4))) == ["mask"] * 2


@pytest.mark.parametrize("build", KEPT.values(), ids=KEPT.keys())
def test_a_mask_that_is_not_provably_causal_stays(build):
    assert _sdpa_calls(_traced_against_eager(_Attention(build))) == ["mask"] * 2


class _MaskWrittenBetweenLayers(_Attention):
    """The first layer reads the causal mask; then the mask is narrowed in place to a window of 2."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        mask = _triu_inf(x, S, S)
        for index, layer in enumerate(self.layers):
            if index == 1:
                mask[2:, :].masked_fill_(torch.ones(S - 2, S, dtype=torch.bool).tril(), NEG)  # through a view
            q, k, v = layer(x).view(batch, S, 3 * HEADS, E // HEADS).transpose(1, 2).chunk(3, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + out.transpose(1, 2).reshape(batch, S, E)
        return x.sum()


def test_a_mask_proved_once_is_proved_again_after_an_in_place_write():
    model = _MaskWrittenBetweenLayers(_triu_inf)
    assert _sdpa_calls(_traced_against_eager(model)) == ["causal", "mask"]
    # The pass on export's own graph, where both calls read one mask node and the write goes
    # through a view of it between them (``trace`` functionalizes such writes first).
    gm = torch.export.export(model, (torch.randn(2, S, E, dtype=torch.float64),)).graph_module
    assert [call.args[3].name for call in gm.graph.nodes if call.target is SDPA] == ["triu", "triu"]
    causal_attention(gm)
    assert _sdpa_calls(SimpleNamespace(gm=gm)) == ["causal", "mask"]


def test_the_proof_reads_the_mask_it_holds_not_the_scores_it_is_expanded_to(monkeypatch):
    # Hugging Face expands its mask over the batch; a proof over the scores' shape (batch × heads
    # × q × k) once spent minutes on a batch of 128. One (q, k) plane is all this mask holds.
    compared, equal = [], torch.equal

    def recording(a, b):
        if a.dtype == torch.bool:
            compared.append(max(a.numel(), b.numel()))
        return equal(a, b)

    monkeypatch.setattr(torch, "equal", recording)
    assert _sdpa_calls(_traced_against_eager(_Attention(_where_finfo_min))) == ["causal"] * 2
    assert compared and max(compared) == L * S


@pytest.mark.parametrize(
    "build",
    [
        lambda x, q_len, k_len: torch.ones(q_len, k_len, dtype=torch.bool),
        lambda x, q_len, k_len: x.new_zeros(x.shape[0], 1, 1, k_len),
    ],
    ids=["all-true", "additive-zeros"],
)
def test_a_mask_that_masks_nothing_is_dropped_as_eager_drops_an_encoders(build):
    assert _sdpa_calls(_traced_against_eager(_Attention(build))) == ["plain"] * 2


def test_a_mask_that_feeds_another_op_is_kept_for_it_and_attention_with_dropout_is_still_rewritten():
    traced = trace(_Attention(_tril_bool, extra_use=True, dropout=0.1).train(), (torch.randn(2, S, E),))
    assert _sdpa_calls(traced) == ["causal"] * 2
    assert any(n.target is torch.ops.aten.tril.default for n in traced.gm.graph.nodes)
    assert _sdpa_calls(_traced_against_eager(_Attention(_tril_bool, extra_use=True))) == ["causal"] * 2


def test_a_mask_kept_in_a_buffer_stays_because_a_buffer_can_change():
    class Buffered(_Attention):
        def __init__(self):
            super().__init__(lambda x, q_len, k_len: self.causal)
            self.register_buffer("causal", torch.ones(L, S, dtype=torch.bool).tril())

    assert _sdpa_calls(_traced_against_eager(Buffered())) == ["mask"] * 2


def test_a_mask_held_as_a_plain_tensor_attribute_is_a_lifted_constant_and_is_proved():
    class Constant(_Attention):
        def __init__(self):
            super().__init__(lambda x, q_len, k_len: self.causal)
            self.causal = torch.zeros(L, S).masked_fill(torch.ones(L, S, dtype=torch.bool).triu(1), NEG)

    model = Constant()
    traced = _traced_against_eager(model)
    assert [gi.kind for gi in traced.inputs].count("constant") == 1
    assert _sdpa_calls(traced) == ["causal"] * 2


def test_a_meta_device_model_is_proved_on_the_cpu(caplog):
    with torch.device("meta"):
        model = _Attention(_where_finfo_min)
    with caplog.at_level(logging.INFO, logger="autopar.trace.attention"):
        traced = trace(model, (torch.randn(2, S, E, device="meta"),))
    assert _sdpa_calls(traced) == ["causal"] * 2
    assert "of 2 masked attention calls, 2 are causal" in caplog.text


def test_the_pass_rewrites_the_private_sdpa_variants_by_their_schema():
    q = torch.randn(1, 2, 4, 8)  # (the kernel is CUDA's; the pass only reads shapes)
    mask = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), NEG)

    class Efficient(nn.Module):
        def forward(self, q, k, v):
            return torch.ops.aten._scaled_dot_product_efficient_attention.default(q, k, v, mask, False)[0]

    gm = torch.fx.symbolic_trace(Efficient())
    for node in gm.graph.nodes:
        node.meta["val"] = q  # the pass reads the query's and key's shapes
    assert causal_attention(gm) == 1
    (call,) = [n for n in gm.graph.nodes if n.op == "call_function" and "efficient" in str(n.target)]
    assert call.args[3] is None and call.kwargs["is_causal"] is True


@pytest.mark.parametrize(
    "mesh,spec,kernel",
    [((2,), (Shard(2),), "sdpa_context_parallel"), ((2,), (Shard(1),), None)],
    ids=["sequence-context-parallel", "heads"],
)
def test_rewritten_hf_attention_runs_sharded_as_eager(mesh, spec, kernel):
    """The rewritten causal call on the plans its rule allows: split by sequence (the
    context-parallel kernel, which only a maskless causal call gets) or by heads."""
    from tests.zoo import hf_models

    model, kwargs = hf_models.llama(batch_size=2)
    model = model.double()
    traced = trace(model, (), kwargs)
    names = [n.name for n in traced.gm.graph.nodes if n.target is SDPA]
    plan = solve(traced, mesh, get_cluster("cpu"), forced={name: spec for name in names})
    assert names and all(plan.nodes[name].kernel == kernel for name in names)
    result = check_numerics(model, plan, (), kwargs, tolerance=1e-10)
    assert result.ok, result.text()


def _padded_from_data(x, q_len, k_len):
    return _tril_bool(x, q_len, k_len) & (x.sum(-1)[:, :, :, None] > 0)  # some rows of random data pad


def _example_masks(traced) -> list[str | None]:
    from autopar.rules.registry import op_info

    calls = [n for n in traced.gm.graph.nodes if n.target is SDPA]
    assert [op_info(n).example_mask for n in calls] == [n.meta.get(EXAMPLE_MASK) for n in calls]
    return [n.meta.get(EXAMPLE_MASK) for n in calls]


def test_a_mask_from_the_batch_is_marked_causal_where_the_example_makes_it_so():
    # The mask stays in the graph (another batch may pad), and the runtime attends causally in the
    # calls where it is causal (ops.causal_mask): the cost model prices the example's kernel.
    torch.manual_seed(0)
    x = torch.randn(2, S, E)
    assert _example_masks(trace(_Attention(_from_data), (x,))) == ["causal"] * 2
    assert _sdpa_calls(trace(_Attention(_from_data), (x,))) == ["mask"] * 2
    assert _example_masks(trace(_Attention(_padded_from_data), (x,))) == [None] * 2
    assert _example_masks(trace(_Attention(_sliding_window), (x,))) == [None] * 2  # no input: proved (kept) at trace
    assert _example_masks(trace(_Attention(_from_data).to("meta"), (x.to("meta"),))) == [None] * 2  # no values


def test_hugging_face_masks_from_an_unpadded_batch_are_priced_causal():
    from tests.zoo import hf_models

    model, kwargs = hf_models.llama(batch_size=2)
    ones = {**kwargs, "attention_mask": torch.ones_like(kwargs["input_ids"])}
    padded = {**kwargs, "attention_mask": ones["attention_mask"].clone()}
    padded["attention_mask"][0, :3] = 0
    assert _example_masks(trace(model, (), ones)) == ["causal"] * 2
    assert _example_masks(trace(model, (), padded)) == [None] * 2
