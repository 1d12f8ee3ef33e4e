"""Tracing: ATen graph, FQNs, tied weights, composite ops kept whole, stable hashes."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from autopar.errors import TraceError
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


def test_gpt_trace_keeps_composites_and_maps_fqns():
    model = build_model("gpt", seed=0)
    traced = trace(model, example_batch("gpt", 4))
    targets = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    for op in ("linear", "layer_norm", "scaled_dot_product_attention", "embedding", "cross_entropy_loss"):
        assert f"aten.{op}.default" in targets, f"{op} was decomposed"
    params = {i.fqn for i in traced.placeholders("param")}
    assert set(dict(model.named_parameters()).keys()) <= params
    assert traced.ties["lm_head.weight"] == "transformer.wte.weight"
    assert all("val" in n.meta for n in traced.gm.graph.nodes if n.op != "output")


def test_graph_hash_is_stable_and_shape_sensitive():
    model = build_model("mlp", seed=0)
    first = trace(model, example_batch("mlp", 8)).graph_hash
    assert trace(model, example_batch("mlp", 8, seed=5)).graph_hash == first
    assert trace(model, example_batch("mlp", 16)).graph_hash != first


def test_data_dependent_control_flow_names_the_line():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(TraceError, match=re.escape(Path(__file__).name) + r":\d+: if x\.sum\(\) > 0") as info:
        trace(Branchy(), (torch.randn(4),))
    assert "torch.where" in str(info.value)


class _Routed(torch.nn.Module):
    """Sizes the data decides, as a mixture of experts or an adapter may compute them."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.gate = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.gate(x)
        if self.how == "mask":
            return h[h > 0].sum()
        rows = torch.nonzero(h.sum(1) > 0).squeeze(1)  # the rows routed here
        return h.index_select(0, rows).sum()


@pytest.mark.parametrize("how", ["mask", "nonzero"])
def test_a_size_the_data_decides_is_refused_naming_the_op_the_module_and_the_fix(how):
    # export traces these (an unbacked size); planning a fixed shape for them crashed in a rule
    with pytest.raises(TraceError, match=r"gives a size that depends on the data \(u\d+") as info:
        trace(_Routed(how), (torch.randn(6, 4),))
    assert "_Routed" in str(info.value) and "torch.where" in str(info.value), info.value


class _RotaryLike(torch.nn.Module):
    """A table computed under no_grad with autocast off (as Hugging Face rotary embeddings do),
    then used by a parameterized layer."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", torch.arange(1, 9, dtype=torch.float32) / 8)

    def forward(self, x):
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            table = torch.cos(x.detach() * self.inv_freq).float()
        return (self.proj(x) * table).sum()


def test_no_grad_and_autocast_off_regions_are_inlined_and_detached():
    model = _RotaryLike()
    x = torch.randn(4, 8, requires_grad=True)
    traced = trace(model, (x,))
    wrappers = [n for n in traced.gm.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    assert wrappers == [], [n.format_node() for n in wrappers]
    assert not any(n.op == "get_attr" for n in traced.gm.graph.nodes)
    detached = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.detach.default]
    assert detached and not any(n.meta["autopar"]["requires_grad"] for n in detached)
    params = [p for _, p in model.named_parameters()]
    buffers = [b for _, b in model.named_buffers()]
    (got,) = traced.gm(*params, *buffers, x)
    torch.testing.assert_close(got, model(x))


def _steps_as_eager(model, eager, inputs: tuple, steps: int = 3, lr: float = 0.1, seen=None) -> dict:
    """``model`` compiled on (1,) and ``eager`` each take ``steps`` SGD steps on the mean square of
    their outputs (``seen(module)`` after each backward); their whole states must then be equal.
    Returns eager's."""
    import autopar

    pm = autopar.compile(model, (1,), example_inputs=inputs, cluster="cpu")
    optimizers = [torch.optim.SGD(m.parameters(), lr=lr) for m in (pm, eager)]
    for _ in range(steps):
        for m, optimizer in zip((pm, eager), optimizers):
            m(*inputs).square().mean().backward()
            if seen is not None:
                seen(m)
            optimizer.step()
            optimizer.zero_grad()
    got, want = pm.full_state_dict(), eager.state_dict()
    assert set(got) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-12, atol=1e-12, msg=key)
    return want


