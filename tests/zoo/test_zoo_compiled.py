"""Compiled with inductor, a few of the zoo's CI models on 4 gloo ranks, mesh (2, 2), in one spawn.

``autopar.compile(..., compiler="inductor")`` and a user's ``torch.compile`` of a module (compiled
with or without it) equal eager: loss within 1e-5 relative, gradients within 1e-4 (scripts/zoo.py's
``compare``; a gradient that is zero in exact arithmetic, such as an attention key bias, holds
rounding noise and is left out there). Inductor compiles slowly on two cores, so the models are the
zoo's two smallest CI models with no budget, and a one-layer GPT under hybrid sharding (``_hybrid``).
"""

from __future__ import annotations

import math

import pytest

from tests.zoo.test_zoo import _zoo

pytest.importorskip("transformers")

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
CASES = (
    ("sequential", "inductor", False),
    ("sequential", "inductor", True),
    ("sequential", None, True),
    ("qwen3", "inductor", False),
)


def _hybrid(mesh: tuple[int, ...]) -> dict:
    """The zoo's GPT compiled with inductor under hybrid sharding (``hand_plans.hybrid_specs``:
    FSDP on the inner axis, replicated on the outer, the batch split on both; the in-graph
    schedule sums each shard's gradient on the outer axis before its gather), against eager, as
    scripts/zoo.py's ``compare`` compares (its rule for gradients zero in exact arithmetic)."""
    import copy

    import autopar
    from autopar.cost.cluster import get_cluster
    from autopar.ir.options import PlanOptions
    from autopar.runtime.tools.launch import max_rel_diff
    from autopar.solver.planners.hand_plans import hybrid_specs
    from autopar.solver.planners.sharding import solve
    from autopar.trace import trace
    from autopar.zoo.models import build_model, example_batch

    config = dict(vocab_size=256, block_size=32, n_layer=1, n_head=4, n_embd=64)
    model = build_model("gpt", seed=0, **config)
    eager = copy.deepcopy(model)
    batch = example_batch("gpt", 8, seed=1, **config)
    traced = trace(model, batch)
    plan = solve(traced, mesh, get_cluster("cpu"), PlanOptions(), forced=hybrid_specs(traced, mesh))
    pm = autopar.compile(model, mesh, example_inputs=batch, plan=plan, cluster="cpu", compiler="inductor")
    loss, want = pm(*batch), eager(*batch)
    loss.backward()
    want.backward()
    grads = {fqn: p.grad for fqn, p in eager.named_parameters(remove_duplicate=False)}
    scale = max(g.abs().max().item() for g in grads.values())
    rel = {k: v for k, v in max_rel_diff(pm.full_grads(), grads).items() if grads[k].abs().max().item() >= 1e-6 * scale}
    worst = max(rel, key=rel.get)
    return {"status": "ok", "loss_rel": abs(loss.item() - want.item()) / abs(want.item()), "grad_rel": rel[worst], "worst": worst}


def _run(rank: int, world: int) -> dict:
    zoo = _zoo()
    out = {}
    for name, compiler, torch_compile in CASES:
        try:
            out[(name, compiler, torch_compile)] = zoo.compare(name, "none", compiler=compiler, torch_compile=torch_compile)
        except Exception as error:  # noqa: BLE001 - reported per case below
            out[(name, compiler, torch_compile)] = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
    try:
        out[("gpt hybrid", "inductor", False)] = _hybrid(tuple(zoo.MESH))
    except Exception as error:  # noqa: BLE001 - reported per case below
        out[("gpt hybrid", "inductor", False)] = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
    return out


@pytest.mark.multiproc
def test_compiled_zoo_models_equal_eager_on_2x2_gloo(rank_pool) -> None:
    zoo = _zoo()
    results = rank_pool(math.prod(zoo.MESH)).run(_run, timeout_s=1500)
    failures = []
    for rank, by_case in enumerate(results):
        for case, result in by_case.items():
            if result["status"] != "ok":
                failures.append(f"rank {rank} {case}: {result['status']} ({result.get('reason')})")
            elif result["loss_rel"] > LOSS_TOL or result["grad_rel"] > GRAD_TOL:
                failures.append(
                    f"rank {rank} {case}: loss rel {result['loss_rel']:.1e}, "
                    f"grad rel {result['grad_rel']:.1e} at {result['worst']}"
                )
    assert not failures, "\n".join(failures)
    assert set(results[0]) == {*CASES, ("gpt hybrid", "inductor", False)}
