"""Property tests: random programs, random forced plans, and plan JSON round trips.

1. Random small programs of supported ops (matmuls, pointwise with broadcasting, reductions,
   views, softmax, layer_norm) with random small shapes (1..8 per dim, so some dims divide by the
   mesh axes and some do not) are traced as autopar traces them, run on real tensors, and every
   strategy of every op call is simulated on meshes (2,), (3,) and (2, 2) with ``check_op``.
2. Random forced plans for ``mlp_block`` and a bias-free GPT, compiled and run on two gloo ranks,
   give eager's loss and gradients.
3. Plans survive ``to_json``/``from_json`` exactly, real ones and random ones.

Two autopar bugs these found are fixed and stay tested here: a traced ``aten.view`` replayed on
a resharded tensor whose strides changed (``TransposeMulView``; the localize pass now emits
``reshape``), and ``solve(forced=...)`` planning a getitem apart from its producer (edges into a
getitem are never resharded).
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import random
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.ir.plan import NodePlan, Plan
from autopar.ir.prediction import Prediction, SolverStats
from autopar.ir.spec import format_spec, is_valid
from autopar.rules.registry import op_info_from_values
from autopar.rules.simulate import _normalize, check_op
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch
from tests.conftest import strategy_text

MESHES = [(2,), (3,), (2, 2)]
PROGRAM_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],  # one_thread is set once per test
)


# =============================================================================================
# 1. Random programs of supported ops, every strategy simulated
# =============================================================================================


@dataclass(frozen=True)
class Step:
    """``v{len(values)} = op(values[src], *others, **params)``; others are ("in", i) or ("v", j)."""

    op: str
    src: int
    others: tuple[tuple[str, int], ...] = ()
    params: tuple[tuple[str, Any], ...] = ()

    def code(self, out: int) -> str:
        args = [f"v{self.src}"] + [f"{kind}{i}" for kind, i in self.others]
        args += [f"{k}={v!r}" for k, v in self.params]
        return f"v{out} = {self.op}({', '.join(args)})"


@dataclass(frozen=True)
class Program:
    """Input 0 is v0; extra inputs (weights, broadcast operands) are in1, in2, ..."""

    inputs: tuple[tuple[int, ...], ...]
    steps: tuple[Step, ...]

    def __repr__(self) -> str:
        lines = [f"in{i}: {list(shape)}" for i, shape in enumerate(self.inputs)]
        lines += [step.code(k + 1) for k, step in enumerate(self.steps)]
        return "Program(\n    " + "\n    ".join(lines) + "\n)"


def _apply(step: Step, x: torch.Tensor, others: list[torch.Tensor]) -> torch.Tensor:
    p = dict(step.params)
    op = step.op
    if op == "mm":
        return torch.mm(x, others[0])
    if op == "bmm":
        return torch.bmm(x, others[0])
    if op == "matmul":
        return torch.matmul(x, others[0])
    if op == "linear":
        return F.linear(x, others[0], others[1] if len(others) > 1 else None)
    if op in ("add", "mul", "sub"):
        a, b = (others[0], x) if p["swap"] else (x, others[0])
        return {"add": torch.add, "mul": torch.mul, "sub": torch.sub}[op](a, b)
    if op == "gelu":
        return F.gelu(x)
    if op == "relu":
        return F.relu(x)
    if op == "exp":
        return torch.exp(x)
    if op == "neg":
        return -x
    if op == "mul_scalar":
        return x * p["c"]
    if op == "sum":
        return x.sum(p["dim"], keepdim=p["keepdim"])
    if op == "mean":
        return x.mean(p["dim"], keepdim=p["keepdim"])
    if op == "amax":
        return x.amax(p["dim"], keepdim=p["keepdim"])
    if op == "view":
        return x.view(p["shape"])
    if op == "reshape":
        return x.reshape(p["shape"])
    if op == "transpose":
        return x.transpose(p["dim0"], p["dim1"])
    if op == "permute":
        return x.permute(p["dims"])
    if op == "unsqueeze":
        return x.unsqueeze(p["dim"])
    if op == "flatten":
        return x.flatten(p["start"], p["end"])
    if op == "softmax":
        return torch.softmax(x, p["dim"])
    if op == "log_softmax":
        return torch.log_softmax(x, p["dim"])
    if op == "layer_norm":
        weight = others[0] if p["weight"] else None
        bias = others[-1] if p["bias"] else None
        return F.layer_norm(x, (x.shape[-1],), weight, bias)
    raise AssertionError(f"unknown op {op}")


class ProgramModule(torch.nn.Module):
    def __init__(self, program: Program):
        super().__init__()
        self.program = program

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = [inputs[0]]
        for step in self.program.steps:
            others = [inputs[i] if kind == "in" else values[i] for kind, i in step.others]
            values.append(_apply(step, values[step.src], others))
        return tuple(values[1:])  # every value is an output, so none is dead code


OPS = (
    "mm",
    "bmm",
    "linear",
    "matmul",
    "add",
    "mul",
    "sub",
    "gelu",
    "relu",
    "exp",
    "neg",
    "mul_scalar",
    "sum",
    "mean",
    "amax",
    "view",
    "reshape",
    "transpose",
    "permute",
    "unsqueeze",
    "flatten",
    "softmax",
    "log_softmax",
    "layer_norm",
)
# 1..8, with the even sizes twice as likely (hypothesis's integers() favour 1 and the bounds), so
# that dims often divide by the mesh axes (2, 3 and 2x2) and often do not.
SIZES = st.sampled_from([2, 4, 6, 8, 1, 3, 5, 7, 2, 4, 6, 8])
MAX_NDIM = 4


def _dim(draw, ndim: int, extra: int = 0) -> int:
    """A dim in [-ndim - extra, ndim + extra), negative ones included."""
    return draw(st.integers(-ndim - extra, ndim + extra - 1))


def _broadcast_operand(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with ``shape`` (dims equal or 1, fewer or one more leading)."""
    out = []
    for size in shape:
        if size == 1:
            out.append(draw(SIZES))
        else:
            out.append(draw(st.sampled_from([size, size, 1])))
    drop = draw(st.integers(0, len(shape) - 1))
    out = out[drop:]
    if drop == 0 and len(shape) < MAX_NDIM and draw(st.booleans()):
        out = [draw(SIZES)] + out
    return tuple(out)


