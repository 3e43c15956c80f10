"""The processors that read a request's token rules from its sampling params: `allowed_token_ids`
(`AllowedTokens`), `bad_words` (`BadWords`), `min_tokens` (`MinTokens`: EOS and stop ids
banned until then) and `logit_bias` (`LogitBias`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from tp_engine.core.sampling.edits import AddBias, AllowOnly, LogitsEdit
from tp_engine.core.sampling.processors.base import LogitsProcessor, Tensors
from tp_engine.core.sequence import Sequence


class AllowedTokens(LogitsProcessor):
    """`allowed_token_ids`: every other token is -inf. State: the allowed ids."""

    reads_output = False

    def state_for(self, seq: Sequence) -> np.ndarray | None:
        allowed = seq.sampling_params.allowed_token_ids
        if allowed is None:
            return None
        return np.unique(np.asarray(allowed, dtype=np.int64))

    def make_edit(
        self, positions: np.ndarray, states: list[np.ndarray], num_rows: int
    ) -> LogitsEdit:
        row_of = np.repeat(np.arange(len(states)), [ids.size for ids in states])
        return AllowOnly(
            self.t.ints(positions), self.t.ints(row_of), self.t.ints(np.concatenate(states))
        )


class BadWords(LogitsProcessor):
    """`bad_words`: a word's last token is banned when the output ends with the tokens before it
    (vLLM's rule, on output tokens); single-token words always. State: the sequence, its
    single-token words and its longer ones as (prefix, last token)."""

    def state_for(self, seq: Sequence) -> tuple | None:
        sequences = seq.sampling_params.bad_words_token_ids
        if not sequences:
            return None
        singles = sorted({ids[0] for ids in sequences if len(ids) == 1})
        longer = [(list(ids[:-1]), ids[-1]) for ids in sequences if len(ids) > 1]
        return seq, singles, longer

    def make_edit(
        self, positions: np.ndarray, states: list[tuple], num_rows: int
    ) -> LogitsEdit | None:
        banned = []
        for seq, singles, longer in states:
            tokens = set(singles)
            num_output = seq.num_output_tokens
            for prefix, last in longer:
                if (
                    len(prefix) <= num_output
                    and seq.token_ids[len(seq.token_ids) - len(prefix) :] == prefix
                ):
                    tokens.add(last)
            banned.append(sorted(tokens))
        return self._ban(positions.tolist(), banned)


class MinTokens(LogitsProcessor):
    """EOS (unless ignore_eos) and stop token ids of rows below min_tokens, as vLLM's min-tokens
    processor: the sample about to be drawn would be output token `num_output_tokens + 1`, which
    may stop the sequence only past min_tokens. State: the sequence and its banned ids."""

    def __init__(self, tensors: Tensors, eos_token_ids: Iterable[int]) -> None:
        super().__init__(tensors)
        self.eos_token_ids = sorted(eos_token_ids)

    def state_for(self, seq: Sequence) -> tuple | None:
        p = seq.sampling_params
        if p.min_tokens == 0 or seq.num_output_tokens >= p.min_tokens:
            return None
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(self.eos_token_ids)
        banned_ids = sorted(t for t in banned if t < self.vocab_size)
        return (seq, banned_ids) if banned_ids else None

    def blocks_drafts(self, rows: np.ndarray) -> np.ndarray:
        """Rows still below min_tokens (their verified positions would need the ban to end
        part-way). A row past it leaves this processor: nothing of it is banned again, so it
        is drafted from then on."""
        blocked = self.asks(rows)
        for i in np.flatnonzero(blocked).tolist():
            row = int(rows[i])
            seq, _ = self.state[row]
            if seq.num_output_tokens >= seq.sampling_params.min_tokens:
                self.remove_row(row)
                blocked[i] = False
        return blocked

    def make_edit(
        self, positions: np.ndarray, states: list[tuple], num_rows: int
    ) -> LogitsEdit | None:
        return self._ban(
            positions.tolist(),
            (
                ids if seq.num_output_tokens < seq.sampling_params.min_tokens else ()
                for seq, ids in states
            ),
        )


class LogitBias(LogitsProcessor):
    """`logit_bias`: added to the raw logits. State: the ids and their biases."""

    reads_output = False

    def state_for(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
        bias = seq.sampling_params.logit_bias
        if not bias:
            return None
        return np.fromiter(bias, dtype=np.int64), np.fromiter(bias.values(), dtype=np.float32)

    def make_edit(self, positions: np.ndarray, states: list[tuple], num_rows: int) -> LogitsEdit:
        rows = np.repeat(positions, [ids.size for ids, _ in states])
        ids = np.concatenate([ids for ids, _ in states])
        bias = np.concatenate([values for _, values in states])
        return AddBias(self.t.ints(rows), self.t.ints(ids), self.t.floats(bias))
