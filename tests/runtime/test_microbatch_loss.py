"""A pipelined loss put together from microbatches: weights by target counts (one process)."""

from __future__ import annotations

import pytest
import torch

from autopar.runtime.microbatch_loss import label_counts
from autopar.runtime.pipeline import loss_output
from autopar.trace import trace

transformers = pytest.importorskip("transformers")
from tests.zoo.hf_models import llama  # noqa: E402


def _counts(model, args=(), kwargs=None):
    traced = trace(model, args, kwargs)
    return label_counts(traced, loss_output(traced)[1])


def test_hf_causal_lm_microbatches_weigh_by_their_shifted_label_counts():
    model, kwargs = llama(batch_size=2)
    counts = _counts(model, kwargs=kwargs)
    assert counts.alone and counts.ignore_index == -100
    _, batch = llama(batch_size=4)
    labels = batch["labels"].clone()
    assert counts.weights([batch["input_ids"], labels], 2) == [1.0, 1.0], "even counts: weights of exactly 1"
    labels[2:, 3:] = -100  # microbatch 1 keeps labels 1 and 2 of each row (the shift drops label 0): 4, against 30
    assert counts.weights([batch["input_ids"], labels], 2) == pytest.approx([2 * 30 / 34, 2 * 4 / 34])
    labels[2:] = -100
    with pytest.raises(ValueError, match="microbatch 1 of this step holds no target"):
        counts.weights([batch["input_ids"], labels], 2)


def test_a_summed_loss_is_refused():
    model, kwargs = llama(batch_size=2)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        _counts(model, kwargs={**kwargs, "num_items_in_batch": 7})


class _WithAux(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 5)

    def forward(self, x, y):
        logits = self.linear(x)
        return torch.nn.functional.cross_entropy(logits, y) + 0.1 * logits.pow(2).mean()


def test_uneven_counts_with_another_loss_term_are_refused():
    x, y = torch.randn(4, 8), torch.tensor([1, 2, 3, 4])
    counts = _counts(_WithAux(), (x, y))
    assert not counts.alone
    assert counts.weights([x, y], 2) == [1.0, 1.0]
    with pytest.raises(ValueError, match="combined with other terms"):
        counts.weights([x, torch.tensor([1, -100, 3, 4])], 2)
