"""``benchmarks/bench_vs_torch.py``'s ``own_plan``: which hand plan autopar's own plan is, by
placements alone (costs differ between clusters and executors, the program does not), so that a
gap between two trainers of the same program reads as the machine's noise (#43)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

import autopar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_vs_torch  # noqa: E402  (a script, found on the path set above)

CONFIG = dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def layouts():
    model = bench_vs_torch._gpt(CONFIG)
    batch = bench_vs_torch._batch(CONFIG, 4)

    def layout(kind: str, cluster: str):
        plan = autopar.hand_plan(kind, model, (2,), example_inputs=batch, cluster=cluster)
        return bench_vs_torch._layout(types.SimpleNamespace(plan=plan))

    return {(kind, cluster): layout(kind, cluster) for kind in ("ddp", "fsdp", "megatron") for cluster in ("cpu", "cpu-gloo")}


def test_a_plan_priced_on_another_cluster_is_the_same_layout(layouts):
    assert layouts["ddp", "cpu"] == layouts["ddp", "cpu-gloo"]
    trainers = {"autopar_ddp": layouts["ddp", "cpu"], "autopar_fsdp": layouts["fsdp", "cpu"]}
    assert bench_vs_torch.own_plan_is({**trainers, "autopar": layouts["ddp", "cpu-gloo"]}) == "ddp"
    assert bench_vs_torch.own_plan_is({**trainers, "autopar": layouts["fsdp", "cpu-gloo"]}) == "fsdp"


def test_a_layout_of_its_own_and_a_missing_trainer(layouts):
    trainers = {"autopar_ddp_compiled": layouts["ddp", "cpu"], "autopar_fsdp_compiled": layouts["fsdp", "cpu"]}
    assert bench_vs_torch.own_plan_is({**trainers, "autopar_compiled": layouts["megatron", "cpu"]}, "_compiled") == "own"
    assert bench_vs_torch.own_plan_is(trainers, "_compiled") is None  # no own-plan trainer ran
    # the uncompiled own plan is compared with the uncompiled hand plans only
    assert bench_vs_torch.own_plan_is({**trainers, "autopar": layouts["ddp", "cpu"]}) == "own"
    assert bench_vs_torch._layout(types.SimpleNamespace()) is None  # torch's trainers have no plan
