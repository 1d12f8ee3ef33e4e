"""The eval graph of a compiled module is planned on the train plan's shards (``autopar.runtime.modes``)."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar.cost.cluster import get_cluster
from autopar.ir.options import PlanOptions
from autopar.runtime.modes import pinned_placements
from autopar.solver.planners.traced import plan_traced
from autopar.trace import trace
from autopar.zoo.models import build_model, example_batch


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_the_eval_graph_keeps_every_parameter_and_buffer_where_the_train_plan_put_it(kind) -> None:
    model, batch = build_model("cnn"), example_batch("cnn", 8)
    train = autopar.hand_plan(kind, model, (2, 2), example_inputs=batch, cluster="cpu")
    model.eval()
    traced = trace(model, batch)
    norms = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default]
    assert norms and all(n.args[5] is False for n in norms), "eval-mode batch norm reads the running statistics"
    pinned = pinned_placements(traced, train)
    made = plan_traced(traced, (2, 2), get_cluster("cpu"), PlanOptions(), forced=pinned)
    for graph_input in traced.inputs:
        if graph_input.kind in ("param", "buffer"):
            assert made.nodes[graph_input.name].outs[0] == train.params[graph_input.fqn], graph_input.fqn


def test_a_tensor_the_compiled_mode_never_read_is_refused_by_name() -> None:
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return (self.a(x) if self.training else self.b(x)).sum()

    model = Branchy()
    x = torch.randn(2, 4)
    train = autopar.hand_plan("ddp", model, (2,), example_inputs=(x,), cluster="cpu")
    train = type(train)(
        **{
            **{f: getattr(train, f) for f in ("mesh_shape", "graph_hash", "nodes", "predicted")},
            "params": {k: v for k, v in train.params.items() if k.startswith("a.")},
        }
    )
    with pytest.raises(ValueError, match=r"parameter 'b.weight'.*model.train\(\) or model.eval\(\)"):
        pinned_placements(trace(model.eval(), (x,)), train)
