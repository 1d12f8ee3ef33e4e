"""The optimizer step in the predicted step (``autopar.cost.optimizer``): AdamW priced from the bytes
it reads and writes, in every plan."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost import comm
from autopar.cost.cluster import get_cluster
from autopar.cost.liveness import Interval
from autopar.cost.optimizer import (
    KERNELS_PER_TENSOR,
    adamw_step_s,
    default_implementation,
    dtensor_dispatch_s,
    holds_dtensors,
    implementation,
    plan_step_s,
    step_temporary,
    stepped_tensors,
)
from autopar.cost.rates import OPTIMIZER_TRAFFIC
from autopar.zoo.models import GPT


def _cluster(launch: float = 1e-5):
    h200 = get_cluster("h200-141g")
    return dataclasses.replace(h200, rates=dataclasses.replace(h200.rates, launch_overhead_s=launch, memory_efficiency=0.5))


def test_stepped_tensors_are_the_parameters_with_a_gradient():
    sizes = {"w": 100.0, "frozen": 1000.0}
    intervals = [
        Interval("w", "param", 0, 9),
        Interval("w", "optimizer_state", 0, 9, 4.0),  # two fp32 moments of a bf16 parameter
        Interval("w", "grad", 5, 9, 0.5),  # ZeRO-2: half of the gradient
        Interval("frozen", "param", 0, 9),
        Interval("x", "activation", 1, 8),
    ]
    # 2 P + G + 2 S: the parameter read and written, the gradient read, both moments read and written
    assert stepped_tensors(intervals, sizes.get) == [2 * 100 + 50 + 2 * 400]


def test_implementations_by_bandwidth_and_launches():
    cluster = _cluster()
    bandwidth = cluster.memory_bandwidth_bytes_per_s * 0.5
    big = [1e9] * 4  # bandwidth-bound: the passes over memory decide
    assert adamw_step_s(big, cluster, "fused") == pytest.approx(4e9 / bandwidth)
    assert adamw_step_s(big, cluster, "foreach") == pytest.approx(OPTIMIZER_TRAFFIC["foreach"] * 4e9 / bandwidth)
    assert adamw_step_s(big, cluster, "for-loop") == pytest.approx(adamw_step_s(big, cluster, "foreach"))
    small = [1e3] * 100  # host-bound: the launches decide, 8 kernels per tensor in a for-loop
    assert adamw_step_s(small, cluster, "fused") == pytest.approx(1e-5)
    assert adamw_step_s(small, cluster, "foreach") == pytest.approx(100 * 1e-5)
    assert adamw_step_s(small, cluster, "for-loop") == pytest.approx(100 * KERNELS_PER_TENSOR * 1e-5)
    with pytest.raises(ValueError, match="for-loop"):
        adamw_step_s(small, cluster, "sgd")


def test_cpu_ranks_share_cores_and_step_for_loop():
    cpu = dataclasses.replace(get_cluster("cpu-gloo"), compute_slots_per_node=2)
    assert default_implementation(cpu) == "for-loop" and default_implementation(get_cluster("h200-141g")) == "foreach"
    alone = adamw_step_s([1e8], cpu, "for-loop", (2,))
    assert adamw_step_s([1e8], cpu, "for-loop", (4,)) == pytest.approx(2 * alone)  # 4 ranks on 2 cores


def _gpt():
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, bias=False)
    batch = torch.randint(0, 256, (8, 32))
    return model, (batch, batch)


def test_every_plan_prices_its_optimizer_step_from_its_local_shards():
    model, batch = _gpt()
    cluster = _cluster(launch=0.0)
    ddp = autopar.hand_plan("ddp", model, (4,), example_inputs=batch, cluster=cluster)
    fsdp = autopar.hand_plan("fsdp", model, (4,), example_inputs=batch, cluster=cluster)
    elements = sum(p.numel() for p in model.parameters())
    # fp32 parameters, gradients and both moments: 2·4 + 4 + 2·8 bytes per element, foreach's passes
    whole = OPTIMIZER_TRAFFIC["foreach"] * elements * 28 / (cluster.memory_bandwidth_bytes_per_s * 0.5)
    assert ddp.predicted.optimizer_s == pytest.approx(whole, rel=1e-6)
    assert fsdp.predicted.optimizer_s < 0.3 * ddp.predicted.optimizer_s  # each rank steps its quarter
    for plan in (ddp, fsdp):
        parts = plan.predicted
        schedule = parts.grad_schedule
        overlap = 0.0  # FSDP's gathers on an NCCL cluster: what compute does not hide of them (pricing.comm_schedule)
        if schedule.get("gather_s", 0.0) or schedule.get("regather_s", 0.0):
            hidden = comm.exposed_gathers_s(schedule["gathered_s"], schedule["first_gather_s"], schedule["forward_s"])
            overlap = hidden - schedule["gather_s"] - schedule["regather_s"] + schedule["copy_s"]
        assert parts.step_time_s == pytest.approx(
            parts.compute_s + parts.reshard_s + schedule["delta_s"] - parts.grad_sync_s
            + parts.exposed_grad_sync_s + parts.optimizer_s + overlap
        )  # fmt: skip
        assert json.loads(plan.to_json())["predicted"]["optimizer_s"] == parts.optimizer_s


def test_dtensor_dispatch_is_per_op_where_a_parameter_is_sharded():
    cpu = dataclasses.replace(get_cluster("cpu-gloo"), compute_slots_per_node=2)
    assert holds_dtensors([(Replicate(), Shard(0)), (Replicate(), Replicate())])
    assert not holds_dtensors([(Replicate(), Replicate())])
    per_tensor = KERNELS_PER_TENSOR * cpu.dtensor_op_s
    assert dtensor_dispatch_s(10, cpu, (2,)) == pytest.approx(10 * per_tensor)
    assert dtensor_dispatch_s(10, cpu, (4,)) == pytest.approx(20 * per_tensor)  # 4 ranks on 2 cores
    sizes = [1e6] * 10
    assert plan_step_s(sizes, cpu, (2,), True) == pytest.approx(adamw_step_s(sizes, cpu, "for-loop", (2,)) + 10 * per_tensor)
    assert plan_step_s(sizes, cpu, (2,), False) == adamw_step_s(sizes, cpu, "for-loop", (2,))
    assert get_cluster("h200-141g").dtensor_op_s == 0.0, "not measured on a GPU host yet"
    assert type(cpu).from_json(cpu.to_json()) == cpu
    with pytest.raises(ValueError, match="dtensor_op_s"):
        dataclasses.replace(cpu, dtensor_op_s=-1.0)


def test_a_declared_optimizer_is_the_one_priced():
    """``optimizer="adamw:fused"`` prices the fused kernel's one pass and no foreach temporary at
    the step (torch's default on CUDA, foreach, holds half the state again there); the plan
    records it, and a JSON round trip keeps it. The default writes nothing new into the JSON."""
    model, _ = _gpt()
    batch = (torch.randint(0, 256, (1, 8)),) * 2  # few activations: the step is the peak
    cluster = _cluster(launch=0.0)
    foreach = autopar.plan(model, (1,), example_inputs=batch, cluster=cluster)
    fused = autopar.plan(model, (1,), example_inputs=batch, cluster=cluster, optimizer="adamw:fused")
    elements = sum(p.numel() for p in model.parameters())
    one_pass = elements * 28 / (cluster.memory_bandwidth_bytes_per_s * 0.5)
    assert fused.predicted.optimizer_s == pytest.approx(OPTIMIZER_TRAFFIC["fused"] * one_pass, rel=1e-6)
    assert foreach.predicted.optimizer_s == pytest.approx(OPTIMIZER_TRAFFIC["foreach"] * one_pass, rel=1e-6)
    state = 8 * elements  # both fp32 moments
    assert foreach.predicted.peak_memory_bytes - fused.predicted.peak_memory_bytes == pytest.approx(0.5 * state, rel=0.01)
    assert fused.optimizer == "adamw:fused" and foreach.optimizer == "adamw"
    assert "optimizer=adamw:fused" in fused.summary() and "optimizer=" not in foreach.summary()
    assert autopar.Plan.from_json(fused.to_json()).optimizer == "adamw:fused"
    assert "optimizer" not in json.loads(foreach.to_json())
    assert implementation(cluster, "adamw") == "foreach" and implementation(get_cluster("cpu-gloo"), "adamw") == "for-loop"
    assert implementation(get_cluster("cpu-gloo"), "adamw:foreach") == "foreach"
    assert step_temporary(get_cluster("cpu-gloo"), "adamw:foreach") == 0.5 and step_temporary(cluster, "sgd:foreach") == 0.0
    # amsgrad: three moments, of which foreach's temporary is one (the square root of their maximum)
    assert step_temporary(cluster, "adamw-amsgrad") == pytest.approx(1 / 3)


def test_an_optimizer_autopar_does_not_price_is_refused_by_name():
    model, batch = _gpt()
    for name in ("lion", "adamw:apex", "adamw:"):
        with pytest.raises(autopar.errors.ConfigError, match="unknown optimizer.*adamw:fused"):
            autopar.plan(model, (1,), example_inputs=batch, cluster="cpu-gloo", optimizer=name)
