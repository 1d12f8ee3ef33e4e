"""The checkpoint policies' op lists (autopar/ir/memory.py): "selective-op" is torchtitan's
op-level policy, attention and every other matmul of a layer kept, counted as torch's dispatcher
sees them (``mm``, ``addmm``) and as the traced graph has them (``linear``, ``matmul``)."""

from __future__ import annotations

import torch

from autopar.ir.memory import CHECKPOINT_POLICIES, selective_op_kept, selective_op_role

aten = torch.ops.aten


def test_the_policies_are_named():
    assert set(CHECKPOINT_POLICIES) == {"selective", "selective-op", "full"}


def test_roles_at_the_dispatcher_and_in_the_traced_graph():
    assert selective_op_role(aten.mm.default) == "matmul"
    assert selective_op_role(aten.addmm.default) == "matmul"  # a linear with a bias
    assert selective_op_role(aten._scaled_dot_product_flash_attention.default) == "keep"
    assert selective_op_role(aten._scaled_dot_product_flash_attention_for_cpu.default) == "keep"
    assert selective_op_role(aten.scaled_dot_product_attention.default, (4, 4, 4)) == "keep"
    # a traced linear or matmul reaches the dispatcher as one mm where its right operand is a matrix
    assert selective_op_role(aten.linear.default, (3, 2)) == "matmul"
    assert selective_op_role(aten.linear.default, (2, 2, 1)) == "matmul"
    assert selective_op_role(aten.matmul.default, (3, 2)) == "matmul"
    assert selective_op_role(aten.matmul.default, (4, 4)) is None  # bmm: recomputed, as torchtitan does
    assert selective_op_role(aten.linear.default, (1, 2)) is None  # mv
    for op in (aten.bmm.default, aten.mul.Tensor, aten.silu.default, aten._to_copy.default, "not an op"):
        assert selective_op_role(op) is None


def test_every_second_matmul_is_recomputed():
    # a Llama layer: q, k, v, attention, o, gate, up, down, with norms and pointwise ops between
    roles = [None, "matmul", "matmul", "matmul", None, "keep", "matmul", None, "matmul", "matmul", None, "matmul"]
    kept = selective_op_kept(roles)
    assert [i for i, keeps in enumerate(kept) if keeps] == [1, 3, 5, 8, 11]  # q, v, attention, gate, down
    assert selective_op_kept([]) == []
