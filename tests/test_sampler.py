"""Rank 0's sampler: greedy rows take the argmax, other rows follow softmax(logits / T)."""

from __future__ import annotations

import pytest
import torch

from rank_worker.sampler import sample


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, torch.zeros(5)).tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_and_generator() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    temps = torch.tensor([0.0, 1.0, 0.0, 0.7])
    a = sample(logits, temps, torch.Generator().manual_seed(5))
    b = sample(logits, temps, torch.Generator().manual_seed(5))
    assert a.tolist() == b.tolist()  # the generator makes sampling reproducible
    assert a[0] == logits[0].argmax() and a[2] == logits[2].argmax()


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).expand(20_000, -1).contiguous()
    tokens = sample(logits, torch.ones(20_000), torch.Generator().manual_seed(2))
    freq = torch.bincount(tokens, minlength=3).float() / 20_000
    # 20k draws: the standard error of each frequency is below 0.004.
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.02, rtol=0)
    # Temperature 0.5 squares and renormalises the probabilities.
    tokens = sample(logits, torch.full((20_000,), 0.5), torch.Generator().manual_seed(3))
    freq = torch.bincount(tokens, minlength=3).float() / 20_000
    p = torch.tensor([0.36, 0.09, 0.01]) / 0.46
    torch.testing.assert_close(freq, p, atol=0.02, rtol=0)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match="must be"):
        sample(torch.zeros(3, 4), torch.zeros(2))