def _draw_step(draw, values: list[torch.Tensor], inputs: list[tuple[int, ...]]) -> Step | None:
    """One random op applied to a random earlier value; None when the op does not fit."""
    src = draw(st.integers(0, len(values) - 1)) if draw(st.integers(0, 3)) == 0 else len(values) - 1
    op = draw(st.sampled_from(OPS))
    if op in ("mm", "bmm") and values[src].ndim != {"mm": 2, "bmm": 3}[op]:
        # take an earlier value of the rank the op needs, if there is one
        fitting = [j for j, v in enumerate(values) if v.ndim == {"mm": 2, "bmm": 3}[op]]
        if fitting:
            src = draw(st.sampled_from(fitting))
    x = values[src]
    shape, nd = tuple(x.shape), x.ndim

    def new_input(new_shape) -> tuple[str, int]:
        inputs.append(tuple(new_shape))
        return ("in", len(inputs) - 1)

    if op == "mm":
        if nd != 2:
            return None
        return Step(op, src, (new_input((shape[1], draw(SIZES))),))
    if op == "bmm":
        if nd != 3:
            return None
        return Step(op, src, (new_input((shape[0], shape[2], draw(SIZES))),))
    if op == "linear":
        out = draw(SIZES)
        others = [new_input((out, shape[-1]))]
        if draw(st.booleans()):
            others.append(new_input((out,)))
        return Step(op, src, tuple(others))
    if op == "matmul":
        k = shape[-1]
        kind = draw(st.sampled_from(["vec", "mat", "batched"]))
        if kind == "vec":
            if nd < 2:
                return None
            other = (k,)
        elif kind == "mat":
            other = (k, draw(SIZES))
        else:
            if nd == 4:
                return None
            batch = draw(st.sampled_from([shape[-3], 1])) if nd >= 3 else draw(SIZES)
            other = (batch, k, draw(SIZES))
        return Step(op, src, (new_input(other),))
    if op in ("add", "mul", "sub"):
        candidates = []
        for j, v in enumerate(values):
            try:
                if len(torch.broadcast_shapes(shape, v.shape)) <= MAX_NDIM:
                    candidates.append(j)
            except RuntimeError:
                pass
        if candidates and draw(st.booleans()):
            other = ("v", draw(st.sampled_from(candidates)))
        else:
            other = new_input(_broadcast_operand(draw, shape))
        return Step(op, src, (other,), (("swap", draw(st.booleans())),))
    if op in ("gelu", "relu", "exp", "neg"):
        return Step(op, src)
    if op == "mul_scalar":
        return Step(op, src, (), (("c", draw(st.sampled_from([0.5, -2.0, 3.0]))),))
    if op in ("sum", "mean", "amax"):
        keepdim = draw(st.booleans())
        count = draw(st.sampled_from([1, 1, 1, 2])) if nd >= 2 else 1
        dims = draw(st.lists(st.integers(0, nd - 1), min_size=count, max_size=count, unique=True))
        if not keepdim and nd - len(dims) < 1:
            return None
        # a negative spelling of the dims half the time
        dims = [d - nd if draw(st.booleans()) else d for d in dims]
        dim = dims[0] if len(dims) == 1 and op != "amax" and draw(st.booleans()) else dims
        return Step(op, src, (), (("dim", dim), ("keepdim", keepdim)))
    if op in ("view", "reshape"):
        mode = draw(st.sampled_from(["split", "merge"]))
        new = list(shape)
        if mode == "split":
            if nd >= MAX_NDIM:
                return None
            d = draw(st.integers(0, nd - 1))
            divisors = [a for a in range(1, shape[d] + 1) if shape[d] % a == 0]
            a = draw(st.sampled_from(divisors))
            new[d : d + 1] = [a, shape[d] // a]
        else:
            if nd < 2:
                return None
            d = draw(st.integers(0, nd - 2))
            new[d : d + 2] = [shape[d] * shape[d + 1]]
        if draw(st.booleans()):
            new[draw(st.integers(0, len(new) - 1))] = -1
        if op == "view" and not x.is_contiguous():
            op = "reshape"
        return Step(op, src, (), (("shape", tuple(new)),))
    if op == "transpose":
        return Step(op, src, (), (("dim0", _dim(draw, nd)), ("dim1", _dim(draw, nd))))
    if op == "permute":
        perm = draw(st.permutations(range(nd)))
        return Step(op, src, (), (("dims", tuple(perm)),))
    if op == "unsqueeze":
        if nd >= MAX_NDIM:
            return None
        return Step(op, src, (), (("dim", draw(st.integers(-nd - 1, nd))),))
    if op == "flatten":
        start = draw(st.integers(0, nd - 1))
        end = draw(st.integers(start, nd - 1))
        if draw(st.booleans()):
            end -= nd
        return Step(op, src, (), (("start", start), ("end", end)))
    if op in ("softmax", "log_softmax"):
        return Step(op, src, (), (("dim", _dim(draw, nd)),))
    if op == "layer_norm":
        weight, bias = draw(st.booleans()), draw(st.booleans())
        others = []
        if weight:
            others.append(new_input((shape[-1],)))
        if bias:
            others.append(new_input((shape[-1],)))
        return Step(op, src, tuple(others), (("weight", weight), ("bias", bias)))
    raise AssertionError(op)


@st.composite
def programs(draw) -> Program:
    ndim = draw(st.integers(1, MAX_NDIM))
    inputs = [tuple(draw(SIZES) for _ in range(ndim))]
    values = [torch.zeros(inputs[0], dtype=torch.float64)]
    steps: list[Step] = []
    length = draw(st.sampled_from([2, 3, 4, 5, 6]))
    attempts = 0
    while len(steps) < length and attempts < 50:
        attempts += 1
        n_inputs = len(inputs)
        step = _draw_step(draw, values, inputs)
        if step is None:
            del inputs[n_inputs:]
            continue
        others = [torch.zeros(inputs[i], dtype=torch.float64) if kind == "in" else values[i] for kind, i in step.others]
        out = _apply(step, values[step.src], others)
        if not 1 <= out.ndim <= MAX_NDIM:
            del inputs[n_inputs:]
            continue
        steps.append(step)
        values.append(out)
    assume(len(steps) >= 2)
    return Program(tuple(inputs), tuple(steps))


def _real_inputs(program: Program) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(zlib.crc32(repr(program).encode()))  # not hash(): salted per process
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64) for shape in program.inputs)


