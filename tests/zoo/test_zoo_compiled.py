"""Compiled with inductor, a few of the zoo's CI models on 4 gloo ranks, mesh (2, 2), in one spawn.

``autopar.compile(..., compiler="inductor")`` and a user's ``torch.compile`` of a module (compiled
with or without it) equal eager: loss within 1e-5 relative, gradients within 1e-4 (scripts/zoo.py's
``compare``; a gradient that is zero in exact arithmetic, such as an attention key bias, holds
rounding noise and is left out there). Inductor compiles slowly on two cores, so the models are the
zoo's two smallest CI models with no budget.
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


def _run(rank: int, world: int) -> dict:
    zoo = _zoo()
    out = {}
    for name, compiler, torch_compile in CASES:
        try:
            out[(name, compiler, torch_compile)] = zoo.compare(name, "none", compiler=compiler, torch_compile=torch_compile)
        except Exception as error:  # noqa: BLE001 - reported per case below
            out[(name, compiler, torch_compile)] = {"status": "error", "reason": f"{type(error).__name__}: {error}"}
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
    assert set(results[0]) == set(CASES)
