"""Parallel kernels against the torch ops they replace (``autopar.ops.parallel``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.ops.parallel import cross_entropy_mean


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "ignored", "weighted", "smoothed"])
def test_the_batch_split_loss_of_one_rank_is_torchs_mean_cross_entropy(dtype, case):
    """With no axis to reduce over, the batch-split loss is the rank's own mean cross entropy:
    its value and its gradient equal ``F.cross_entropy``'s (the gradient one over the
    denominator to the local sum, ``_WholeMean``), up to the rounding of the dtype."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 7, generator=generator, dtype=torch.float64).to(dtype)
    target = torch.randint(0, 7, (12,), generator=generator)
    kwargs: dict = {}
    if case == "ignored":
        target[::3] = -100
    if case == "weighted":
        kwargs["weight"] = torch.rand(7, generator=generator, dtype=torch.float64).to(dtype) + 0.5
    if case == "smoothed":
        kwargs["label_smoothing"] = 0.1
    ours_in, theirs_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = cross_entropy_mean(axis_groups=(), self=ours_in, target=target, **kwargs)
    theirs = F.cross_entropy(theirs_in, target, **kwargs)
    grad = torch.tensor(0.75, dtype=dtype)
    ours.backward(grad)
    theirs.backward(grad)
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 2e-2}[dtype]
    assert ours.dtype == theirs.dtype == dtype
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, rtol=tolerance, atol=tolerance)
    assert ours.grad_fn is not None and type(ours.grad_fn).__name__ == "_WholeMeanBackward"