def _recorded_calls(program: Program, inputs: tuple[torch.Tensor, ...]) -> list[tuple[str, Any, tuple, dict, Any]]:
    """Trace as autopar does, then run the graph on real tensors recording every aten call."""
    traced = trace(ProgramModule(program), inputs)
    calls: list[tuple[str, Any, tuple, dict, Any]] = []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            result = super().run_node(node)
            if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
                args, kwargs = self.fetch_args_kwargs_from_env(node)
                calls.append((node.name, node.target, args, kwargs, result))
            return result

    Recorder(traced.gm).run(*inputs)
    return calls


def _check_program(program: Program, meshes: list[tuple[int, ...]]) -> None:
    inputs = _real_inputs(program)
    with torch.no_grad():
        eager = ProgramModule(program)(*inputs)
    # exp of exp can overflow; an overflowed program checks nothing useful
    assume(all(torch.isfinite(v).all() and v.abs().max() < 1e6 for v in eager))
    calls = _recorded_calls(program, inputs)
    assert calls, f"nothing was traced for {program}"
    for (name, target, args, kwargs, result), mesh in itertools.product(calls, meshes):
        where = f"{name} = {target} in {program} on mesh {mesh}"
        results = check_op(target, args, kwargs, mesh)
        assert results, f"no strategies for {where}"
        bad = [f"{strategy_text(r.strategy, source=True)}: {r.detail}" for r in results if not r.ok]
        assert not bad, f"wrong strategies for {where}:\n" + "\n".join(bad)
        info = op_info_from_values(name, target, _normalize(target, args, kwargs), result)
        for r in results:
            s = r.strategy
            assert len(s.ins) == len(info.inputs) and len(s.outs) == len(info.out_shapes), where
            for arg, spec in zip(info.inputs, s.ins):
                assert is_valid(arg.shape, spec, mesh), (
                    f"uneven input {arg.index} {arg.shape} in {strategy_text(s, source=True)} for {where}"
                )
            for shape, spec in zip(info.out_shapes, s.outs):
                assert is_valid(shape, spec, mesh), f"uneven output {shape} in {strategy_text(s, source=True)} for {where}"


