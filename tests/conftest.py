"""Builders and helpers the test packages share (tests/<package>/ mirrors autopar/<package>/).

Fixtures are found by pytest; the plain helpers are imported as ``from tests.conftest import ...``.
"""

from __future__ import annotations

import datetime
import operator

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.ir.spec import format_spec
from autopar.runtime.tools.launch import max_rel_diff
from autopar.zoo.models import GPT, build_model, example_batch

# -- test order ---------------------------------------------------------------------------------

# The slowest files, slowest first (seconds on the two-core machine: the slowest test or two of
# each, from ``--durations`` of the full suite, 2026-11-29). scripts/test.sh runs the suite on two
# pytest-xdist workers, one file at a time each (``--dist loadfile``), in this order: a long file
# started last would leave one worker running it alone at the end.
# Order only; a file not listed runs after these, in collection order.
SLOWEST_FILES = (
    "tests/zoo/test_zoo.py",  # 175
    "tests/test_docs.py",  # 150: every README and docs/ code block
    "tests/solver/test_moe_plans.py",  # 140: a Mixtral plan on 64 GPUs in its fixture
    "tests/solver/test_solving.py",  # 120
    "tests/zoo/test_hf.py",  # 120
    "tests/runtime/test_conformance.py",  # 116
    "tests/runtime/test_module.py",  # 95
    "tests/solver/test_edges.py",  # 92
    "tests/zoo/test_zoo_compiled.py",  # 79
    "tests/runtime/test_faults.py",  # 71
    "tests/solver/test_relaxation.py",  # 57
    "tests/solver/test_memory.py",  # 55
    "tests/solver/test_hand_plans.py",  # 55
    "tests/cli/test_main.py",  # 50
    "tests/test_rank_pool.py",  # 49
    "tests/runtime/test_compiled.py",  # 48
    "tests/runtime/test_precision.py",  # 47
    "tests/runtime/test_colossal_distributed.py",  # 44 (216-282 under a load of 20)
    "tests/solver/test_columns.py",  # 42
    "tests/runtime/test_pipeline.py",  # 42
    "tests/runtime/test_pipeline_llm.py",  # 41
    "tests/solver/test_pruning.py",  # 38
    "tests/runtime/test_shapes.py",  # 38
    "tests/runtime/test_reliability.py",  # 36
    "tests/passes/test_properties.py",  # 35
    "tests/solver/test_solver.py",  # 35
    "tests/runtime/test_hf_trainer.py",  # 34
    "tests/zoo/test_shapes.py",  # 34
    "tests/passes/test_mutation_properties.py",  # 34
    "tests/runtime/test_checkpoint.py",  # 30
    "tests/runtime/test_parameters.py",  # 28 (its 2-rank pool)
)


def pytest_collection_modifyitems(config, items) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


# -- the reference GPT ------------------------------------------------------------------------


def gpt_and_batch() -> tuple[torch.nn.Module, tuple]:
    """The zoo's default GPT (seed 0) and a batch of 8 (seed 1): the model most tests plan."""
    return build_model("gpt", seed=0), example_batch("gpt", 8, seed=1)


def meta_llama_and_batch(n_layer: int) -> tuple[torch.nn.Module, tuple]:
    """A small Llama (width 128, 4 heads and 2 KV heads, vocabulary 512) of ``n_layer`` layers on
    the meta device and a batch of 8 x 64: the ILP's unit tests plan it offline."""
    with torch.device("meta"):
        model = build_model("llama", n_layer=n_layer, n_embd=128, n_head=4, n_kv_head=2, hidden=256, vocab_size=512)
        idx = torch.zeros(8, 64, dtype=torch.long)
    return model, (idx, idx)


@pytest.fixture(scope="module")
def meta_gpt_and_batch() -> tuple[torch.nn.Module, tuple]:
    """A GPT of width 256 (2 layers, vocabulary 1024) on the meta device and a batch of 8 x 128:
    what the planners price offline, with no weights made (hand plans, the allocator model)."""
    with torch.device("meta"):
        model = GPT(vocab_size=1024, block_size=128, n_layer=2, n_head=8, n_embd=256, bias=False)
        idx = torch.zeros(8, 128, dtype=torch.long)
    return model, (idx, idx)


