"""A padded parameter shard under a casting policy is cast on its piece and gathered in ``param_dtype``
(``solver.problem.padded_casts``), and its gathers are priced as the scheduled, prefetched FSDP
gathers the runtime runs (``solver.pricing.comm_schedule``). Single process, meta models: the
runtime's side is ``tests/runtime/test_padded_shards.py``."""

from __future__ import annotations

import math

import pytest
import torch

import autopar
from autopar.cost import comm
from autopar.cost.cluster import get_cluster
from autopar.ir.spec import S, padded_axis
from autopar.passes.plan_check import check_plan_strategies
from autopar.solver.problem.gathered import moved_shape
from autopar.trace import trace
from autopar.zoo.models import GPT

MESH = (6,)  # divides none of the GPT's dims below (256 wide, vocabulary 512, 64 positions)


def _gpt():
    with torch.device("meta"):
        return GPT(vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=256, bias=False)


def _inputs():
    ids = torch.zeros(12, 64, dtype=torch.long, device="meta")
    return (ids, ids)


def _fsdp(precision: str | None, mesh=MESH) -> autopar.Plan:
    # FSDP2's default schedule: every layer gathered again in backward
    comm = autopar.CommOptions(reshard_after_forward=None)
    return autopar.hand_plan("fsdp", _gpt(), mesh, example_inputs=_inputs(), cluster="h100-80g", precision=precision, comm=comm)


def _casts(plan: autopar.Plan) -> dict[str, list[str]]:
    """Each cast of a parameter (``_to_copy``) -> its output placements."""
    params = {name for name, node in plan.nodes.items() if node.op == "param"}
    return {
        name: [str(p) for p in node.outs[0]]
        for name, node in plan.nodes.items()
        if node.op == "aten._to_copy.default" and node.inputs[0][0] in params
    }


def _padded_gathers_s(plan: autopar.Plan, itemsize: int) -> float:
    """One all-gather per parameter, of k pieces of ceil(n / k) rows in ``itemsize`` bytes."""
    cluster, (k,) = get_cluster("h100-80g"), plan.mesh_shape
    total = 0.0
    for fqn, param in _gpt().named_parameters():
        assert padded_axis(tuple(param.shape), plan.params[fqn], plan.mesh_shape) == 0, fqn
        moved = k * -(-param.shape[0] // k) * math.prod(param.shape[1:]) * itemsize
        total += comm.all_gather_s(moved, 0, plan.mesh_shape, cluster)
    return total


def test_the_policy_casts_the_padded_piece_and_gathers_it_scheduled() -> None:
    plan = _fsdp("bf16-mixed")
    casts = _casts(plan)
    assert len(casts) == len(list(_gpt().parameters())) and all(spec == ["S(0)"] for spec in casts.values()), casts
    schedule = plan.predicted.grad_schedule
    # each parameter one scheduled gather, of the bf16 cast pieces (fp32 would be twice), overlapped
    assert schedule["gather_s"] == pytest.approx(_padded_gathers_s(plan, 2), rel=1e-9)
    assert schedule["gathered_s"] > 0 and schedule["forward_s"] > 0
    assert plan.predicted.step_time_s < plan.predicted.compute_s + plan.predicted.reshard_s
    # the plan loads back (placements) and passes compile's check of every op's strategy
    loaded = autopar.Plan.from_json(plan.to_json())
    traced = trace(_gpt(), _inputs(), None, loaded.precision)
    check_plan_strategies(loaded, traced)


def test_padded_bf16_gathers_as_the_even_shards_do() -> None:
    # the same model on a mesh that divides it: the same pattern, every gather scheduled
    even = _fsdp("bf16-mixed", (8,)).predicted.grad_schedule
    padded = _fsdp("bf16-mixed").predicted.grad_schedule
    assert even["gather_s"] > 0 and padded["gather_s"] > 0
    assert padded["regather_s"] > 0 and even["regather_s"] > 0  # the layers gathered again in backward


def test_without_a_policy_nothing_is_cast_and_the_gathers_move_fp32() -> None:
    plan = _fsdp(None)
    assert _casts(plan) == {}
    assert plan.predicted.grad_schedule["gather_s"] == pytest.approx(_padded_gathers_s(plan, 4), rel=1e-9)


class _OwnCast(torch.nn.Module):
    """Casts its weight itself (not a precision policy's cast): that cast cannot take a padded
    piece, so the plan gathers the weight first."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64))

    def forward(self, x):
        return (x @ self.weight.to(torch.float64).t()).sum()


def test_a_cast_of_the_models_own_reads_the_padded_weight_gathered() -> None:
    x = torch.randn(6, 64, dtype=torch.float64)
    plan = autopar.hand_plan("fsdp", _OwnCast(), (3,), example_inputs=(x,), cluster="cpu")
    assert [str(p) for p in plan.params["weight"]] == ["S(0)"]  # 64 rows on 3 ranks: padded
    readers = [node for node in plan.nodes.values() if node.inputs and node.inputs[0][0] == "p_weight"]
    assert [(node.op, [str(p) for p in node.ins[0]]) for node in readers] == [("aten.to.dtype", ["R"])]


def test_a_padded_gather_moves_and_holds_k_pieces_of_ceil_n_over_k_rows() -> None:
    assert moved_shape((64, 5), (S(0),), 0, 3, (3,)) == (66, 5)  # 3 pieces of 22 rows
    assert moved_shape((2, 5), (S(0),), 0, 3, (3,)) == (3, 5)  # 3 pieces of 1 row, one empty
    assert moved_shape((63, 5), (S(0),), 0, 3, (3,)) == (63, 5)  # even: as it is
    assert moved_shape((4, 64), (S(0), S(1)), 1, 4, (2, 4)) == (4, 64)  # another axis's cut stays global