@pytest.fixture
def one_thread():
    """Tiny ops on two shared cores: waking a second intra-op thread (softmax over a middle
    dim) costs milliseconds per call under load, far more than the op itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@PROGRAM_SETTINGS
@given(program=programs())
def test_random_programs_every_strategy_simulates(one_thread, program: Program) -> None:
    # Every program is checked on every mesh: tracing it costs more than simulating it, and
    # derandomized per-mesh tests would all draw the same programs anyway.
    _check_program(program, MESHES)


def test_program_generator_covers_every_op() -> None:
    """The generator reaches every op family (a guard against a generator that silently
    rejects, e.g., every bmm)."""
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(program=programs())
    def collect(program: Program) -> None:
        seen.update(step.op for step in program.steps)

    collect()
    missing = set(OPS) - seen
    assert not missing, f"the program generator never drew {sorted(missing)}"


# =============================================================================================
# 2. Random forced plans on real gloo ranks equal eager
# =============================================================================================

FORCED_SEED = 20260515
FORCED_CASES = (("mlp_block", {}, 8, 8), ("gpt", {"bias": False}, 4, 4))
FORCED_TOL = 1e-4


def _random_forced_plans(name: str, config: dict, batch_size: int, count: int, mesh: tuple[int, ...], rng: random.Random):
    """``count`` (forced specs, plan) pairs; infeasible draws are drawn again."""
    from autopar.cost.cluster import get_cluster
    from autopar.errors import InfeasibleError
    from autopar.solver import solve
    from autopar.solver.problem.choices import build_choice_graph

    cluster = get_cluster("cpu")
    model = build_model(name, seed=0, **config)
    traced = trace(model, example_batch(name, batch_size, seed=1))
    graph = build_choice_graph(traced, mesh, cluster)
    # getitem nodes are left out: they only pass on their producer's choice (forcing one pins
    # its producer; test_forcing_a_getitem_keeps_it_on_its_producer).
    ops = [
        graph.choices[n]
        for n in graph.order
        if graph.choices[n].kind == "op" and graph.choices[n].out_shapes and traced.node(n).target is not operator.getitem
    ]
    plans, infeasible = [], 0
    while len(plans) < count:
        assert infeasible < 20 * count, f"{name}: {infeasible} infeasible forced draws for {len(plans)} feasible ones"
        chosen = rng.sample(ops, rng.randint(1, max(1, len(ops) // 2)))
        forced = {c.name: rng.choice(c.out_specs(0)) for c in sorted(chosen, key=lambda c: graph.order.index(c.name))}
        try:
            plan = solve(traced, mesh, cluster, forced=forced)
        except InfeasibleError:  # e.g. a consumer forced to an output only a Partial input gives
            infeasible += 1
            continue
        plans.append((forced, plan))
    return plans


class TransposeMulView(torch.nn.Module):
    """A local view that was valid on the traced tensor can be invalid on a resharded one: ``h``
    is laid out as ``x``, so ``h.transpose(1, 2)`` is contiguous and the view is legal at trace
    time; forcing ``mul`` to S(0) chunks ``h`` into a plain contiguous tensor (as sdpa's output
    in the GPT). Regression test for views replayed on resharded tensors."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (2, 3, 2, 4) = (batch, seq, heads, dim)
        h = x.transpose(1, 2) * 2.0
        return h.transpose(1, 2).view(2, 3, 8).sum()


