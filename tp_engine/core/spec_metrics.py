"""Speculative-decoding counters since start, named as vLLM's Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodeStats:
    # vllm:spec_decode_num_drafts: verify entries that carried at least one draft.
    num_drafts: int = 0
    # vllm:spec_decode_num_draft_tokens / vllm:spec_decode_num_accepted_tokens.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # vllm:spec_decode_num_accepted_tokens_per_pos{position=j}: drafts accepted at position j.
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: np.ndarray, num_appended: np.ndarray, k: int) -> None:
        """One step's sampled entries: the drafts each verified and the tokens it gave its
        sequence (`UpdateResult.num_appended`). As vLLM counts, an entry whose sequence no
        longer ran when the step was applied counts for nothing, and an accepted draft is one
        that became an output token: appended - 1 of them (a draft accepted after a stop in
        the same run was never output)."""
        counted = (num_drafts > 0) & (num_appended > 0)
        if not np.count_nonzero(counted):
            return
        num_drafts = num_drafts[counted]
        num_accepted = num_appended[counted] - 1
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        self.num_drafts += int(num_drafts.size)
        self.num_draft_tokens += int(num_drafts.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        # Entry with a accepted drafts accepted positions 0 .. a-1.
        counts = np.bincount(num_accepted, minlength=k + 1)
        at_least = np.cumsum(counts[::-1])[::-1]  # [k+1] entries accepting >= j drafts
        for j in range(k):
            self.accepted_per_pos[j] += int(at_least[j + 1])

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify entry (1 + accepted drafts), vLLM's figure."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts
