"""Capture a model as an ATen ``torch.fx`` graph with FakeTensor shapes (``export``), build a
deep model's graph from a shallow export of its repeated layers (``repeat``), and run
meta-device models under fake tensors (``fake``)."""

from autopar.trace.export import GraphInput, TracedModel, aliased_writes, graph_hash, is_param_cast, requires_grad, trace
from autopar.trace.repeat import trace_repeated

__all__ = [
    "GraphInput",
    "TracedModel",
    "aliased_writes",
    "graph_hash",
    "is_param_cast",
    "requires_grad",
    "trace",
    "trace_repeated",
]
