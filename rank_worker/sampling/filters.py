"""Truncation of the sampling distribution: min-p, top-k and top-p (nucleus).

They never move the argmax, so greedy rows skip them. Each takes the temperature-scaled logits
of the rows that use it and returns them with the dropped tokens at -inf. Order (as vLLM):
min-p on the full distribution, then top-k, then top-p on what top-k kept, renormalised.

Semantics, exactly (the tests' row-by-row references follow the same words):
- min-p: drop tokens whose probability is below `min_p * max probability`;
- top-k: keep the tokens whose logit is at least the k-th largest (ties at the k-th value are
  kept, so a row can keep a few more than k);
- top-p: with tokens in decreasing probability, keep a token while the probability mass of the
  tokens before it is below top_p; the most likely token is always kept.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """`logits [M, V]`, `min_p [M]` -> logits with improbable tokens at -inf."""
    probs = torch.softmax(logits, dim=-1)  # [M, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [M, 1]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    max_k: int | None = None,
) -> torch.Tensor:
    """`logits [S, V]`, `top_k [S]` (V = off), `top_p [S]` (1 = off) or None for no top-p;
    `max_k`: `top_k.max()` when the caller knows it (reading it from a GPU waits for the GPU)."""
    vocab_size = logits.shape[-1]
    if top_p is None:
        # Top-k alone needs only each row's k-th value: one topk of the largest k in the batch
        # instead of a sort over the whole vocabulary.
        if max_k is None:
            max_k = int(top_k.max())
        if max_k >= vocab_size:
            values = logits.sort(dim=-1, descending=True).values
        else:
            values = logits.topk(max_k, dim=-1).values  # [S, max_k], descending
        kth = values.gather(1, (top_k.clamp(max=values.shape[1]) - 1).unsqueeze(1))  # [S, 1]
        return logits.masked_fill(logits < kth, _NEG_INF)

    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [S, V] each
    kth = sorted_logits.gather(1, (top_k.clamp(max=vocab_size) - 1).unsqueeze(1))  # [S, 1]
    drop = sorted_logits < kth  # [S, V] top-k
    probs = torch.softmax(sorted_logits.masked_fill(drop, _NEG_INF), dim=-1)  # [S, V]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [S, V]
    # Rows with top-p off skip the test: rounding can push mass_before past 1.0 in a long tail.
    nucleus = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop |= nucleus
    drop[:, 0] = False  # the most likely token always survives
    drop_in_vocab_order = torch.empty_like(drop).scatter_(1, order, drop)  # [S, V]
    return logits.masked_fill(drop_in_vocab_order, _NEG_INF)
