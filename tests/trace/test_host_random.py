"""Random numbers a forward draws from Python's ``random`` or NumPy (``autopar.trace.host_random``):
a graph that depends on them is refused, one they leave unchanged passes with a warning."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from autopar.errors import TraceError
from autopar.trace import trace


class Drawing(torch.nn.Module):
    """Skips its second layer on a host draw below ``p`` (LayerDrop written with Python's or NumPy's
    generator), or scales by a draw (``scale``)."""

    def __init__(self, how: str, p: float = 0.5):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.how, self.p = how, p

    def forward(self, x):
        y = self.first(x)
        if self.how == "scale":
            return y.sum() * (1 + float(np.random.rand()))
        draw = random.random() if self.how == "python" else float(np.random.rand())
        if draw >= self.p:
            y = self.second(y)
        return y.sum()


@pytest.mark.parametrize("how", ["python", "numpy", "scale"])
def test_a_graph_that_depends_on_host_draws_is_refused_with_the_fix(how):
    random.seed(0)
    np.random.seed(3)  # draws apart from the check's own second seed
    with pytest.raises(TraceError, match=r"Drawing's forward draws random numbers from Python's random or NumPy.*torch\.rand"):
        trace(Drawing(how), (torch.randn(2, 4),))


def test_draws_that_change_nothing_pass_with_a_warning_and_leave_the_stream_as_one_call(caplog):
    random.seed(1)
    random.random()  # what one eager call draws
    want = random.random()
    random.seed(1)
    with caplog.at_level(logging.WARNING, logger="autopar"):
        traced = trace(Drawing("python", p=0.0), (torch.randn(2, 4),))  # never below 0: always both layers
    assert random.random() == want
    assert "drew random numbers from Python's random or NumPy while tracing" in caplog.text
    assert sum(1 for n in traced.gm.graph.nodes if n.target is torch.ops.aten.linear.default) == 2


def test_a_forward_without_host_draws_is_exported_once(monkeypatch):
    calls = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or export(*a, **k))
    trace(torch.nn.Linear(4, 4), (torch.randn(2, 4),))
    assert calls == [1]
