"""Rank 0's sampler: one token per row of gathered logits.

Greedy rows (temperature 0) take the argmax; other rows sample from `softmax(logits / T)`.
Sampling uses the exponential race (`argmax(p / E)` with `E ~ Exp(1)` is distributed as
`Categorical(p)`), which is batched over rows with different temperatures and takes a
generator. Top-p/top-k come later.
"""

from __future__ import annotations

import torch

# Temperatures at or below this are greedy; dividing logits by them would overflow anyway.
GREEDY_EPSILON = 1e-5


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`logits [B, V]` fp32, `temperatures [B]` -> token ids `[B]` int64."""
    if logits.ndim != 2 or temperatures.shape != logits.shape[:1]:
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} and temperatures {tuple(temperatures.shape)} "
            "must be [B, V] and [B]"
        )
    temperatures = temperatures.to(device=logits.device, dtype=torch.float32)
    greedy_rows = temperatures <= GREEDY_EPSILON  # [B]
    greedy = logits.argmax(dim=-1)  # [B]
    if bool(greedy_rows.all()):  # the common all-greedy batch skips the [B, V] softmax
        return greedy
    safe_t = torch.where(greedy_rows, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits.float() / safe_t.unsqueeze(-1), dim=-1)  # [B, V]
    race = torch.empty_like(probs).exponential_(generator=generator)  # [B, V] ~ Exp(1)
    sampled = (probs / race).argmax(dim=-1)  # [B]
    return torch.where(greedy_rows, greedy, sampled)
