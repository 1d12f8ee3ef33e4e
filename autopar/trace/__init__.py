"""Capture a model as an ATen ``torch.fx`` graph with FakeTensor shapes (``export``), and run
meta-device models under fake tensors (``fake``)."""

from autopar.trace.export import GraphInput, TracedModel, aliased_writes, graph_hash, requires_grad, trace

__all__ = ["GraphInput", "TracedModel", "aliased_writes", "graph_hash", "requires_grad", "trace"]
