"""Colossal-AI's 2D, 2.5D and 3D hand plans compiled on gloo ranks, against eager PyTorch.

The plans are made once in the test process and sent as JSON; each rank compiles them on the
pool's shared ranks (4 for 2D; 8 for 3D, 2.5D with depth 2 and the pipelined 2.5D of depth 1),
runs one forward and backward in float64, and compares the loss and every gradient with eager.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import autopar
from autopar.zoo.models import build_model, example_batch
from tests.conftest import eager_grads

TOL = 1e-9  # float64: only the order of sums differs from eager
BATCH = 8
CONFIGS = {
    4: {"2d": dict(tensor=dict(mode="2d", size=4))},
    8: {
        "3d": dict(tensor=dict(mode="3d", size=8)),
        "2.5d_depth2": dict(tensor=dict(mode="2.5d", depth=2, size=8)),
        "pipeline2_2.5d": dict(pipeline=2, tensor=dict(mode="2.5d", depth=1, size=4)),
    },
}


def _gpt(parallel: dict) -> torch.nn.Module:
    """Two layers to pipeline; a fused qkv projection (split by head, ``S(d)/3``) for 2D and 3D."""
    layers = 2 if parallel.get("pipeline", 1) > 1 else 1
    fused = parallel["tensor"]["mode"] in ("2d", "3d")
    return build_model("gpt", seed=0, n_layer=layers, n_embd=32, n_head=4, vocab_size=64, block_size=8, fused_qkv=fused).double()


def _batch() -> tuple:
    return example_batch("gpt", BATCH, seed=1, vocab_size=64, block_size=8)


def _plans(world: int) -> dict[str, str]:
    return {
        label: autopar.hand_plan(
            "colossal", _gpt(parallel), world, example_inputs=_batch(), cluster="cpu", parallel=parallel
        ).to_json()
        for label, parallel in CONFIGS[world].items()
    }


def _run(rank: int, world: int, plans: dict[str, str]) -> dict:
    results = {}
    for label, text in plans.items():
        plan = autopar.Plan.from_json(text)
        model = _gpt(CONFIGS[world][label])
        eager = copy.deepcopy(model)
        batch = _batch()
        pm = autopar.compile(model, plan.mesh_shape, example_inputs=batch, plan=plan)
        loss = pm(*batch)
        loss.backward()
        want = eager(*batch)
        want.backward()
        got, expected = pm.full_grads(), eager_grads(eager)
        results[label] = {
            "loss": (loss.item(), want.item()),
            "grad_error": {
                name: ((got[name] - grad).abs().max().item(), grad.abs().max().item()) for name, grad in expected.items()
            },
        }
    return results


def _check(results: list[dict]) -> None:
    for rank, by_label in enumerate(results):
        for label, result in by_label.items():
            assert math.isclose(*result["loss"], rel_tol=TOL), f"rank {rank} {label}: loss {result['loss']}"
            # Relative to the gradient's size, or to 1 where it is zero (the key projection's
            # bias: softmax ignores a shift of every key by the same q·b).
            for name, (error, size) in result["grad_error"].items():
                assert error < TOL * max(size, 1.0), f"rank {rank} {label}: gradient of {name} off by {error:.2e}"


@pytest.mark.multiproc
def test_colossal_2d_matches_eager(rank_pool):
    _check(rank_pool(4).run(_run, _plans(4), timeout_s=400))


@pytest.mark.multiproc
def test_colossal_3d_and_2p5d_match_eager(rank_pool):
    _check(rank_pool(8).run(_run, _plans(8), timeout_s=600))
