"""Sharding rules. Importing this package registers every rule family."""

from autopar.rules import dtensor_adapter, factory, losses, matmul, moe, nn_ops, pointwise, reductions, views  # noqa: F401
from autopar.rules.registry import (  # noqa: F401
    RULES,
    OpInfo,
    Row,
    Strategy,
    TensorArg,
    node_strategies,
    op_info,
    register,
)
