"""All-reduce as NCCL's tuner runs it: the cheaper of ring and tree (``autopar.cost.comm``)."""

from __future__ import annotations

import pytest
import torch

from autopar.cost import get_cluster
from autopar.cost.comm import (
    TREE_BANDWIDTH_FRACTION,
    all_reduce_s,
    all_reduce_terms,
    bucket_latency_s,
    param_grad_sync_cost,
    tree_latency_s,
)
from autopar.ir.spec import R

MiB = 2**20
H100 = get_cluster("h100-80g")  # α 5 us / β 450e9 in a node, 10 us / 50e9 between nodes
ALPHA, BETA = 1e-5, 50e9


def ring_s(k: int, num_bytes: float, alpha: float = ALPHA, beta: float = BETA) -> float:
    return 2 * (k - 1) * alpha + 2 * (k - 1) / k * num_bytes / beta


def tree_s(num_bytes: float, latency: float, beta: float = BETA) -> float:
    return latency + 2 / TREE_BANDWIDTH_FRACTION * num_bytes / beta


def test_tree_latency_counts_nodes_in_log_and_ranks_in_a_node_in_a_chain():
    # (128, 8): axis 0 has one rank per node on 128 nodes: 2·log2(128)·α
    assert tree_latency_s(0, (128, 8), H100) == pytest.approx(2 * 7 * ALPHA)
    # (16,): 8 ranks on each of 2 nodes: 2·(7·α_intra + 1·α_inter)
    assert tree_latency_s(0, (16,), H100) == pytest.approx(2 * (7 * 5e-6 + ALPHA))
    # inside a node the tree is a chain: the ring's latency
    assert tree_latency_s(1, (128, 8), H100) == pytest.approx(2 * 7 * 5e-6)


def test_tree_wins_small_messages_on_many_nodes():
    mesh = (128, 8)
    size = 25 * MiB  # one gradient bucket
    expected = tree_s(size, 2 * 7 * ALPHA)
    assert expected < ring_s(128, size)
    assert all_reduce_s(size, 0, mesh, H100) == pytest.approx(expected)
    # 2.54 ms of ring latency becomes 0.14 ms
    assert bucket_latency_s(0, mesh, H100, size) == pytest.approx(2 * 7 * ALPHA)


def test_ring_wins_large_messages_and_small_rings():
    mesh = (128, 8)
    big = 4 * 2**30
    assert ring_s(128, big) < tree_s(big, 2 * 7 * ALPHA)
    assert all_reduce_s(big, 0, mesh, H100) == pytest.approx(ring_s(128, big))
    # inside a node: the ring, at every size (same latency, more bandwidth for the tree)
    for size in (0, 1, MiB, 2**30):
        assert all_reduce_terms(size, 1, mesh, H100) == (2 * 7 * 5e-6, 2 * 7 / 8)
    # 2 nodes, one rank each: ring and tree have the same latency, the ring wins
    assert all_reduce_s(MiB, 0, (2, 8), H100) == pytest.approx(ring_s(2, MiB))


def test_the_choice_is_continuous_in_the_size():
    mesh = (64, 8)
    tree_latency = 2 * 6 * ALPHA
    # where ring and tree cost the same
    crossover = (2 * 63 * ALPHA - tree_latency) / ((2 / TREE_BANDWIDTH_FRACTION - 2 * 63 / 64) / BETA)
    below, above = all_reduce_s(crossover * 0.999, 0, mesh, H100), all_reduce_s(crossover * 1.001, 0, mesh, H100)
    assert below == pytest.approx(tree_s(crossover * 0.999, tree_latency))
    assert above == pytest.approx(ring_s(64, crossover * 1.001))
    at = ring_s(64, crossover)
    assert below == pytest.approx(at, rel=2e-3) and above == pytest.approx(at, rel=2e-3)
    # never above either algorithm, and non-decreasing in the size
    sizes = [crossover * f for f in (0.0, 0.25, 0.5, 0.9, 1.0, 1.1, 2.0, 4.0)]
    prices = [all_reduce_s(s, 0, mesh, H100) for s in sizes]
    assert prices == sorted(prices)
    for size, price in zip(sizes, prices):
        assert price <= min(ring_s(64, size), tree_s(size, tree_latency)) * (1 + 1e-12)


def test_gloo_keeps_the_ring():
    gloo = get_cluster("cpu-gloo")
    mesh = (8, 16)  # axis 0 spans nodes on a gloo cluster too
    link = gloo.axis_link(mesh, 0)
    assert all_reduce_s(MiB, 0, mesh, gloo) == pytest.approx(ring_s(8, MiB, link.latency_s, link.bandwidth_bytes_per_s))


def test_gradient_buckets_pay_the_algorithm_of_their_size():
    mesh = (128, 8)
    cap = 25 * MiB
    # a 1 MiB gradient (bf16, 512 Ki elements) shares a tree bucket: bytes/cap of its latency
    cost = param_grad_sync_cost((512 * 1024,), (R, R), 0, torch.bfloat16, mesh, H100, cap)
    expected = 2 * 7 * ALPHA * MiB / cap + 2 / TREE_BANDWIDTH_FRACTION * MiB / BETA
    assert cost.backward_s == pytest.approx(expected)
    # a gradient larger than any tree wins is its own ring bucket
    huge = 8 * 2**30
    cost = param_grad_sync_cost((huge // 2,), (R, R), 0, torch.bfloat16, mesh, H100, cap)
    assert cost.backward_s == pytest.approx(ring_s(128, huge))
