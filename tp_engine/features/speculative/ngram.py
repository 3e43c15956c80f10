"""N-gram proposals (vLLM's "ngram" method, prompt lookup decoding): find the longest suffix of a
sequence's tokens, between `prompt_lookup_min` and `prompt_lookup_max` tokens long, that occurred
earlier in the sequence (prompt or output), and propose the tokens that followed its most recent
earlier occurrence.

It runs on rank 0 over token arrays it keeps per batch row (a row listener of the running batch:
a row's array is filled when a sequence takes it and extended with the tokens appended since),
so nothing is rebuilt from Python lists each step. The match is numpy over positions: one
comparison of the whole array with the last token, then the candidate set shrinks once per
further suffix token; there is no Python loop over tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tp_engine.core.running_batch import RowFollower
from tp_engine.core.sequence import Sequence


def longest_suffix_match(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """`(end, n)`: the last position `end < len - 1` where an earlier copy of the longest suffix
    of `tokens` of length `n` in [min_n, max_n] ends; (-1, 0) if there is none."""
    num = tokens.size
    if num < min_n + 1:
        return -1, 0
    # Copies of the last token that some token follows: ends of matches of length 1.
    ends = np.flatnonzero(tokens[: num - 1] == tokens[num - 1])
    best_end, best_n = (int(ends[-1]), 1) if ends.size else (-1, 0)
    n = 1
    while ends.size and n < max_n:
        # Extend every match one token to the left; keep those that still match.
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[num - 1 - n]]
        n += 1
        if ends.size:
            best_end, best_n = int(ends[-1]), n
    if best_n < min_n:
        return -1, 0
    return best_end, best_n


class NgramProposer(RowFollower):
    """Proposes up to k draft tokens per row from the row's own tokens (the scheduler's
    `DraftProposer`; it knows its drafts before any block is allocated). `may_draft(rows)`:
    which rows may be drafted at all (the sampling builder's rule); None: all."""

    drafts_after_allocation = False

    def __init__(
        self,
        k: int,
        min_n: int,
        max_n: int,
        may_draft: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.num_speculative_tokens = k
        self.min_n, self.max_n = min_n, max_n
        self.may_draft = may_draft
        # Row -> its sequence, and a token buffer whose first `_count[row]` entries are filled.
        self._seqs: dict[int, Sequence] = {}
        self._tokens: dict[int, np.ndarray] = {}
        self._count: dict[int, int] = {}

    # -- the batch's rows (RunningBatch's row listener) ------------------------------------------

    def reset_rows(self, max_rows: int) -> None:
        self._seqs.clear()
        self._tokens.clear()
        self._count.clear()

    def add_row(self, row: int, seq: Sequence) -> None:
        self._seqs[row] = seq
        self._tokens[row] = np.zeros(max(64, 2 * seq.num_tokens), dtype=np.int32)
        self._count[row] = 0

    def remove_row(self, row: int) -> None:
        self._seqs.pop(row, None)
        self._tokens.pop(row, None)
        self._count.pop(row, None)

    # -- proposals ---------------------------------------------------------------------------------

    def eligible(self, rows: np.ndarray) -> np.ndarray:
        if self.may_draft is None:
            return np.ones(rows.size, dtype=bool)
        return self.may_draft(rows)

    def propose(self, rows: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for `rows` (at most `max_drafts[i]` for row i): `(draft_tokens [D] int32 in row
        order, num_drafts [R] int32)`."""
        num_drafts = np.zeros(rows.size, dtype=np.int32)
        drafts: list[np.ndarray] = []
        for i, (row, limit) in enumerate(zip(rows.tolist(), max_drafts.tolist(), strict=True)):
            if limit <= 0:
                continue
            tokens = self._synced(row)
            end, n = longest_suffix_match(tokens, self.min_n, self.max_n)
            if n == 0:
                continue
            proposal = tokens[end + 1 : end + 1 + min(limit, self.num_speculative_tokens)]
            num_drafts[i] = proposal.size
            drafts.append(proposal)
        flat = np.concatenate(drafts) if drafts else np.zeros(0, dtype=np.int32)
        return flat.astype(np.int32, copy=False), num_drafts

    def _synced(self, row: int) -> np.ndarray:
        """The row's tokens as an array, extended with those appended since the last call."""
        seq, have = self._seqs[row], self._count[row]
        num = seq.num_tokens
        if num > have:
            buf = self._tokens[row]
            if num > buf.size:
                grown = np.zeros(2 * num, dtype=np.int32)
                grown[:have] = buf[:have]
                buf = self._tokens[row] = grown
            buf[have:num] = seq.token_ids[have:num]
            self._count[row] = num
        return self._tokens[row][:num]
