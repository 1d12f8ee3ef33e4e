"""The ranks' agreement on each call's data (``autopar.runtime.data``), on rows made here."""

from __future__ import annotations

import pytest
import torch

from autopar.ir.data import DataLayout
from autopar.runtime.data import _check_same_data, fingerprint


def _rows(groups: list[int], batches: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.tensor([g, 0.0], dtype=torch.float64), fingerprint([b], torch.device("cpu"))])
                        for g, b in zip(groups, batches)])


def test_fingerprints_tell_reordered_shifted_and_reshaped_batches_apart() -> None:
    x = torch.arange(12.0).reshape(4, 3)
    same = fingerprint([x, torch.tensor([1, 2])], torch.device("cpu"))
    assert torch.equal(same, fingerprint([x.clone(), torch.tensor([1, 2])], torch.device("cpu")))
    for other in (x.flip(0), x + 1, x.reshape(3, 4), x[:3]):
        assert not torch.equal(fingerprint([other, torch.tensor([1, 2])], torch.device("cpu")), same)
    assert not torch.equal(fingerprint([torch.tensor([1, 2]), x], torch.device("cpu")), same)


def test_whole_batches_must_be_equal_on_every_rank_and_the_error_names_the_per_rank_mode() -> None:
    x = torch.randn(4, 3)
    layout = DataLayout("whole", (0,), (2, 2))
    _check_same_data(_rows([0, 0, 0, 0], [x, x, x, x]), layout)
    with pytest.raises(ValueError, match=r"ranks 0 and 2 passed different batches.*batch='per_rank'"):
        _check_same_data(_rows([0, 0, 0, 0], [x, x, x[[1, 0, 2, 3]], x]), layout)


def test_per_rank_rows_agree_within_a_data_parallel_rank_only() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    layout = DataLayout("per_rank", (0,), (2, 2))
    _check_same_data(_rows([0, 0, 1, 1], [a, a, b, b]), layout)
    with pytest.raises(ValueError, match=r"ranks 2 and 3 have data-parallel rank 1.*DistributedSampler"):
        _check_same_data(_rows([0, 0, 1, 1], [a, a, b, a]), layout)
