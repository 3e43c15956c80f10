"""Structured outputs in the sampler: a row's token bitmask sets the tokens it may not take to
-inf.

A bitmask row is xgrammar's layout: `ceil(V / 32)` int32 words, bit `t % 32` of word `t // 32`
set when token `t` is allowed (`tp_engine.features.structured.grammar.GrammarState.fill`). The bitmask
has a row for every row of the batch, and only the rows with a constraint are filled and
applied: the others' rows are never read, so the mask is one `empty` allocation and one copy,
with no gather or scatter of logits rows.

`apply_token_bitmask` is xgrammar's kernel (Triton on a GPU, C++ on CPU);
`apply_token_bitmask_reference` is the same in plain torch, what the tests compare it with.
"""

from __future__ import annotations

import torch

from tp_engine.core.sampling.tensors import GrammarMask


def apply_token_bitmask(logits: torch.Tensor, mask: GrammarMask) -> None:
    """In place: `logits[r, t] = -inf` for each row r of `mask.rows` where bit t of
    `mask.bitmask[r]` is 0. `logits` [B, V] fp32."""
    import xgrammar as xgr  # deferred: only batches with a constraint need it

    xgr.apply_token_bitmask_inplace(
        logits, mask.bitmask, vocab_size=logits.shape[-1], indices=list(mask.rows)
    )


def apply_token_bitmask_reference(logits: torch.Tensor, mask: GrammarMask) -> None:
    """`apply_token_bitmask` in plain torch, unpacking every bit (what the tests compare with)."""
    vocab_size = logits.shape[-1]
    bits = torch.arange(32, device=mask.bitmask.device, dtype=torch.int32)
    for row in mask.rows:
        words = mask.bitmask[row].unsqueeze(-1)  # [W, 1]
        allowed = ((words >> bits) & 1).bool().flatten()[:vocab_size]  # [V]
        logits[row].masked_fill_(~allowed, float("-inf"))
