"""Context-parallel causal attention (``ops.attention``) run for real, against eager PyTorch.

The numerics guard runs every rank in a thread of this process (torch's threaded group moves
real data); one gloo spawn of 4 ranks checks loss and gradients on real processes. Plans are
forced: every attention node's output is pinned to a sequence split, which only the
context-parallel kernel's row offers.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.spec import S
from autopar.runtime.tools.numerics import check_numerics
from autopar.solver import solve
from autopar.trace import trace
from autopar.zoo.models import GPT, Llama
from tests.conftest import step_against_eager

TOL = 1e-6  # float64 throughout


class _GQAttention(nn.Module):
    """Hugging Face's sdpa path without a materialized mask: fewer key/value heads, enable_gqa."""

    def __init__(self, n_embd: int = 16, n_head: int = 4, n_kv_head: int = 2):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, n_embd // n_head
        self.q = nn.Linear(n_embd, n_embd, bias=False)
        self.kv = nn.Linear(n_embd, 2 * n_kv_head * self.head_dim, bias=False)
        self.o = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        batch, seq, n_embd = x.shape
        q = self.q(x).view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(batch, seq, 2 * self.n_kv_head, self.head_dim).transpose(1, 2).chunk(2, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.mse_loss(self.o(out.transpose(1, 2).reshape(batch, seq, n_embd)), y)


def _cases(seq: int = 32) -> dict:
    torch.manual_seed(0)
    gpt = GPT(vocab_size=64, block_size=seq, n_layer=2, n_head=2, n_embd=16, bias=False).double()
    idx, tgt = torch.randint(0, 64, (2, seq)), torch.randint(0, 64, (2, seq))
    llama = Llama(vocab_size=64, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, hidden=64).double()
    gqa = _GQAttention().double()
    x, y = torch.randn(2, seq, 16, dtype=torch.float64), torch.randn(2, seq, 16, dtype=torch.float64)
    return {"gpt": (gpt, (idx, tgt)), "llama_repeat_kv": (llama, (idx, tgt)), "enable_gqa": (gqa, (x, y))}


def _forced_plan(model, batch, mesh, spec) -> autopar.Plan:
    traced = trace(model, batch)
    names = [n.name for n in traced.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    plan = solve(traced, mesh, get_cluster("cpu"), forced={name: spec for name in names})
    assert names and all(plan.nodes[n].kernel == "sdpa_context_parallel" for n in names), "CP was not forced"
    return plan


@pytest.mark.parametrize(
    "case,mesh,spec",
    [
        ("gpt", (4,), (S(2),)),
        ("gpt", (2, 2), (S(2), S(2))),
        ("gpt", (2, 2), (S(1), S(2))),
        ("llama_repeat_kv", (4,), (S(2),)),
        ("enable_gqa", (4,), (S(2),)),
    ],
    ids=["gpt-4-head-tail", "gpt-2x2-both-axes", "gpt-2x2-heads-and-sequence", "llama-repeat-kv", "enable-gqa"],
)
def test_numerics_guard_covers_the_kernel(case, mesh, spec):
    model, batch = _cases()[case]
    result = check_numerics(model, _forced_plan(model, batch, mesh, spec), batch, tolerance=TOL)
    assert result.ok, result.text()


def test_numerics_guard_odd_local_sequence_runs_contiguous():
    # 28 positions on 4 ranks: 7 rows each, no halves, so no head-tail exchange.
    model, batch = _cases(seq=28)["gpt"]
    result = check_numerics(model, _forced_plan(model, batch, (4,), (S(2),)), batch, tolerance=TOL)
    assert result.ok, result.text()


def _run_ranks(rank: int, world: int) -> dict:
    results = {}
    for name, (model, batch) in _cases().items():
        eager = copy.deepcopy(model)
        plan = _forced_plan(model, batch, (world,), (S(2),))
        pm = autopar.compile(model, (world,), example_inputs=batch, plan=plan)
        results[name] = step_against_eager(pm, eager, batch)
    return results


@pytest.mark.multiproc
def test_context_parallel_matches_eager_on_gloo(rank_pool):
    results = rank_pool(4).run(_run_ranks, timeout_s=600)
    for rank, by_case in enumerate(results):
        for name, result in by_case.items():
            got, want = result["loss"]
            assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {name}: loss {got} vs eager {want}"
            worst = max(result["grad_rel"], key=result["grad_rel"].get)
            assert result["grad_rel"][worst] < TOL, (
                f"rank {rank} {name}: gradient of {worst} off by {result['grad_rel'][worst]:.2e}"
            )
