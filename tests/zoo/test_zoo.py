"""A representative handful of scripts/zoo.py on 4 gloo ranks, mesh (2, 2), in one spawn.

Issue 15's done-when cases: an encoder-decoder that shifts labels by in-place writes (Pegasus),
the teacher-forcing pattern, an ``nn.Sequential`` (its modules take ``input``), a dense decoder
(Qwen3) and DeepSeek-V3's MLA with experts, each with no budget and a tight one; and a pipelined
Mistral (``pipeline=2``, 2 microbatches), whose stage mesh (1, 2) has a size-1 axis. Every loss
and gradient must equal eager's. The full zoo is ``python scripts/zoo.py`` (docs/zoo.md).
"""

from __future__ import annotations

import copy
import importlib.util
import math
import pathlib

import pytest

import autopar

pytest.importorskip("transformers")

_ZOO_PATH = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "zoo.py"


def _zoo():
    spec = importlib.util.spec_from_file_location("autopar_zoo_script", _ZOO_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pipelined_mistral() -> dict:
    from autopar.runtime.tools.launch import max_rel_diff
    from tests.zoo.hf_models import mistral

    model, kwargs = mistral(batch_size=8)  # as it is: it returns the loss and the logits
    eager = copy.deepcopy(model)
    pm = autopar.compile(model, (2, 2), example_kwargs=kwargs, cluster="cpu", pipeline=2, num_microbatches=2)
    out = pm(**kwargs)
    assert out.logits is None, "a pipelined call returns the loss; the logits stay on the last stage"
    loss = out.loss
    loss.backward()
    want = eager(**kwargs).loss
    want.backward()
    grads = {fqn: p.grad for fqn, p in eager.named_parameters(remove_duplicate=False) if p.grad is not None}
    rel = max_rel_diff(pm.full_grads(), grads)
    worst = max(rel, key=rel.get)
    return {
        "status": "ok",
        "loss_rel": abs(loss.item() - want.item()) / abs(want.item()),
        "grad_rel": rel[worst],
        "worst": worst,
        "stage_mesh": pm.plan.pipeline.stage_mesh,
    }


def _run(rank: int, world: int) -> dict:
    zoo = _zoo()
    results = zoo._run_ranks(rank, world, list(zoo.CI_MODELS))
    results[("mistral", "pipeline=2")] = _pipelined_mistral()
    return results


@pytest.mark.multiproc
def test_a_handful_of_the_zoo_equals_eager_on_2x2_gloo(rank_pool) -> None:
    zoo = _zoo()
    results = rank_pool(math.prod(zoo.MESH)).run(_run, timeout_s=1500)
    failures = []
    for rank, by_label in enumerate(results):
        for label, result in by_label.items():
            if result["status"] == "refused":
                failures.append(f"rank {rank} {label}: refused ({result['reason']}); the zoo's handful must compile")
            elif not zoo.passed(result):
                failures.append(f"rank {rank} {label}: {result}")
    assert not failures, "\n".join(failures)
    assert results[0][("mistral", "pipeline=2")]["stage_mesh"] == (1, 2)
    for label in results[0]:
        if "plan_hash" in results[0][label]:
            assert all(r[label]["plan_hash"] == results[0][label]["plan_hash"] for r in results), label
    assert {name for name, _ in results[0]} >= set(zoo.CI_MODELS)
