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

    def record(self, num_drafts: np.ndarray, num_accepted: np.ndarray, k: int) -> None:
        """One step's verify entries: drafts proposed and accepted, per entry."""
        drafted = num_drafts > 0
        if not np.count_nonzero(drafted):
            return
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        self.num_drafts += int(np.count_nonzero(drafted))
        self.num_draft_tokens += int(num_drafts.sum())
        self.num_accepted_tokens += int(num_accepted.sum())
        # Entry with a accepted drafts accepted positions 0 .. a-1.
        counts = np.bincount(num_accepted[drafted], minlength=k + 1)
        at_least = np.cumsum(counts[::-1])[::-1]  # [k+1] entries accepting >= j drafts
        for j in range(k):
            self.accepted_per_pos[j] += int(at_least[j + 1])

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify entry (1 + accepted drafts), vLLM's figure."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts
