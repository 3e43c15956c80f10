"""The processors driven by a state over the output: a structured-output grammar's token mask
(`GrammarMasks`, from the sequence's matcher) and a spent thinking budget's forced `</think>`
(`ThinkingBudget`, from where the output stands in its think block).
"""

from __future__ import annotations

import numpy as np
import torch

from tp_engine.common.thinking import forced_think_end, thinking_over
from tp_engine.core.sampling.edits import ForceTokens, LogitsEdit, MaskByGrammar
from tp_engine.core.sampling.processors.base import DraftsAhead, LogitsProcessor
from tp_engine.core.sampling.tensors import GrammarMask
from tp_engine.core.sequence import Sequence
from tp_engine.features.structured.grammar import Phase, fill_bitmasks


class GrammarMasks(LogitsProcessor):
    """Structured outputs: the token bitmask of the rows whose constraint masks their next
    token, filled by their matchers (which have followed every token applied so far). State:
    the sequence (its matcher is `seq.grammar`).

    A verify entry's positions are masked as each would be had the drafts before it been
    sampled: the matcher follows the drafts, fills each position's mask, and is rolled back.
    A draft the grammar refuses cannot be accepted (the mask before it excludes it), so the
    positions after it keep the last mask. Only rows in the constrained phase are drafted
    (thinking boundaries are not followed back)."""

    def state_for(self, seq: Sequence) -> Sequence | None:
        return seq if seq.grammar is not None else None

    def blocks_drafts(self, rows: np.ndarray) -> np.ndarray:
        blocked = np.zeros(rows.size, dtype=bool)
        for i in np.flatnonzero(self.asks(rows)).tolist():
            grammar = self.state[int(rows[i])].grammar
            blocked[i] = grammar.phase is not Phase.CONSTRAINED
        return blocked

    def edit(
        self,
        rows: np.ndarray,
        positions: np.ndarray,
        edited_index: np.ndarray,
        num_edited: int,
        ahead: DraftsAhead | None = None,
    ) -> LogitsEdit | None:
        if ahead is None or not np.count_nonzero(ahead.ahead[positions]):
            return super().edit(rows, positions, edited_index, num_edited)
        # A verify entry's first position as any row's; its later ones after the drafts.
        later = ahead.ahead[positions] > 0
        first = positions[~later]
        bitmask, filled = self._fill(
            edited_index[first], [self.state[row] for row in rows[first].tolist()], num_edited
        )
        for pos in positions[later].tolist():
            seq = self.state[int(rows[pos])]
            out = int(edited_index[pos])
            grammar = seq.grammar
            if grammar.advance(seq.token_ids + ahead.before(pos), seq.num_prompt_tokens):
                grammar.fill(bitmask, out)
            else:  # after a draft the grammar refuses: never emitted, any mask will do
                bitmask[out] = -1
            grammar.advance(seq.token_ids, seq.num_prompt_tokens)  # back to the output
            filled.append(out)
        return MaskByGrammar(GrammarMask(self.t.put(bitmask), tuple(filled)))

    def make_edit(
        self, positions: np.ndarray, states: list[Sequence], num_rows: int
    ) -> LogitsEdit | None:
        bitmask, rows = self._fill(positions, states, num_rows)
        if not rows:
            return None
        return MaskByGrammar(GrammarMask(self.t.put(bitmask), tuple(rows)))

    def _fill(
        self, positions: np.ndarray, states: list[Sequence], num_rows: int
    ) -> tuple[torch.Tensor, list[int]]:
        """The host bitmask of rows `positions` (of `num_rows`) whose matcher masks the next
        token, and those rows."""
        chosen = [
            (int(pos), grammar)
            for pos, seq in zip(positions, states, strict=True)
            if (grammar := seq.grammar) is not None and grammar.masks_next
        ]
        # Rows of the whole step, so the mask's row i is logits row i; only `chosen` are filled.
        bitmask = torch.empty((num_rows, (self.vocab_size + 31) // 32), dtype=torch.int32)
        rows = [pos for pos, _ in chosen]
        if chosen:
            fill_bitmasks([g for _, g in chosen], bitmask, rows)
        return bitmask, rows


class ThinkingBudget(LogitsProcessor):
    """Rows whose thinking budget is spent: their next token is `</think>`. State: the
    sequence."""

    def state_for(self, seq: Sequence) -> Sequence | None:
        p = seq.sampling_params
        return (
            seq
            if p.thinking_token_budget is not None and p.think_end_token_id is not None
            else None
        )

    def blocks_drafts(self, rows: np.ndarray) -> np.ndarray:
        """Rows whose thinking is not over (a verified position could be the one the budget
        forces). A row whose output closed its thinking block leaves this processor: nothing
        is forced on it again, so it is drafted from then on."""
        blocked = self.asks(rows)
        for i in np.flatnonzero(blocked).tolist():
            row = int(rows[i])
            seq = self.state[row]
            if thinking_over(seq.output_token_ids, seq.sampling_params):
                self.remove_row(row)
                blocked[i] = False
        return blocked

    def make_edit(
        self, positions: np.ndarray, states: list[Sequence], num_rows: int
    ) -> LogitsEdit | None:
        forced = {
            int(pos): token
            for pos, seq in zip(positions, states, strict=True)
            if (token := forced_think_end(seq.output_token_ids, seq.sampling_params)) is not None
        }
        if not forced:
            return None
        return ForceTokens(self.t.ints(list(forced)), self.t.ints(list(forced.values())))