@pytest.fixture(scope="session")
def gpt_plan_2x2() -> autopar.Plan:
    """``gpt_and_batch()`` planned on mesh (2, 2) for the cpu preset."""
    model, batch = gpt_and_batch()
    return autopar.plan(model, (2, 2), example_inputs=batch, cluster="cpu")


@pytest.fixture(scope="session")
def gpt_plan_2() -> autopar.Plan:
    """``gpt_and_batch()`` planned on mesh (2,) for the cpu preset."""
    model, batch = gpt_and_batch()
    return autopar.plan(model, (2,), example_inputs=batch, cluster="cpu")


# -- gloo ranks shared by the multi-process tests -----------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    """A world-size-1 gloo group in this process (so that compile runs on mesh (1,)), or the
    group already there; yields the world group's name."""
    if dist.is_initialized():
        yield dist.group.WORLD.group_name
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(n)``: the session's ``tests.rank_pool.RankPool`` of ``n`` gloo ranks (spawned
    at its first job, reused by the next; ``pool.run(fn, *args, timeout_s=...)``)."""
    from tests.rank_pool import RankPool

    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        return pools.setdefault(world_size, RankPool(world_size))

    yield get
    for pool in pools.values():
        pool.close()


# -- eager references and compiled graphs -----------------------------------------------------


def eager_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's ``.grad`` under every name it has (tied names included)."""
    return {name: p.grad for name, p in model.named_parameters(remove_duplicate=False)}


def step_against_eager(
    pm: torch.nn.Module, eager: torch.nn.Module, args: tuple = (), kwargs: dict | None = None, *, output_loss=None
) -> dict:
    """One forward and backward of the compiled module ``pm`` and of ``eager`` (an unsharded copy
    of its model) on the same inputs: ``{"loss": (compiled, eager), "grad_rel": {name: error}}``,
    the gradient errors ``max_rel_diff(pm.full_grads(), eager_grads(eager))`` by FQN.
    ``output_loss`` picks the loss out of a model's output (``lambda out: out.loss`` for Hugging
    Face models); by default the output is the loss."""
    kwargs = kwargs or {}
    pick = output_loss or (lambda out: out)
    loss = pick(pm(*args, **kwargs))
    loss.backward()
    want = pick(eager(*args, **kwargs))
    want.backward()
    return {"loss": (loss.item(), want.item()), "grad_rel": max_rel_diff(pm.full_grads(), eager_grads(eager))}


# The scheduled parameter communication (``passes.schedule``) as the collectives it replaces: a
# parameter's gather is an all-gather, its gradient bucket slot a gradient all-reduce.
_SCHEDULED = {"param_gathers": "all_gather", "grad_buckets": "allreduce_grad"}


def bucket_reads(gm: torch.fx.GraphModule) -> dict[str, torch.fx.Node]:
    """Each bucketed parameter's read in the graph (``passes.schedule``: one ``grad_buckets``
    node per bucket takes its parameters, a ``getitem`` per parameter reads one back), by key."""
    reads = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == "grad_buckets":
            assert len(node.kwargs["keys"]) == len(node.args), node.format_node()
            for item in node.users:
                assert item.target is operator.getitem, item.format_node()
                reads[node.kwargs["keys"][item.args[1]]] = item
    return reads


def collective_counts(pm: torch.nn.Module) -> dict[str, int]:
    """How many times the compiled module's graph calls each autopar collective, by name."""
    counts: dict[str, int] = {}
    for node in pm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__module__", "") == "autopar.ops.collectives":
            counts[node.target.__name__] = counts.get(node.target.__name__, 0) + 1
        elif node.op == "call_module" and node.target in _SCHEDULED:
            slots = len(node.kwargs.get("keys") or (None,))  # a bucket's node serves each of its parameters
            counts[_SCHEDULED[node.target]] = counts.get(_SCHEDULED[node.target], 0) + slots
    return counts


# -- strategies as text -----------------------------------------------------------------------