def _compile_and_compare(model: torch.nn.Module, mesh: tuple[int, ...], batch: tuple, plan: Plan) -> dict:
    from autopar.runtime.tools.launch import max_rel_diff

    eager = copy.deepcopy(model)
    pm = autopar.compile(model, mesh, example_inputs=batch, plan=plan)
    loss = pm(*batch)
    want = eager(*batch)
    if want.requires_grad:  # TransposeMulView has no parameters
        loss.backward()
        want.backward()
    grads = {n: p.grad for n, p in eager.named_parameters(remove_duplicate=False)}
    return {"loss": (loss.item(), want.item()), "grad_rel": max_rel_diff(pm.full_grads(), grads) if grads else {}}


def _run_random_forced(rank: int, world: int, seed: int) -> dict:
    from autopar.cost.cluster import get_cluster
    from autopar.ir.spec import S
    from autopar.solver import solve

    torch.manual_seed(0)
    rng = random.Random(seed)
    mesh = (world,)
    out: dict[str, dict] = {}
    for name, config, batch_size, count in FORCED_CASES:
        for i, (forced, plan) in enumerate(_random_forced_plans(name, config, batch_size, count, mesh, rng)):
            model = build_model(name, seed=0, **config)
            result = _compile_and_compare(model, mesh, example_batch(name, batch_size, seed=1), plan)
            result["forced"] = {k: format_spec(v) for k, v in forced.items()}
            result["plan_hash"] = plan.hash
            result["sharded"] = sorted(
                n for n, p in plan.nodes.items() if any(not isinstance(s, Replicate) for spec in p.outs for s in spec)
            )
            out[f"{name}#{i}"] = result
    x = torch.arange(48.0).reshape(2, 3, 2, 4)
    traced = trace(TransposeMulView(), (x,))
    plan = solve(traced, mesh, get_cluster("cpu"), forced={"mul": (S(0),)})
    out["transpose_mul_view"] = _compile_and_compare(TransposeMulView(), mesh, (x,), plan)
    out["transpose_mul_view"]["forced"] = {"mul": ["S(0)"]}
    return out


@pytest.mark.multiproc
def test_random_forced_plans_match_eager_on_gloo(rank_pool) -> None:
    results = rank_pool(2).run(_run_random_forced, FORCED_SEED, timeout_s=300)
    assert len(results[0]) == sum(case[3] for case in FORCED_CASES) + 1
    failures = []
    for rank, by_plan in enumerate(results):
        for label, result in by_plan.items():
            if "plan_hash" in result:
                assert result["plan_hash"] == results[0][label]["plan_hash"], f"{label}: ranks drew different plans"
            got, want = result["loss"]
            worst = max(result["grad_rel"], key=result["grad_rel"].get, default=None)
            worst_rel = result["grad_rel"][worst] if worst else 0.0
            if not math.isclose(got, want, rel_tol=FORCED_TOL) or worst_rel >= FORCED_TOL:
                failures.append(
                    f"rank {rank} {label} forced {result['forced']}: loss {got} vs eager {want}, "
                    f"gradient of {worst} off by {worst_rel:.2e}"
                )
    assert not failures, "random forced plans differ from eager:\n" + "\n".join(failures)
    # The draws must really shard something, or this test checks only replication.
    ran = [r for label, r in results[0].items() if "sharded" in r]
    assert sum(bool(r["sharded"]) for r in ran) >= 4, f"only {len(ran)} random plans ran, or too few shard"


def test_forcing_a_getitem_keeps_it_on_its_producer() -> None:
    """A getitem passes its producer's output on as it is (the collectives pass asserts so).
    Forcing its spec must therefore pin the producer too, or be refused; found by the random
    draws above (mlp_block, mesh (2,), forced {linear_1: S(1), getitem_1: S(0)})."""
    from autopar.cost.cluster import get_cluster
    from autopar.ir.spec import S
    from autopar.solver import solve

    model = build_model("mlp_block", seed=0)
    traced = trace(model, example_batch("mlp_block", 8, seed=1))
    try:
        plan = solve(traced, (2,), get_cluster("cpu"), forced={"getitem_1": (S(0),)})
    except (autopar.InfeasibleError, ValueError):
        return  # refusing the forced spec is fine too
    node = plan.nodes["getitem_1"]
    ((producer, index),) = node.inputs
    held = plan.nodes[producer].outs[index]
    assert node.ins[0] == held, (
        f"solve(forced={{'getitem_1': S(0)}}) plans getitem_1 to take {format_spec(node.ins[0])} "
        f"while {producer}[{index}] is {format_spec(held)}"
    )


