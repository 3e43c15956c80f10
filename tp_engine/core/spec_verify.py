"""Verification: which drafted tokens the target model accepts.

A verify entry computes `[last token, d_1 .. d_n]` in one forward pass, so the target's logits at
its `n + 1` positions are those it would have at output positions `c .. c + n` had it produced
`d_1 .. d_j` itself. Every position is sampled exactly as without speculation (same processors,
same counter-based noise, keyed by output position: `tp_engine.core.sampling.batch`), giving
`y_0 .. y_n`; then `y_0 .. y_a` are emitted, where `a` is the number of leading drafts with
`y_j == d_{j+1}`.

This is rejection sampling for a deterministic proposer (draft distribution q = one-hot at d):
d is accepted with probability p(d) = min(1, p(d) / q(d)), and on rejection the token comes
from (p - q)+ normalised, which is p restricted to tokens other than d; drawing y ~ p and
accepting iff y == d does both at once. Every emitted token therefore has the target's
distribution, and since the draws are the ones the non-speculative run makes at the same output
positions, a seeded or greedy request's tokens are identical with and without speculation
(greedy: accept while the draft is the argmax). Both proposers here (n-gram lookup, a greedy
draft model) are deterministic given the sequence's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """The accepted drafts of one step's sampled entries (S of them, in sampled order)."""

    # [S] int32: drafts accepted, and tokens emitted (accepted + 1: the target's own token at
    # the first rejected position, or after the last draft).
    num_accepted: np.ndarray
    num_emitted: np.ndarray
    # [sum(num_emitted)] int64: the emitted tokens, entry after entry.
    token_ids: np.ndarray
    # [sum(num_emitted)] intp: their sampled (logits) rows, for their logprobs.
    rows: np.ndarray


def accept_drafts(sampled: np.ndarray, num_drafts: np.ndarray, draft_tokens: np.ndarray) -> Verdict:
    """`sampled [R]`: the token drawn at every sampled logits row, entry i owning
    `num_drafts[i] + 1` consecutive rows; `draft_tokens [sum(num_drafts)]`: the drafts, entry
    after entry."""
    num_drafts = np.asarray(num_drafts, dtype=np.int64)
    num_entries = num_drafts.size
    row_starts = np.zeros(num_entries, dtype=np.int64)
    np.cumsum(num_drafts[:-1] + 1, out=row_starts[1:])
    num_accepted = num_drafts.copy()
    if draft_tokens.size:
        entry = np.repeat(np.arange(num_entries), num_drafts)  # [D] each draft's entry
        draft_starts = np.cumsum(num_drafts) - num_drafts
        j = np.arange(draft_tokens.size) - draft_starts[entry]  # [D] its index in the entry
        match = sampled[row_starts[entry] + j] == draft_tokens
        # The first mismatch of each entry (num_drafts where all match).
        np.minimum.at(num_accepted, entry[~match], j[~match])
    num_emitted = num_accepted + 1
    # Emitted rows: the first num_emitted rows of each entry.
    entry = np.repeat(np.arange(num_entries), num_emitted)
    offsets = np.arange(entry.size) - (np.cumsum(num_emitted) - num_emitted)[entry]
    rows = (row_starts[entry] + offsets).astype(np.intp)
    return Verdict(
        num_accepted.astype(np.int32), num_emitted.astype(np.int32),
        np.asarray(sampled, dtype=np.int64)[rows], rows,
    )  # fmt: skip