def strategy_text(strategy, *, bracketed: bool = False, source: bool = False) -> str:
    """A strategy as "(S(0)R, RR) -> (S(0)R)" (``bracketed``: "([S(0),R], [R,R]) -> ([S(0),R])"),
    with its kernel, and its source ("rule", "dtensor", ...) where ``source``."""
    if bracketed:
        ins = ", ".join("[" + ",".join(format_spec(s)) + "]" for s in strategy.ins)
        outs = ", ".join("[" + ",".join(format_spec(s)) + "]" for s in strategy.outs)
        return f"({ins}) -> ({outs})"
    ins = ", ".join("".join(format_spec(s)) for s in strategy.ins)
    outs = ", ".join("".join(format_spec(s)) for s in strategy.outs)
    kernel = f" kernel={strategy.kernel}{list(strategy.kernel_axes)}" if strategy.kernel else ""
    return f"({ins}) -> ({outs}){kernel}" + (f" [{strategy.source}]" if source else "")


# -- an eager reference under a precision policy ------------------------------------------------


class PolicyReference(torch.nn.Module):
    """``model`` run eagerly under a precision policy, as autopar carries it out: parameters
    stored in the policy's ``stored_dtype`` (fp32 masters under "bf16-mixed"), each floating one
    cast to ``param_dtype`` once per forward (a tied weight once, for all its names), floating
    inputs cast to ``param_dtype``. Gradients land in the stored parameters' ``.grad``, in their
    dtype. Takes ``model`` over (pass a copy)."""

    def __init__(self, model: torch.nn.Module, precision) -> None:
        super().__init__()
        self.policy = autopar.ir.options.precision_policy(precision)
        self.module = model
        stored = autopar.ir.options.to_dtype(self.policy.stored_dtype)
        for param in model.parameters():
            if stored is not None and param.is_floating_point():
                param.data = param.data.to(stored)

    def forward(self, *args, **kwargs):
        args, kwargs = self.policy.cast_inputs((args, kwargs))
        dtype = autopar.ir.options.to_dtype(self.policy.param_dtype)
        cast: dict[int, torch.Tensor] = {}
        values = {}
        for name, param in self.module.named_parameters(remove_duplicate=False):
            if dtype is not None and param.is_floating_point():
                values[name] = cast.setdefault(id(param), param.to(dtype))
            else:
                values[name] = param
        return torch.func.functional_call(self.module, values, args, kwargs, tie_weights=False)

    def data_parallel_backward(self, args: tuple, num_ranks: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Backward as ``num_ranks`` data-parallel ranks run it under the policy, reduction
        included: each rank's equal slice (along dim 0) of every tensor in ``args`` on its own,
        its loss (a mean) weighted 1/num_ranks so that the ranks' sum is the whole batch's
        mean, each rank's gradient cast to ``reduce_dtype`` and summed in it in rank order, the
        sum cast to the stored dtype into ``.grad``. For a model that returns a mean loss.
        Returns the loss (the ranks' weighted sum) and rank 0's own gradients: what a rank
        holds if the reduction is dropped."""
        policy = self.policy
        reduce_dtype = autopar.ir.options.to_dtype(policy.reduce_dtype or policy.param_dtype)
        params = dict(self.module.named_parameters())
        sums: dict[str, torch.Tensor] = {}
        loss, own = 0.0, {}
        for rank in range(num_ranks):
            piece = tuple(a.chunk(num_ranks)[rank] if isinstance(a, torch.Tensor) else a for a in args)
            for param in params.values():
                param.grad = None
            part = self(*piece) / num_ranks
            part.backward()
            loss = loss + part.detach().float()
            for name, param in params.items():
                if param.grad is None:
                    continue
                grad = param.grad.to(reduce_dtype or param.grad.dtype)
                sums[name] = grad if name not in sums else sums[name] + grad
                if rank == 0:
                    own[name] = param.grad.clone()
        for name, param in params.items():
            param.grad = sums[name].to(param.dtype) if name in sums else None
        return loss, own


# -- a model that no small world size divides ---------------------------------------------------


class WideNet(torch.nn.Module):
    """64 wide, so that 3 (or 6, 48) ranks divide none of its dims, and a 2-row head, shorter than
    3 ranks, so that one rank's piece of it is empty: FSDP2's padded shards (``ir.spec.padded_axis``)."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, 2)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x, y):
        hidden = self.up(x) * self.scale.to(x.dtype)  # (a buffer in its own dtype under a precision policy)
        return torch.nn.functional.cross_entropy(self.down(torch.relu(hidden)), y)


def wide_batch(seed: int, dtype: torch.dtype = torch.float64, width: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, width, generator=generator, dtype=dtype), torch.randint(0, 2, (6,), generator=generator)