# =============================================================================================
# 3. Plan JSON round trips
# =============================================================================================

PLAN_CASES = [(name, mesh) for name in ("mlp", "gpt", "cnn") for mesh in [(2,), (2, 2)]]


@pytest.mark.parametrize("name, mesh", PLAN_CASES, ids=[f"{n}-{'x'.join(map(str, m))}" for n, m in PLAN_CASES])
def test_real_plans_round_trip_exactly(name: str, mesh: tuple[int, ...]) -> None:
    model = build_model(name, seed=0)
    plan = autopar.plan(model, mesh, example_inputs=example_batch(name, 8, seed=1), cluster="cpu")
    text = plan.to_json()
    loaded = Plan.from_json(text)
    assert loaded.to_json() == text
    assert loaded == plan
    assert loaded.hash == plan.hash


_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
_FLOATS = st.floats(allow_nan=False, allow_infinity=False)


def _placements(axis_size: int, max_dim: int):
    """Any placement a mesh axis of ``axis_size`` can carry (an axis of size 1 carries only R)."""
    if axis_size == 1:
        return st.just(Replicate())
    return st.one_of(st.just(Replicate()), st.just(Partial()), st.integers(0, max_dim).map(Shard))


@st.composite
def random_plans(draw) -> Plan:
    """Random plans that ``Plan.check_placements`` accepts (as ``from_json`` requires): every
    tensor 4-D, each dim a multiple of the mesh size, so any shard of dims 0-3 divides it."""
    axes = draw(st.integers(1, 3))
    mesh = tuple(draw(st.lists(st.integers(1, 8), min_size=axes, max_size=axes)))
    spec = st.tuples(*(_placements(size, 3) for size in mesh))
    dim_size = st.integers(0, 2**30).map(lambda k: k * math.prod(mesh))
    params = draw(st.dictionaries(_NAMES, spec, max_size=5))
    names = draw(st.lists(_NAMES, min_size=0, max_size=6, unique=True))
    nodes: dict[str, NodePlan] = {}
    for i, name in enumerate(names):
        n_in = draw(st.integers(0, 3))
        n_out = draw(st.integers(0, 2))
        kernel = draw(st.one_of(st.none(), _NAMES))
        nodes[name] = NodePlan(
            op=draw(_NAMES),
            outs=tuple(draw(spec) for _ in range(n_out)),
            ins=tuple(draw(spec) for _ in range(n_in)),
            inputs=tuple((draw(st.sampled_from(names[:i] or [name])), draw(st.integers(0, 3))) for _ in range(n_in)),
            shapes=tuple(tuple(draw(st.lists(dim_size, min_size=4, max_size=4))) for _ in range(n_out)),
            kernel=kernel,
            kernel_axes=tuple(draw(st.lists(st.integers(0, axes - 1), max_size=axes, unique=True))) if kernel else (),
            source=draw(st.sampled_from(["rule", "dtensor", "fallback", "placeholder", "follow", "output"])),
            cost_s=draw(_FLOATS),
            whole_grad=tuple(draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, axes - 1)), max_size=3))),
        )
    predicted = draw(st.dictionaries(_NAMES, st.one_of(_FLOATS, st.integers(-(2**62), 2**62)), max_size=5))
    solver = draw(
        st.dictionaries(_NAMES, st.one_of(st.none(), st.text(max_size=8), _FLOATS, st.lists(_NAMES, max_size=3)), max_size=4)
    )
    return Plan(
        mesh_shape=mesh,
        graph_hash=draw(st.text(alphabet="0123456789abcdef", min_size=16, max_size=16)),
        params=params,
        nodes=nodes,
        predicted=Prediction.from_json(predicted),
        solver=SolverStats.from_json(solver),
        cluster=draw(st.sampled_from(["cpu", "h100-80g", "a100-40g", ""])),
    )


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(plan=random_plans())
def test_random_plans_round_trip_exactly(plan: Plan) -> None:
    text = plan.to_json()
    loaded = Plan.from_json(text)
    assert loaded.to_json() == text
    assert loaded == plan
    assert loaded.hash == plan.hash
