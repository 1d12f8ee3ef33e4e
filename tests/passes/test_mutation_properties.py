"""Property tests for in-place writes and argument names, checked by the numerics guard.

Random small models write in place into views of a tensor (setitem on slices and selects,
``copy_``, ``fill_``, ``mul_``, ``masked_fill_``, ``zero_`` on a slice, a chunk, a view or a
transpose, and the scatter family), then read the whole tensor; others name their forward
arguments after Python builtins (``input``, ``type``, ``id``...), which fx renames when it copies
a graph. Each is planned on mesh (2, 2) with random forced specs (so the plans really shard) and
run for every rank in one process by ``autopar.runtime.tools.numerics.check_numerics``, which must
find the loss, every gradient and every planned node equal to eager. (Issue 15's fixed patterns,
teacher forcing and ``nn.Sequential``, are in tests/runtime/test_numerics.py.)
"""

from __future__ import annotations

import operator
import random

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from autopar.cost.cluster import get_cluster
from autopar.errors import InfeasibleError
from autopar.runtime.tools.numerics import check_numerics
from autopar.solver import solve
from autopar.solver.problem.choices import build_choice_graph
from autopar.trace import aliased_writes, trace

MESH = (2, 2)
SETTINGS = settings(
    max_examples=8,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example plans and runs 4 ranks
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
B, T, C = 4, 8, 16

# In-place writes into a view of y (B, T, C); h is a tensor of y's shape that needs gradients,
# g one that does not.
WRITES = [
    "y[:, {a}:{b}] = h[:, {c}:{c} + {b} - {a}]",
    "y[:, :, {a}:{b}] = h[:, :, {a}:{b}] * 2.0",
    "y[:, {i}] = h[:, {j}]",
    "y[:, {a}:{b}] = 0.5",
    "y[..., {i}] = h[..., {j}] + 1.0",
    # autograd forbids writing into one of several views (chunk) of a tensor that needs
    # gradients: these write into g, which does not (as label shifting writes into token ids).
    "g.chunk(2, {dim})[{k}].mul_(3.0)",
    "g.chunk(2, {dim})[{k}].fill_(0.25)",
    "g.chunk(2, {dim})[{k}].copy_(x.chunk(2, {dim})[{k2}])",
    "g.chunk(2, {dim})[{k}].add_(x.chunk(2, {dim})[{k2}])",
    "g.unbind(1)[{i}].zero_()",
    "y.view(B, T, 4, 4)[:, :, {k}, :].zero_()",
    "y.transpose(1, 2)[:, {a}:{b}].mul_(-1.0)",
    "y[:, {a}:{b}].masked_fill_(h[:, {a}:{b}] > 0, 0.0)",
    "y.narrow(1, {a}, {b} - {a}).copy_(h.narrow(1, {c}, {b} - {a}))",
    "y.select(2, {i}).copy_(h.select(2, {j}))",
    "y.scatter_(2, torch.arange(C).flip(0).expand(B, T, C)[:, :, :{b}], h[:, :, :{b}])",
    "y.scatter_add_(1, torch.arange(T).roll(1).expand(C, B, T).permute(1, 2, 0), h)",
    "y.index_add_(1, torch.tensor([{i}, {j}]), h[:, :2])",
    "y[:, torch.tensor([{i}, {j}])] = h[:, :2]",
    "y.index_put_((torch.tensor([{i} % B]),), h[:1] * 3.0)",
]
BASES = ["h.clone()", "torch.zeros_like(h)", "h * 1.0", "h.new_ones(h.shape)"]


def _source(base: str, writes: list[str], names: tuple[str, str] = ("x", "w")) -> str:
    x, w = names
    lines = [f"def forward(self, {x}, {w}):", f"    h = self.fc({x}) * {w}", f"    y = {base}", f"    g = {x} * {w}"]
    lines += [f"    {line}".replace("x.", f"{x}.") for line in writes]
    lines += ["    z = self.fc2(y) + h * g", "    return (z * z).mean()"]
    return "\n".join(lines)


def _model(source: str) -> torch.nn.Module:
    namespace = {"torch": torch, "B": B, "T": T, "C": C}
    exec(source, namespace)  # noqa: S102 - test programs built from the fixed tables above

    class Program(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(C, C)
            self.fc2 = torch.nn.Linear(C, C)

        forward = namespace["forward"]

    torch.manual_seed(0)
    return Program()


@st.composite
def write_programs(draw) -> str:
    base = draw(st.sampled_from(BASES))
    writes = []
    for _ in range(draw(st.integers(1, 3))):
        a = draw(st.integers(0, T - 2))
        b = draw(st.integers(a + 1, T))
        values = dict(
            a=a,
            b=b,
            c=draw(st.integers(0, T - (b - a))),
            i=draw(st.integers(0, T - 1)),
            j=draw(st.integers(0, T - 1)),
            dim=draw(st.integers(0, 2)),
            k=draw(st.integers(0, 1)),
            k2=draw(st.integers(0, 1)),
        )
        writes.append(draw(st.sampled_from(WRITES)).format(**values))
    return _source(base, writes)


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, C, generator=generator), torch.randn(B, T, C, generator=generator)


def _forced_plan(traced, seed: int):
    """A plan with a few random op outputs forced to random specs (the cpu preset alone keeps
    models this small replicated, which would check nothing)."""
    cluster = get_cluster("cpu")
    graph = build_choice_graph(traced, MESH, cluster)
    ops = [
        graph.choices[n]
        for n in graph.order
        if graph.choices[n].kind == "op"
        and graph.choices[n].out_shapes
        and traced.node(n).target is not operator.getitem
        and len(graph.choices[n].out_specs(0)) > 1
    ]
    rng = random.Random(seed)
    for _ in range(20):
        chosen = rng.sample(ops, min(len(ops), rng.randint(1, 4)))
        forced = {c.name: rng.choice(c.out_specs(0)) for c in chosen}
        try:
            return solve(traced, MESH, cluster, forced=forced)
        except InfeasibleError:
            continue
    return solve(traced, MESH, cluster)


def _check(model: torch.nn.Module, inputs: tuple, seed: int, source: str) -> None:
    traced = trace(model, inputs)
    assert not aliased_writes(traced.gm), f"writes through a view survived tracing:\n{source}"
    plan = _forced_plan(traced, seed)
    result = check_numerics(model, plan, inputs)
    assert result.ok, f"{result.text()}\n{source}"


@SETTINGS
@given(source=write_programs(), seed=st.integers(0, 2**16))
def test_in_place_writes_into_views_equal_eager(source: str, seed: int) -> None:
    _check(_model(source), _inputs(), seed, source)


# Python builtins and the names fx reserves for its generated code.
ARGUMENT_NAMES = [
    "input",
    "type",
    "id",
    "sum",
    "max",
    "slice",
    "object",
    "format",
    "iter",
    "len",
    "torch",
    "device",
    "inf",
    "nan",
    "pytree",
    "x",
]


@SETTINGS
@given(
    names=st.tuples(st.sampled_from(ARGUMENT_NAMES), st.sampled_from(ARGUMENT_NAMES)).filter(lambda n: n[0] != n[1]),
    seed=st.integers(0, 2**16),
)
def test_any_argument_names_compile(names: tuple[str, str], seed: int) -> None:
    if "torch" in names:  # the body below calls torch; an argument of that name would shadow it
        names = tuple("torch_" if n == "torch" else n for n in names)
    source = _source("h.clone()", ["y[:, 1:] = h[:, :-1]"], names)
    _check(_model(source), _inputs(), seed, source)
