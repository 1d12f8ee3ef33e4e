"""Cost model tests: every number here is computed by hand in the comment beside it."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
import tomllib
import torch

from autopar.cost import (
    ClusterSpec,
    CommCost,
    LinkSpec,
    all_gather_s,
    all_reduce_s,
    all_to_all_s,
    bytes_sent,
    compute_cost_s,
    get_cluster,
    grad_allreduce_cost,
    local_bytes,
    node_bytes,
    node_flops,
    param_state_bytes,
    preset_names,
    reduce_scatter_s,
    saves_inputs,
    saves_output,
    send_recv_s,
    tensor_bytes,
    transition_cost,
)
from autopar.cost.cluster import PRESETS_DIR
from autopar.cost.comm import TransitionPrices, transition_bytes_per_axis
from autopar.ir.spec import SS, P, R, S
from autopar.rules.registry import Strategy, op_info_from_values

aten = torch.ops.aten
MiB = 1 << 20
GiB = 1 << 30


def round_cluster(devices_per_node: int = 8) -> ClusterSpec:
    """A cluster with round numbers: α = 10 us and β = 1e9 B/s inside a node, 100 us and 1e8 B/s
    between nodes; 1e12 FLOP/s fp32, 1e11 B/s memory."""
    return ClusterSpec(
        name="round",
        devices_per_node=devices_per_node,
        num_nodes=2,
        peak_flops={"float32": 1e12, "bfloat16": 4e12},
        memory_bandwidth_bytes_per_s=1e11,
        memory_bytes=16 * GiB,
        intra_node=LinkSpec(latency_s=1e-5, bandwidth_bytes_per_s=1e9),
        inter_node=LinkSpec(latency_s=1e-4, bandwidth_bytes_per_s=1e8),
        source="test",
    )


# ---------------------------------------------------------------------------------------------
# cluster


def test_presets_load_and_describe_their_source():
    assert set(preset_names()) >= {"h100-80g", "a100-40g", "v100-16g", "cpu", "cpu-gloo"}
    for name in preset_names():
        cluster = get_cluster(name)
        assert cluster.name == name
        assert cluster.source and cluster.notes
    assert get_cluster(None) == get_cluster("h100-80g")
    spec = get_cluster("cpu")
    assert get_cluster(spec) is spec


def test_h100_preset_numbers():
    h100 = get_cluster("h100-80g")
    assert h100.devices_per_node == 8
    assert h100.peak_flops_for(torch.bfloat16) == 989e12
    assert h100.memory_bytes == 80 * GiB
    assert h100.intra_node == LinkSpec(5e-6, 450e9)
    assert h100.inter_node == LinkSpec(10e-6, 50e9)


def test_peak_flops_falls_back_to_float32():
    v100 = get_cluster("v100-16g")
    assert v100.peak_flops_for(torch.bfloat16) == v100.peak_flops["float32"] == 15.7e12
    assert v100.peak_flops_for(torch.float16) == 125e12


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match="unknown cluster 'tpu-v9'") as err:
        get_cluster("tpu-v9")
    for name in ("h100-80g", "a100-40g", "v100-16g", "cpu"):
        assert name in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        get_cluster(tmp_path / "nope.json")


def test_axis_link_last_axis_is_innermost():
    cluster = round_cluster(devices_per_node=8)
    # mesh (2, 8): axis 1 groups 8 consecutive ranks (one node); axis 0 groups ranks r and r + 8.
    assert cluster.axis_link((2, 8), 1) == cluster.intra_node
    assert cluster.axis_link((2, 8), 0) == cluster.inter_node
    assert cluster.axis_link((16, 8), 1) == cluster.intra_node
    assert cluster.axis_link((16, 8), 0) == cluster.inter_node
    # mesh (2, 4) fits in one node of 8: both axes intra-node.
    assert cluster.axis_link((2, 4), 0) == cluster.intra_node
    # mesh (4, 2) with 4 devices per node: axis 0's block is 8 ranks, two nodes.
    assert round_cluster(4).axis_link((4, 2), 0) == cluster.inter_node
    assert round_cluster(4).axis_link((4, 2), 1) == cluster.intra_node
    # with 16 devices per node the whole (2, 8) mesh is one node
    assert round_cluster(16).axis_link((2, 8), 0) == cluster.intra_node
    # a block of 3 does not divide 8: the group of ranks 6, 7, 8 straddles two nodes
    assert cluster.axis_link((4, 3), 1) == cluster.inter_node
    with pytest.raises(ValueError, match="out of range"):
        cluster.axis_link((2, 8), 2)


def test_a_group_crosses_nodes_on_the_nics_of_its_devices():
    one_nic = round_cluster(devices_per_node=8)
    dgx = dataclasses.replace(one_nic, nics_per_node=8)
    nic = dgx.inter_node.bandwidth_bytes_per_s

    def bandwidth(cluster, mesh, axis):
        return cluster.axis_link(mesh, axis).bandwidth_bytes_per_s

    # one device of each group per node (DP over TP 8): each group on its device's NIC
    assert dgx.axis_link((16, 8), 0) == dgx.inter_node
    # a whole node's devices in one group (FSDP over 64 GPUs): on all 8 NICs, NVLink's at most
    assert bandwidth(dgx, (64,), 0) == min(8 * nic, dgx.intra_node.bandwidth_bytes_per_s)
    # two devices of a group per node (a (16, 4) mesh's axis 0, ranks 4 apart): two NICs
    assert bandwidth(dgx, (16, 4), 0) == 2 * nic
    assert dgx.network_lanes((16, 4), 0) == 2 and dgx.network_lanes((16, 4), 1) == 4
    # one NIC a node (the default): every group on that one, as before
    assert one_nic.axis_link((64,), 0) == one_nic.inter_node
    # latency stays one link's; the spec round-trips its NICs
    assert dgx.axis_link((64,), 0).latency_s == dgx.inter_node.latency_s
    assert ClusterSpec.from_json(dgx.to_json()) == dgx and "nics_per_node" not in one_nic.to_json()
    with pytest.raises(ValueError, match="nics_per_node"):
        dataclasses.replace(dgx, nics_per_node=0)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_save_load_round_trip(tmp_path, suffix):
    cluster = get_cluster("h100-80g")
    path = tmp_path / f"cluster{suffix}"
    cluster.save(path)
    text = path.read_text()
    data = tomllib.loads(text) if suffix == ".toml" else json.loads(text)
    assert data["intra_node"]["bandwidth_bytes_per_s"] == 450e9
    assert ClusterSpec.load(path) == cluster
    assert get_cluster(path) == cluster
    assert get_cluster(str(path)) == cluster
    assert ClusterSpec.from_json(json.dumps(cluster.to_json())) == cluster


def test_validation_errors():
    good = round_cluster().to_json()
    with pytest.raises(ValueError, match="latency_s must be finite and > 0"):
        LinkSpec(latency_s=-1.0, bandwidth_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s"):
        LinkSpec(latency_s=1e-6, bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError, match="devices_per_node must be an integer >= 1"):
        ClusterSpec.from_json({**good, "devices_per_node": 0})
    with pytest.raises(ValueError, match="include 'float32'"):
        ClusterSpec.from_json({**good, "peak_flops": {"bfloat16": 1e12}})
    with pytest.raises(ValueError, match="not a torch dtype name"):
        ClusterSpec.from_json({**good, "peak_flops": {"float32": 1e12, "fp8": 1e12}})
    with pytest.raises(ValueError, match=r"unknown keys \['bandwith'\]"):
        ClusterSpec.from_json({**good, "bandwith": 1})
    with pytest.raises(ValueError, match=r"missing keys \['memory_bytes'\]"):
        ClusterSpec.from_json({k: v for k, v in good.items() if k != "memory_bytes"})


def test_load_reports_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**round_cluster().to_json(), "num_nodes": -2}))
    with pytest.raises(ValueError, match="bad.json.*num_nodes"):
        ClusterSpec.load(path)


# ---------------------------------------------------------------------------------------------
# comm


def test_all_reduce_1gib_on_8_way_h100_node():
    h100 = get_cluster("h100-80g")
    # 2·7·5e-6 + 2·7/8 · 2^30 / 450e9 = 7e-5 + 4.17566e-3
    expected_s = 7e-5 + 1.75 * GiB / 450e9
    assert all_reduce_s(GiB, 1, (2, 8), h100) == pytest.approx(expected_s)
    assert all_reduce_s(GiB, 1, (2, 8), h100) == pytest.approx(4.2456627e-3)
    # the same on the inter-node axis of mesh (8, 8): 2·7·10e-6 + 1.75 · 2^30 / 50e9
    assert all_reduce_s(GiB, 0, (8, 8), h100) == pytest.approx(1.4e-4 + 1.75 * GiB / 50e9)


def test_collective_formulas():
    cluster = round_cluster()
    mesh = (4,)
    # (k-1)·α + (k-1)/k · bytes/β = 3e-5 + 0.75 · 4 MiB / 1e9
    expected_s = 3e-5 + 0.75 * 4 * MiB / 1e9
    assert all_gather_s(4 * MiB, 0, mesh, cluster) == pytest.approx(expected_s)
    assert reduce_scatter_s(4 * MiB, 0, mesh, cluster) == pytest.approx(expected_s)
    assert all_to_all_s(4 * MiB, 0, mesh, cluster) == pytest.approx(expected_s)
    for fn in (all_reduce_s, all_gather_s, reduce_scatter_s, all_to_all_s):
        assert fn(4 * MiB, 0, (1, 4), cluster) == 0.0


@pytest.mark.parametrize(
    "axis, alpha, beta",
    [(1, 1e-5, 1e9), (0, 1e-4, 1e8)],  # mesh (2, 4) on 8-device nodes: axis 1 intra; (4, 4): axis 0 inter
)
def test_every_collective_per_link_level(axis, alpha, beta):
    cluster = round_cluster()
    mesh = (2, 4) if axis == 1 else (4, 4)
    k = 4
    assert cluster.axis_link(mesh, axis).latency_s == alpha
    size = 8 * MiB
    # ring all-reduce: 2(k-1)·α + 2(k-1)/k · bytes/β
    assert all_reduce_s(size, axis, mesh, cluster) == pytest.approx(6 * alpha + 1.5 * size / beta)
    # all-gather (output size), reduce-scatter (input size), all-to-all: (k-1)·α + (k-1)/k · bytes/β
    for fn in (all_gather_s, reduce_scatter_s, all_to_all_s):
        assert fn(size, axis, mesh, cluster) == pytest.approx(3 * alpha + 0.75 * size / beta)
    # send/recv to a neighbour: α + bytes/β
    assert send_recv_s(size, axis, mesh, cluster) == pytest.approx(alpha + size / beta)
    assert bytes_sent("send_recv", size, k) == size


def test_send_recv_and_numbers_by_hand():
    cluster = round_cluster()
    # 1 MiB intra-node: 1e-5 + 1048576 / 1e9 = 1.058576e-3 s
    assert send_recv_s(MiB, 0, (8,), cluster) == pytest.approx(1.058576e-3)
    # all-reduce of 1 MiB on 8 intra-node ranks: 14e-5 + 1.75 · 1048576 / 1e9 = 1.975008e-3 s
    assert all_reduce_s(MiB, 0, (8,), cluster) == pytest.approx(1.975008e-3)
    # all-gather to 1 MiB on 2 inter-node ranks of mesh (2, 8): 1e-4 + 0.5 · 1048576 / 1e8
    assert all_gather_s(MiB, 0, (2, 8), cluster) == pytest.approx(5.34288e-3)
    assert send_recv_s(MiB, 0, (1, 8), cluster) == 0.0


def test_bytes_sent():
    assert bytes_sent("all_reduce", 800, 8) == 1400  # 2·7/8·800
    assert bytes_sent("all_gather", 800, 8) == 700  # 7/8·800
    assert bytes_sent("reduce_scatter", 800, 8) == 700
    assert bytes_sent("all_to_all", 800, 8) == 700
    assert bytes_sent("chunk", 800, 8) == 0
    assert bytes_sent("all_reduce", 800, 1) == 0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        bytes_sent("broadcast", 800, 8)


# A [1024, 1024] fp32 tensor is 4 MiB; on mesh (4,) with α = 1e-5, β = 1e9:
FULL = 4 * MiB
GATHER_FULL_S = 3e-5 + 0.75 * FULL / 1e9  # all-gather to 4 MiB, or reduce-scatter of 4 MiB
ALL_REDUCE_FULL_S = 6e-5 + 1.5 * FULL / 1e9


def _cost(src, dst, requires_grad, mesh=(4,), shape=(1024, 1024)):
    return transition_cost(src, dst, shape, torch.float32, mesh, round_cluster(), requires_grad)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_transition_shard_to_replicate(requires_grad):
    # all-gather forward; backward keeps the local chunk (free)
    cost = _cost((S(0),), (R,), requires_grad)
    assert cost.forward_s == pytest.approx(GATHER_FULL_S)
    assert cost.backward_s == 0.0
    assert cost.bytes_sent == pytest.approx(0.75 * FULL)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_transition_partial_to_replicate(requires_grad):
    # all-reduce forward; identity backward
    cost = _cost((P,), (R,), requires_grad)
    assert cost.forward_s == pytest.approx(ALL_REDUCE_FULL_S)
    assert cost.backward_s == 0.0
    assert cost.bytes_sent == pytest.approx(1.5 * FULL)


def test_transition_replicate_to_shard():
    # chunk is free forward; its backward all-gathers the 1 MiB gradient shards into 4 MiB
    assert _cost((R,), (S(0),), requires_grad=False) == CommCost(0.0, 0.0, 0.0)
    cost = _cost((R,), (S(0),), requires_grad=True)
    assert cost.forward_s == 0.0
    assert cost.backward_s == pytest.approx(GATHER_FULL_S)
    assert cost.bytes_sent == pytest.approx(0.75 * FULL)


def test_transition_partial_to_shard_and_all_to_all():
    # reduce-scatter of 4 MiB; backward all-gathers the gradient back to 4 MiB
    cost = _cost((P,), (S(0),), requires_grad=True)
    assert cost.forward_s == pytest.approx(GATHER_FULL_S)
    assert cost.backward_s == pytest.approx(GATHER_FULL_S)
    assert cost.bytes_sent == pytest.approx(1.5 * FULL)
    # all-to-all of the 1 MiB local shard, both ways
    shard_s = 3e-5 + 0.75 * MiB / 1e9
    cost = _cost((S(0),), (S(1),), requires_grad=True)
    assert cost.forward_s == pytest.approx(shard_s)
    assert cost.backward_s == pytest.approx(shard_s)
    assert cost.bytes_sent == pytest.approx(2 * 0.75 * MiB)


def test_transition_identity_and_impossible():
    assert _cost((S(0),), (S(0),), requires_grad=True) == CommCost(0.0, 0.0, 0.0)
    assert _cost((R,), (P,), requires_grad=True) is None


@pytest.mark.parametrize("mesh", [(2, 8), (2, 2, 4)])
def test_transition_prices_are_transition_cost_to_the_bit(mesh):
    """``TransitionPrices`` shares the work of many (pair, shape) and gives the same floats."""
    cluster = get_cluster("h100-80g")
    placements = [R, P, S(0), S(1), SS(1, 2)]
    specs = list(itertools.product(placements, repeat=len(mesh)))
    prices = TransitionPrices(mesh, cluster)
    for (i, src), (j, dst) in itertools.product(enumerate(specs[::3]), enumerate(specs[::2])):
        for shape, dtype, grad, grad_dtype in [
            ((64, 128), torch.bfloat16, True, torch.float32),
            ((32, 64), torch.float32, False, None),
        ]:
            cost = transition_cost(src, dst, shape, dtype, mesh, cluster, grad, grad_dtype)
            expected = None if cost is None else (cost.forward_s + cost.backward_s, cost.bytes_sent)
            # Codes number the specs, one per spec (their positions in ``specs``).
            assert prices.price(src, dst, (3 * i, 2 * j), shape, dtype, grad, grad_dtype) == expected


def test_transition_two_axes_prices_each_step_at_its_local_size():
    # mesh (2, 8) on the round cluster with 8 devices per node: axis 1 intra, axis 0 inter.
    # S(0),S(1) → R,R: all-gather on axis 1 first ([512,128] → [512,1024], 2 MiB out, intra),
    # then on axis 0 ([512,1024] → [1024,1024], 4 MiB out, inter).
    cost = _cost((S(0), S(1)), (R, R), requires_grad=True, mesh=(2, 8))
    axis1_s = 7e-5 + 7 / 8 * 2 * MiB / 1e9
    axis0_s = 1e-4 + 1 / 2 * 4 * MiB / 1e8
    assert cost.forward_s == pytest.approx(axis1_s + axis0_s)
    assert cost.backward_s == 0.0
    assert cost.bytes_sent == pytest.approx(7 / 8 * 2 * MiB + 1 / 2 * 4 * MiB)
    assert dict(cost.bytes_per_axis) == pytest.approx({1: 7 / 8 * 2 * MiB, 0: 1 / 2 * 4 * MiB})
    assert transition_bytes_per_axis((S(0), S(1)), (R, R), (1024, 1024), torch.float32, (2, 8), True) == (
        pytest.approx({1: 7 / 8 * 2 * MiB, 0: 1 / 2 * 4 * MiB})
    )
    # R → S(0) on axis 0 of (2, 8): a free chunk forward, an all-gather of the gradient backward
    chunk = transition_bytes_per_axis((R, R), (S(0), R), (1024, 1024), torch.float32, (2, 8), True)
    assert chunk == {0: 0.5 * 4 * MiB}
    assert transition_bytes_per_axis((R, R), (S(0), R), (1024, 1024), torch.float32, (2, 8), False) == {}


def test_plan_reports_bytes_per_mesh_axis():
    import autopar
    from autopar.zoo.models import MLP

    # a large batch on mesh (2, 2): data parallel, so every byte is a gradient all-reduce
    model = MLP(d_in=64, d_hidden=256, d_out=64, depth=2)
    plan = autopar.plan(model, (2, 2), example_inputs=(torch.randn(4096, 64), torch.randn(4096, 64)), cluster="cpu")
    per_axis = plan.predicted.comm_bytes_per_axis
    assert plan.predicted.comm_bytes > 0 and all(b > 0 for b in per_axis)
    assert len(per_axis) == 2 and sum(per_axis) == pytest.approx(plan.predicted.comm_bytes, abs=2)
    assert "by mesh axis: axis 0 (size 2)" in plan.summary()


def test_grad_allreduce_cost():
    # a replicated [1024, 1024] fp32 gradient all-reduced over mesh (4,) in backward
    cost = grad_allreduce_cost((1024, 1024), (R,), 0, torch.float32, (4,), round_cluster())
    assert cost.forward_s == 0.0
    assert cost.backward_s == pytest.approx(ALL_REDUCE_FULL_S)
    assert cost.bytes_sent == pytest.approx(1.5 * FULL)
    # sharded on axis 0 of (2, 4), all-reduced on axis 1: the local tensor is 2 MiB
    cost = grad_allreduce_cost((1024, 1024), (S(0), R), 1, torch.float32, (2, 4), round_cluster())
    assert cost.backward_s == pytest.approx(6e-5 + 1.5 * 2 * MiB / 1e9)


# ---------------------------------------------------------------------------------------------
# compute


def info_for(target, *args, **kwargs):
    """An OpInfo for ``target`` called on meta tensors, as the tracer would see it."""
    kw = {}
    positional = [a for a in target._schema.arguments if not a.kwarg_only]
    for arg, value in zip(positional, args):
        kw[arg.name] = value
    for arg in target._schema.arguments:
        if arg.name in kwargs:
            kw[arg.name] = kwargs[arg.name]
        elif arg.name not in kw:
            kw[arg.name] = arg.default_value if arg.has_default_value() else None
    out = target(*args, **kwargs)
    return op_info_from_values("node", target, kw, out)


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


def test_node_flops_formulas():
    # mm [128, 256] x [256, 512]: 2·128·256·512, via torch's flop_registry
    assert node_flops(info_for(aten.mm.default, meta(128, 256), meta(256, 512))) == 33554432
    # addmm and bmm via the registry too
    assert node_flops(info_for(aten.addmm.default, meta(512), meta(128, 256), meta(256, 512))) == 33554432
    assert node_flops(info_for(aten.bmm.default, meta(3, 4, 5), meta(3, 5, 6))) == 2 * 3 * 4 * 5 * 6
    # linear x [4, 8, 16], weight [32, 16]: 2 · (512/16) · 16 · 32
    assert node_flops(info_for(aten.linear.default, meta(4, 8, 16), meta(32, 16), meta(32))) == 32768
    # matmul [2, 3, 4] x [4, 5]: 2 · 6 · 4 · 5
    assert node_flops(info_for(aten.matmul.default, meta(2, 3, 4), meta(4, 5))) == 240
    # sdpa q [2, 4, 8, 16], k, v [2, 4, 10, 16]: 4·B·H·T·S·D = 4·2·4·8·10·16
    q, kv = meta(2, 4, 8, 16), meta(2, 4, 10, 16)
    assert node_flops(info_for(aten.scaled_dot_product_attention.default, q, kv, kv)) == 40960
    # conv2d x [2, 3, 8, 8], w [4, 3, 3, 3] → out [2, 4, 6, 6]: 2 · 36 · 9 · 2 · 4 · 3
    assert node_flops(info_for(aten.conv2d.default, meta(2, 3, 8, 8), meta(4, 3, 3, 3))) == 15552
    # the same convolution as aten.convolution goes through the registry and agrees
    conv = info_for(aten.convolution.default, meta(2, 3, 8, 8), meta(4, 3, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    assert node_flops(conv) == 15552
    # pointwise: one per output element; reductions: one per input element; views: none
    assert node_flops(info_for(aten.add.Tensor, meta(10, 10), meta(10))) == 100
    assert node_flops(info_for(aten.sum.dim_IntList, meta(10, 10), [1])) == 100
    assert node_flops(info_for(aten.view.default, meta(10, 10), [100])) == 0


def test_node_bytes():
    # add [10, 10] + [10] → [10, 10], fp32: (100 + 10 + 100) · 4
    assert node_bytes(info_for(aten.add.Tensor, meta(10, 10), meta(10))) == 840
    # bf16 mm [128, 256] x [256, 512]: (32768 + 131072 + 65536) · 2
    mm = info_for(aten.mm.default, meta(128, 256, dtype=torch.bfloat16), meta(256, 512, dtype=torch.bfloat16))
    assert node_bytes(mm) == 458752
    for view in (
        info_for(aten.view.default, meta(10, 10), [100]),
        info_for(aten.transpose.int, meta(10, 10), 0, 1),
        info_for(aten.t.default, meta(10, 10)),
    ):
        assert node_bytes(view) == 0
    # embedding: int64 indices [4, 8] and the gathered rows read and written, [4, 8, 16] fp32
    emb = info_for(aten.embedding.default, meta(1000, 16), meta(4, 8, dtype=torch.int64))
    assert node_bytes(emb) == 32 * 8 + 2 * 512 * 4


def test_inductor_prices_a_fused_pointwise_op_by_its_output_alone():
    from autopar.cost.compute import executed_bytes

    add = info_for(aten.add.Tensor, meta(10, 10), meta(10))
    assert executed_bytes(add, "eager") == node_bytes(add) == 840
    assert executed_bytes(add, "inductor") == 400  # the [10, 10] fp32 output; inputs come fused
    mm = info_for(aten.mm.default, meta(128, 256), meta(256, 512))
    assert executed_bytes(mm, "inductor") == node_bytes(mm)  # an extern kernel, priced as eager
    cluster = dataclasses.replace(get_cluster("cpu"), executor="inductor")
    assert ClusterSpec.from_json(json.dumps(cluster.to_json())) == cluster
    strategy = Strategy(ins=((R,), (R,)), outs=((R,),))
    assert compute_cost_s(add, strategy, (1,), cluster, False) < compute_cost_s(add, strategy, (1,), get_cluster("cpu"), False)
    with pytest.raises(ValueError, match="executor"):
        dataclasses.replace(cluster, executor="tvm")


def test_compute_cost_roofline_and_split():
    cluster = round_cluster()
    mesh = (4,)
    info = info_for(aten.mm.default, meta(128, 256), meta(256, 512))
    # flops 33554432 / 1e12 = 3.3554432e-5 s; bytes 917504 / 1e11 = 9.17504e-6 s: compute bound
    forward_s = 33554432 / 1e12
    replicated = Strategy(ins=((R,), (R,)), outs=((R,),))
    assert compute_cost_s(info, replicated, mesh, cluster, requires_grad=False) == pytest.approx(forward_s)
    # backward of a matmul is 2× its forward
    assert compute_cost_s(info, replicated, mesh, cluster, requires_grad=True) == pytest.approx(3 * forward_s)
    row_split = Strategy(ins=((S(0),), (R,)), outs=((S(0),),))
    assert compute_cost_s(info, row_split, mesh, cluster, False) == pytest.approx(forward_s / 4)
    # S(1) x S(0) → P splits the contraction: also a quarter of the work
    contraction_split = Strategy(ins=((S(1),), (S(0),)), outs=((P,),))
    assert compute_cost_s(info, contraction_split, mesh, cluster, False) == pytest.approx(forward_s / 4)
    # on mesh (2, 4), rows on axis 0 and columns on axis 1: an eighth
    both = Strategy(ins=((S(0), R), (R, S(1))), outs=((S(0), S(1)),))
    assert compute_cost_s(info, both, (2, 4), cluster, False) == pytest.approx(forward_s / 8)


def test_compute_cost_memory_bound_pointwise():
    cluster = round_cluster()
    info = info_for(aten.add.Tensor, meta(1000, 1000), meta(1000, 1000))
    # 1e6 flops / 1e12 = 1e-6 s; 12e6 bytes / 1e11 = 1.2e-4 s: memory bound; backward 1× forward
    strategy = Strategy(ins=((R,), (R,)), outs=((R,),))
    assert compute_cost_s(info, strategy, (4,), cluster, False) == pytest.approx(1.2e-4)
    assert compute_cost_s(info, strategy, (4,), cluster, True) == pytest.approx(2.4e-4)
    # a bf16 matmul uses the bf16 peak (4e12)
    mm = info_for(aten.mm.default, meta(1024, 1024, dtype=torch.bfloat16), meta(1024, 1024, dtype=torch.bfloat16))
    replicated = Strategy(ins=((R,), (R,)), outs=((R,),))
    assert compute_cost_s(mm, replicated, (4,), cluster, False) == pytest.approx(2 * 1024**3 / 4e12)


def test_ranks_beyond_the_compute_slots_share_a_device():
    import dataclasses

    cluster = round_cluster()  # 8 devices per node
    info = info_for(aten.mm.default, meta(128, 256), meta(256, 512))
    row_split = Strategy(ins=((S(0),), (R,)), outs=((S(0),),))
    forward_s = 33554432 / 1e12
    assert cluster.compute_slots_per_node is None and cluster.compute_share((8,)) == 1.0
    # a node that runs 2 ranks at once (2 one-thread CPU ranks on 2 cores)
    two = dataclasses.replace(cluster, compute_slots_per_node=2)
    assert two.ranks_per_node((2,)) == 2 and two.ranks_per_node((4, 4)) == 8
    assert [two.compute_share(mesh) for mesh in ((1,), (2,), (4,), (2, 2), (8,), (4, 4))] == [1, 1, 0.5, 0.5, 0.25, 0.25]
    # 2 ranks: each its own core, half the work; 4 ranks: a quarter of the work at half speed,
    # so the same time as 2 ranks: the extra ranks bring no compute of their own
    assert compute_cost_s(info, row_split, (2,), two, False) == pytest.approx(forward_s / 2)
    assert compute_cost_s(info, row_split, (4,), two, False) == pytest.approx(forward_s / 2)
    assert compute_cost_s(info, row_split, (4,), cluster, False) == pytest.approx(forward_s / 4)
    # a replicated op is done whole by every rank: 4 ranks on 2 slots take twice as long
    replicated = Strategy(ins=((R,), (R,)), outs=((R,),))
    assert compute_cost_s(info, replicated, (4,), two, True) == pytest.approx(2 * 3 * forward_s)
    # memory-bound ops share the host too
    add = info_for(aten.add.Tensor, meta(1000, 1000), meta(1000, 1000))
    pointwise = Strategy(ins=((R,), (R,)), outs=((R,),))
    assert compute_cost_s(add, pointwise, (4,), two, False) == pytest.approx(2 * 1.2e-4)
    # gloo moves messages with the ranks' CPU: their links run at the same share
    assert two.axis_link((2,), 0) is two.intra_node
    assert two.axis_link((4,), 0) == LinkSpec(2 * cluster.intra_node.latency_s, 0.5 * cluster.intra_node.bandwidth_bytes_per_s)
    assert all_reduce_s(1e6, 0, (4,), two) == pytest.approx(2 * all_reduce_s(1e6, 0, (4,), cluster))
    assert all_reduce_s(1e6, 0, (2,), two) == all_reduce_s(1e6, 0, (2,), cluster)
    # the field round-trips, is left out of JSON when unset, and is validated
    assert ClusterSpec.from_json(two.to_json()) == two
    assert "compute_slots_per_node" not in cluster.to_json()
    with pytest.raises(ValueError, match="compute_slots_per_node must be an integer >= 1"):
        ClusterSpec.from_json({**cluster.to_json(), "compute_slots_per_node": 0})


def test_a_pipelines_stage_meshes_share_the_nodes_slots():
    # Two pipeline stages of (1, 2) on mesh (2, 2): each stage's graph is priced on its stage mesh,
    # but all four ranks share the node's 2 slots, as the whole mesh's would.
    import dataclasses

    two = dataclasses.replace(round_cluster(), compute_slots_per_node=2)
    stage = dataclasses.replace(two, concurrent_meshes=2)
    assert stage.ranks_per_node((1, 2)) == two.ranks_per_node((2, 2)) == 4
    assert stage.compute_share((1, 2)) == two.compute_share((2, 2)) == 0.5 and two.compute_share((1, 2)) == 1.0
    assert stage.axis_link((1, 2), 1) == two.axis_link((2, 2), 1)
    assert dataclasses.replace(round_cluster(), concurrent_meshes=8).ranks_per_node((4,)) == 8  # up to a node's devices
    assert ClusterSpec.from_json(stage.to_json()) == stage and "concurrent_meshes" not in two.to_json()
    with pytest.raises(ValueError, match="concurrent_meshes must be an integer >= 1"):
        ClusterSpec.from_json({**two.to_json(), "concurrent_meshes": 0})


def test_cpu_cluster_counts_this_hosts_cores(monkeypatch):
    import dataclasses

    from autopar.cost import cluster as cluster_module
    from autopar.cost.cluster import cpu_cluster, host_cores, local_cluster

    assert host_cores() >= 1
    assert cpu_cluster(threads_per_rank=1, cores=2).compute_slots_per_node == 2
    assert cpu_cluster(threads_per_rank=2, cores=8).compute_slots_per_node == 4
    assert cpu_cluster(threads_per_rank=4, cores=2).compute_slots_per_node == 1  # at least one
    with pytest.raises(ValueError, match="threads_per_rank must be an integer >= 1"):
        cpu_cluster(threads_per_rank=0)
    # everything else is the "cpu-gloo" preset's: gloo's links between one host's processes, as
    # measured there, slower than the generic "cpu" preset's interconnect
    spec = cpu_cluster(threads_per_rank=1, cores=2)
    gloo = get_cluster("cpu-gloo")
    assert spec.name == "cpu-gloo (2 slots)" and gloo.compute_slots_per_node is None
    assert dataclasses.replace(spec, name="cpu-gloo", compute_slots_per_node=None) == gloo
    assert gloo.intra_node.latency_s > get_cluster("cpu").intra_node.latency_s
    # compile's default on a machine without CUDA: the host's cores over this process's threads
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(cluster_module, "host_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert local_cluster().compute_slots_per_node == 2
    assert local_cluster().compute_share((4,)) == 0.5


# ---------------------------------------------------------------------------------------------
# memory


def test_tensor_and_local_bytes():
    assert tensor_bytes((1024, 1024), torch.float32) == 4 * MiB
    assert tensor_bytes((1024, 1024), torch.bfloat16) == 2 * MiB
    assert local_bytes((1024, 1024), torch.float32, (S(0),), (4,)) == MiB
    assert local_bytes((1024, 1024), torch.float32, (S(0), S(1)), (2, 4)) == MiB // 2
    assert local_bytes((1024, 1024), torch.float32, (P,), (4,)) == 4 * MiB


def test_param_state_bytes():
    shape, mesh = (1024, 1024), (4,)
    # local shard [256, 1024] fp32 = 1 MiB; param + grad = 2 MiB; adamw adds 2 fp32 states
    assert param_state_bytes(shape, torch.float32, (S(0),), mesh) == 4 * MiB
    assert param_state_bytes(shape, torch.float32, (S(0),), mesh, optimizer="adam") == 4 * MiB
    assert param_state_bytes(shape, torch.float32, (S(0),), mesh, optimizer="sgd") == 2 * MiB
    assert param_state_bytes(shape, torch.float32, (S(0),), mesh, optimizer="sgd-momentum") == 3 * MiB
    # replicated: the whole 4 MiB on every rank, four times over
    assert param_state_bytes(shape, torch.float32, (R,), mesh) == 16 * MiB
    # bf16 params keep fp32 optimizer state: 0.5 + 0.5 + 2 MiB
    assert param_state_bytes(shape, torch.bfloat16, (S(0),), mesh) == 3 * MiB
    assert param_state_bytes(shape, torch.float32, (S(0),), mesh, optimizer="adamw-amsgrad") == 5 * MiB  # a third moment
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'.*adam, adam-amsgrad, adamw, adamw-amsgrad, sgd, sgd-momentum"):
        param_state_bytes(shape, torch.float32, (S(0),), mesh, optimizer="lamb")


def test_saved_for_backward():
    for target in (
        aten.mm.default,
        aten.linear.default,
        aten.gelu.default,
        aten.mul.Tensor,
        aten.native_layer_norm.default,
        aten.embedding.default,
        aten.scaled_dot_product_attention.default,
        aten.convolution.default,
    ):
        assert saves_inputs(target), target
    for target in (aten.add.Tensor, aten.view.default, aten.mul.Scalar, aten.relu.default):
        assert not saves_inputs(target), target
    for target in (aten.relu.default, aten._softmax.default, aten._log_softmax.default, aten.tanh.default):
        assert saves_output(target), target
    assert not saves_output(aten.mm.default)


def test_presets_dir_is_packaged_data():
    assert PRESETS_DIR.name == "presets"
    assert all(math.isfinite(get_cluster(n).memory_bandwidth_bytes_per_s) for n in preset_names())


def test_vocab_parallel_cross_entropy_prices_its_own_all_gather() -> None:
    # The kernel all-gathers [2, N] float32 (each row's log-sum-exp and target logit) once per
    # axis, which no edge of the graph shows; the strategy's price must carry it.
    from autopar.cost.cluster import get_cluster
    from autopar.cost.comm import all_gather_s, bytes_sent
    from autopar.solver.problem.choices import build_choice_graph
    from autopar.trace import trace
    from autopar.zoo.models import build_model, example_batch

    config = dict(vocab_size=1024, n_layer=1, bias=False)
    traced = trace(build_model("gpt", **config), example_batch("gpt", batch_size=4, **config))
    cluster = get_cluster("cpu")
    graph = build_choice_graph(traced, (2,), cluster)
    choice = next(c for c in graph.choices.values() if c.info is not None and "cross_entropy" in str(c.info.target))
    index = next(i for i, s in enumerate(choice.strategies) if s.kernel == "cross_entropy_vocab_split")
    gathered = 2 * 2 * 4 * (4 * 32)  # ranks x (lse, target logit) x float32 x (batch x sequence)
    assert choice.priced[index].grad_sync_bytes == pytest.approx(bytes_sent("all_gather", gathered, 2))
    replicated = next(i for i, s in enumerate(choice.strategies) if s.kernel is None and s.ins[0] == (R,))
    assert choice.priced[index].compute_s >= all_gather_s(gathered, 0, (2,), cluster)
    assert choice.priced[index].compute_s - all_gather_s(gathered, 0, (2,), cluster) < choice.priced[replicated].compute_s


def test_default_budget_is_the_device_memory_less_a_reserve():
    from autopar.cost.cluster import resolve_budget

    spec = get_cluster("h100-80g")
    assert spec.memory_reserve_bytes == int(0.1 * spec.memory_bytes)
    assert spec.default_memory_budget == spec.memory_bytes - spec.memory_reserve_bytes
    assert resolve_budget(None, spec) == spec.default_memory_budget
    assert resolve_budget(float("inf"), spec) is None
    assert resolve_budget(2e9, spec) == 2e9
    with pytest.raises(ValueError, match="positive"):
        resolve_budget(0, spec)


def test_local_cluster_prices_this_machine(monkeypatch):
    from autopar.cost.cluster import local_cluster

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_cluster().name.startswith("cpu-gloo") and local_cluster().compute_slots_per_node is not None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 85_000_000_000})())
    spec = local_cluster()
    assert spec.name.startswith("h100-80g") and spec.memory_bytes == 85_000_000_000
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Some Accelerator")
    with pytest.raises(ValueError, match="no cluster preset prices the CUDA device 'Some Accelerator'"):
        local_cluster()


@pytest.mark.parametrize("mesh", [(2, 2, 4), (2, 2, 2, 4)])
def test_price_pairs_are_price_to_the_bit(mesh):
    """``TransitionPrices.price_pairs`` prices many pairs at once with numpy: the same floats as
    ``price`` pair by pair, and None (not possible) where it is None."""
    cluster = get_cluster("h100-80g")
    placements = [R, P, S(0), S(1), SS(1, 2)]
    specs = list(itertools.product(placements, repeat=len(mesh)))[:: 1 if len(mesh) == 3 else 5]
    prices = TransitionPrices(mesh, cluster)
    rows = np.array([prices.numbered(spec) for spec in specs], dtype=prices.numbers.dtype)
    src, dst = (a.ravel() for a in np.meshgrid(np.arange(len(specs)), np.arange(len(specs)), indexing="ij"))
    for args in [((64, 128), torch.bfloat16, True, torch.float32), ((32, 64), torch.float32, False, None)]:
        possible, seconds, sent = prices.price_pairs(rows[src], rows[dst], *args)
        got = [(s, b) if ok else None for ok, s, b in zip(possible.tolist(), seconds.tolist(), sent.tolist())]
        expected = [prices.price(specs[i], specs[j], (i, j), *args) for i, j in zip(src.tolist(), dst.tolist())]
        assert got == expected and None in got


def test_a_padded_shard_is_priced_padded_and_moves_only_to_replicated():
    """FSDP2's padded parameter shard (``ir.spec.padded_axis``): 64 rows on 3 ranks hold
    ceil(64 / 3) = 22 rows each in memory, and its gather moves 3 x 22 rows; any other move is
    impossible."""
    cluster = get_cluster("h100-80g")
    shape, even, mesh = (64, 1024), (66, 1024), (3,)
    assert local_bytes(shape, torch.float32, (S(0),), mesh) == 22 * 1024 * 4
    assert param_state_bytes(shape, torch.float32, (S(0),), mesh) == 4 * 22 * 1024 * 4, "param, grad, 2 AdamW states"
    padded = transition_cost((S(0),), (R,), shape, torch.float32, mesh, cluster, True)
    same_bytes = transition_cost((S(0),), (R,), even, torch.float32, mesh, cluster, True)
    assert padded is not None and padded == same_bytes, "priced as the 66-row tensor it pads to"
    # the all-gather's output: 3 pieces of 22 rows (the gradient's reduce-scatter is the parameter's
    # gradient sync, priced with the gathered use)
    assert padded.bytes_sent == pytest.approx(2 / 3 * 66 * 1024 * 4)
    assert transition_cost((S(0),), (S(1),), shape, torch.float32, mesh, cluster, True) is None
    assert transition_cost((S(0),), (S(1),), even, torch.float32, mesh, cluster, True) is not None
    # the batch pricer agrees, pair by pair, and so does the vectorized one
    prices = TransitionPrices(mesh, cluster)
    specs = [(R,), (S(0),), (S(1),)]
    for (i, src), (j, dst) in itertools.product(enumerate(specs), repeat=2):
        cost = transition_cost(src, dst, shape, torch.float32, mesh, cluster, True)
        expected = None if cost is None else (cost.forward_s + cost.backward_s, cost.bytes_sent)
        assert prices.price(src, dst, (i, j), shape, torch.float32, True) == expected, (src, dst)
    rows = np.array([prices.numbered(spec) for spec in specs])
    src, dst = np.repeat(rows, 3, axis=0), np.tile(rows, (3, 1))
    possible, seconds, _ = prices.price_pairs(src, dst, shape, torch.float32, True)
    pairs = list(itertools.product(specs, repeat=2))
    assert [bool(p) for p in possible] == [
        transition_cost(a, b, shape, torch.float32, mesh, cluster, True) is not None for a, b in pairs
    ]
    assert seconds[pairs.index(((S(0),), (R,)))] == pytest.approx(padded.forward_s + padded.backward_s)
