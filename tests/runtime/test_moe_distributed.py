"""Expert parallelism on 4 gloo ranks equals eager: loss and every gradient, router and experts.

A tiny Hugging Face Mixtral (4 experts, top-2) is planned on mesh (2, 2) with its expert weights
split by expert on the inner axis, in the two ways the experts rule offers:

- ``all_to_all``: tokens split too; each rank sends its token copies to the rank holding their
  expert and gets the results back (``moe_experts_all_to_all``, torch's ``all_to_all_single``
  with the counts exchanged first);
- ``replicated_tokens``: tokens whole on the inner axis; each rank runs its experts and the
  partial results are summed (``moe_experts_local``).

The cpu preset keeps such a tiny model replicated, so the experts' placement and the experts
op's kernel are pinned (``solve(forced=...)``), and each run exercises its kernel; the solver
chooses the rest. Routing is the top 2 of a softmax over random
router weights: ties have probability zero, so every rank routes each token as eager does.
One spawn runs both plans.
"""

from __future__ import annotations

import copy
import math

import pytest
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost.cluster import get_cluster
from autopar.solver import solve
from autopar.trace import trace
from autopar.trace.moe import EXPERTS_OP
from tests.conftest import step_against_eager

pytest.importorskip("transformers")

MESH = (2, 2)
TOL = 1e-4
KERNELS = {"all_to_all": "moe_experts_all_to_all", "replicated_tokens": "moe_experts_local"}


def _model():
    from tests.zoo.hf_models import mixtral

    return mixtral(batch_size=4)


def _plans() -> dict[str, autopar.Plan]:
    model, kwargs = _model()
    traced = trace(model, (), kwargs)
    plans = {}
    for label, kernel in KERNELS.items():
        forced = {}
        for node in traced.gm.graph.nodes:
            if node.op == "placeholder" and node.name.endswith(("experts_gate_up_proj", "experts_down_proj")):
                forced[node.name] = (Replicate(), Shard(0))
            if node.target is EXPERTS_OP:
                forced[node.name] = kernel  # the op's output alone leaves gathering the experts open
        plans[label] = solve(traced, MESH, get_cluster("cpu"), forced=forced)
    return plans


def _run(rank: int, world: int, plans: dict) -> dict:
    results = {}
    for label, plan in plans.items():
        model, kwargs = _model()
        eager = copy.deepcopy(model)
        pm = autopar.compile(model, MESH, example_kwargs=kwargs, plan=plan)
        kernels = sorted({d.kernel for d in pm.plan.nodes.values() if d.op == str(EXPERTS_OP)})
        results[label] = {
            **step_against_eager(pm, eager, kwargs=kwargs, output_loss=lambda out: out.loss),
            "kernels": kernels,
            "local_param_bytes": pm.local_param_bytes(),
            "full_param_bytes": sum(p.numel() * p.element_size() for p in eager.parameters()),
        }
    return results


@pytest.mark.multiproc
def test_expert_parallel_mixtral_equals_eager_on_4_gloo_ranks(rank_pool) -> None:
    plans = _plans()
    results = rank_pool(math.prod(MESH)).run(_run, plans, timeout_s=600)
    want_kernels = {"all_to_all": ["moe_experts_all_to_all"], "replicated_tokens": ["moe_experts_local"]}
    for rank, by_label in enumerate(results):
        for label, result in by_label.items():
            assert result["kernels"] == want_kernels[label], (rank, label, result["kernels"])
            got, want = result["loss"]
            assert math.isclose(got, want, rel_tol=TOL), f"rank {rank} {label}: loss {got} vs eager {want}"
            checked = {fqn for fqn in result["grad_rel"] if ".mlp." in fqn}
            assert checked == {
                f"model.layers.{i}.mlp.{name}"
                for i in range(2)
                for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
            }
            worst = max(result["grad_rel"], key=result["grad_rel"].get)
            assert result["grad_rel"][worst] < TOL, (
                f"rank {rank} {label}: gradient of {worst} off by {result['grad_rel'][worst]:.2e}"
            )
            assert result["local_param_bytes"] < result["full_param_bytes"]