def test_spectral_norm_power_iteration_under_no_grad_trains_as_eager(world_of_one):
    """``spectral_norm`` runs its power iteration under ``no_grad`` with ``out=`` ops on the weight,
    which needs grad: the inlined region reads its inputs detached, as ``no_grad`` runs them, and
    its buffers (``_u``, ``_v``) and the weight train as eager."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(8, 16)), torch.nn.Linear(16, 4))
    model = model.double()
    eager = copy.deepcopy(model)
    want = _steps_as_eager(model, eager, (torch.randn(6, 8, dtype=torch.float64),))
    assert any(key.endswith("_u") for key in want)  # the power iteration's buffers too


class _ClipsItsWeight(torch.nn.Module):
    """Weight clipping inside forward (a WGAN critic's, written there): the traced graph's later
    use read a detached alias, and trained 4.2 off eager on ddp, fsdp and megatron plans."""

    def __init__(self, write):
        super().__init__()
        self.a, self.b, self.write = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4), write

    def forward(self, x):
        with torch.no_grad():
            self.write(self.a.weight)
        return self.b(torch.relu(self.a(x))).sum()


class _MaxNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Embedding(50, 16, max_norm=1.0)  # renormalizes the rows it looks up, in place

    def forward(self, x):
        return self.a(x).sum()


@pytest.mark.parametrize(
    "model, op",
    [
        (lambda: _ClipsItsWeight(lambda w: w.clamp_(-0.2, 0.2)), "clamp_"),
        (lambda: _ClipsItsWeight(lambda w: w.mul_(1 / w.norm().clamp(min=1.0))), "mul_"),
        (_MaxNorm, "embedding_renorm_"),
    ],
)
def test_a_forward_that_writes_a_parameter_in_place_is_refused_with_the_fix(model, op):
    inputs = (torch.randint(0, 50, (4, 6)),) if model is _MaxNorm else (torch.randn(4, 16),)
    with pytest.raises(TraceError, match=rf"writes parameter 'a\.weight' in place \({op}.*pm\.module\.a\.weight"):
        trace(model(), inputs)


def test_autocast_enabled_inside_forward_is_refused_with_the_fix():
    class Autocasting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.proj(x).float().sum()

    with pytest.raises(TraceError, match="autocast"):
        trace(Autocasting(), (torch.randn(4, 8),))


def test_mixed_precision_traces_bf16_compute_with_fp32_masters_cast_at_use():
    from autopar.ir.options import precision_policy

    model = build_model("gpt", seed=0)
    batch = example_batch("gpt", 8, seed=1)
    before = {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()}
    plain = trace(model, batch)
    assert trace(model, batch, precision=precision_policy("32-true")).graph_hash == plain.graph_hash
    mixed = trace(model, batch, precision=precision_policy("bf16-mixed"))
    assert {name: (p.dtype, p.data_ptr()) for name, p in model.named_parameters()} == before, "the model is not cast"
    params = {i.name for i in mixed.inputs if i.kind == "param"}
    casts = [n for n in mixed.gm.graph.nodes if n.target is torch.ops.aten._to_copy.default and n.args[0].name in params]
    cast_params = {c.args[0].name for c in casts}
    assert len(casts) == len(cast_params) and cast_params
    for node in mixed.gm.graph.nodes:
        if node.name in cast_params:
            assert node.meta["val"].dtype == torch.float32
            assert all(user in casts for user in node.users), f"{node.name} is read only through its cast"
    cast = casts[0]
    assert cast.meta["val"].dtype == torch.bfloat16 and cast.meta["autopar"]["reduce_dtype"] == torch.float32
    linears = [n for n in mixed.gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and all(n.meta["val"].dtype == torch.bfloat16 for n in linears)
    true16 = trace(model, batch, precision=precision_policy("bf16-true"))
    assert not any(n.target is torch.ops.aten._to_copy.default and n.args[0].name in params for n in true16.gm.graph.nodes), (
        "bf16-true keeps bf16 weights: nothing to cast"
    )


# -- in-place writes through aliases are functionalized (issue 15) -----------------------------


class ShiftRight(torch.nn.Module):
    """Label shifting as encoder-decoders do it: in-place writes into a slice and a column of a
    new tensor, then a masked fill of the whole."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        inputs = labels.new_zeros(labels.shape)
        inputs[:, 1:] = labels[:, :-1].clone()
        inputs[:, 0] = 3
        inputs.masked_fill_(inputs == -100, 2)
        logits = self.head(self.emb(inputs))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_writes_into_views_are_functionalized_and_composites_stay_whole():
    from autopar.trace import aliased_writes

    labels = torch.randint(4, 64, (16, 8))
    model = ShiftRight()
    traced = trace(model, (labels,))
    targets = {n.target for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert not aliased_writes(traced.gm)
    assert {torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default} <= targets
    # aten.copy has no derivative: the trace writes it as the value it is.
    assert torch.ops.aten.copy_.default not in targets and torch.ops.aten.copy.default not in targets
    assert {torch.ops.aten.embedding.default, torch.ops.aten.linear.default, torch.ops.aten.cross_entropy_loss.default} <= targets
    state = dict(model.named_parameters())
    values = [
        state[i.fqn].detach() if i.kind == "param" else traced.constants[i.name] if i.kind == "constant" else labels
        for i in traced.inputs
    ]
    assert torch.equal(traced.gm(*values)[0], model(labels))


def test_a_mutated_buffer_is_written_back_in_place():
    class Counter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.register_buffer("seen", torch.zeros(2, 4))

        def forward(self, x):
            self.seen[0].add_(x.sum(0))  # a write into a view of a buffer
            return self.lin(x).sum()

    traced = trace(Counter(), (torch.randn(3, 4),))
    copies = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert len(copies) == 1 and copies[0].args[0].name == next(i.name for i in traced.inputs if i.kind == "buffer")
    assert len(traced.gm.graph.output_node().args[0]) == 1  # the model's one output, no mutation outputs


def test_a_model_without_aliased_writes_keeps_the_graph_export_gives():
    model = build_model("gpt", seed=0)
    batch = example_batch("gpt", 4)
    exported = torch.export.export(model, batch, strict=False)
    traced = trace(model, batch)
    ops = [str(n.target) for n in exported.graph_module.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"] == ops


@pytest.mark.parametrize("name", ["input", "type", "id", "sum", "slice", "inf", "device"])
def test_argument_names_survive_graph_copies(name):
    # fx renames a node named after a Python builtin when it copies the graph (compile rewrites a
    # copy, and plans are keyed by node name): such a name is replaced once, at trace time.
    namespace: dict = {}
    exec(f"def forward(self, {name}):\n    return ({name} * 2.0).sum()", namespace)  # noqa: S102
    model = type("Named", (torch.nn.Module,), {"forward": namespace["forward"]})()
    traced = trace(model, (torch.randn(4, 4),))
    names = [n.name for n in traced.gm.graph.nodes]
    assert name not in names
    assert [n.name for n in copy.deepcopy(traced.gm).graph.nodes] == names
    assert [gi.name for gi in traced.inputs] == [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]


def test_module_backward_hooks_are_refused_and_forward_hooks_said_once(caplog) -> None:
    """A module's backward hook would not run in the compiled module (its gradients come from the
    graph), so tracing refuses it; forward hooks are traced (their outputs kept), which is said."""
    import logging

    from autopar.trace import trace_repeated
    from autopar.trace.hooks import _said

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    x = (torch.randn(3, 4),)
    hooked = model()
    hooked[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    with pytest.raises(TraceError, match=r"module '2' has a backward hook.*p.register_hook"):
        trace(hooked, x)
    hooked = model()
    hooked[0].weight.register_hook(lambda grad: grad * 2)  # a tensor hook on a parameter is traced: no error
    trace(hooked, x)
    hooked = model()
    hooked[0].register_forward_hook(lambda module, args, out: out * 2)
    _said.clear()
    with caplog.at_level(logging.WARNING, logger="autopar"):
        trace_repeated(hooked, x)
        trace(hooked, x)
    notices = [r.getMessage() for r in caplog.records if "forward hooks on '0'" in r.getMessage()]
    assert len(notices) == 1, notices


def test_sync_batch_norm_traces_as_batch_norm_and_trains_as_eager(world_of_one):
    """Under a process group ``SyncBatchNorm`` would all-gather its statistics while tracing (and
    refuse a CPU input): it traces as the ``BatchNorm`` it converts from, whose statistics a plan
    takes over the whole batch, and equals that model in eager, running statistics too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(2)
    )
    x = torch.randn(6, 3, 6, 6, dtype=torch.float64)
    model = model.double()
    model(x)  # the lazy layer's shape
    eager = copy.deepcopy(model)
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(synced[1], torch.nn.SyncBatchNorm)
    traced = trace(synced, (x,))
    assert [str(n.target) for n in traced.gm.graph.nodes] == [str(n.target) for n in trace(eager, (x,)).gm.graph.nodes]
    assert any("SyncBatchNorm layer traced as BatchNorm" in note for note in traced.notes)
    assert "forward" not in synced[1].__dict__  # the module's own forward again
    _steps_as_eager(synced, eager, (x,))


def test_a_sparse_embedding_gives_dense_gradients_and_trains_as_eager(world_of_one):
    """``nn.Embedding(sparse=True)``'s sparse gradient fits no collective or bucket: the graph's
    embedding gives a dense one, the same numbers, which torch's SGD steps as eager steps the sparse."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8, sparse=True), torch.nn.Linear(8, 3)).double()
    eager = copy.deepcopy(model)
    ids = torch.tensor([[1, 4, 4], [7, 1, 2]])
    traced = trace(model, (ids,))
    assert any("1 embedding with sparse=True gives dense gradients" in note for note in traced.notes)
    sparse = []
    _steps_as_eager(
        model, eager, (ids,), lr=0.5, seen=lambda m: sparse.append(dict(m.named_parameters())["0.weight"].grad.is_sparse)
    )
    assert sparse == [False, True] * 3  # the compiled module's dense, eager's sparse
