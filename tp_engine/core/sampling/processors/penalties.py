"""Repetition, frequency and presence penalties (`Penalties`) and the per-row token counts on
the sampling device they keep (`TokenCounts`); `tp_engine.core.sampling.penalties` applies the
tensors they make.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tp_engine.core.sampling.edits import LogitsEdit, Penalize
from tp_engine.core.sampling.processors.base import LogitsProcessor, Tensors
from tp_engine.core.sampling.tensors import PenaltyTensors
from tp_engine.core.sequence import Sequence


@dataclass(slots=True)
class _PenaltyRow:
    """A penalised row: its sequence, its slot in `TokenCounts`, and how many of its output
    tokens the slot has counted."""

    seq: Sequence
    slot: int
    counted: int = 0


class TokenCounts:
    """Per-slot token counts on the sampling device, `[slots, V]`: each penalised row's output
    tokens (int32) and whether each token is in its prompt (bool, for repetition penalties).
    A slot is filled once when its sequence takes a row, then each step adds only the tokens
    appended since, so no tensor is rebuilt from a token list. Slots are reused; the tensors
    grow by doubling when more rows ask at once than ever before."""

    def __init__(self, tensors: Tensors) -> None:
        self.t = tensors
        self.output = torch.zeros((0, tensors.vocab_size), dtype=torch.int32, device=tensors.device)
        self.prompt_seen = torch.zeros(
            (0, tensors.vocab_size), dtype=torch.bool, device=tensors.device
        )
        self.free: list[int] = []

    def take(self) -> int:
        if not self.free:
            old = self.output.shape[0]
            new = max(4, 2 * old)
            self.output = _grown(self.output, new)
            self.prompt_seen = _grown(self.prompt_seen, new)
            self.free = list(range(new - 1, old - 1, -1))
        slot = self.free.pop()
        self.output[slot].zero_()
        self.prompt_seen[slot].zero_()
        return slot

    def give_back(self, slot: int) -> None:
        self.free.append(slot)

    def set_prompt(self, slot: int, prompt_ids: list[int]) -> None:
        if prompt_ids:
            self.prompt_seen[slot, self.t.ints(prompt_ids)] = True

    def add(self, slots: list[int], token_ids: list[int]) -> None:
        """Count token `token_ids[i]` once more in slot `slots[i]` (one scatter for the step)."""
        if token_ids:
            ones = torch.ones(len(token_ids), dtype=torch.int32, device=self.output.device)
            self.output.index_put_((self.t.ints(slots), self.t.ints(token_ids)), ones, True)


def _grown(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, t.shape[1]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


class Penalties(LogitsProcessor):
    """Repetition, frequency and presence penalties over the tokens so far. State: the row's
    `_PenaltyRow`; its counts live in `TokenCounts` and follow the sequence's new tokens."""

    def __init__(self, tensors: Tensors) -> None:
        super().__init__(tensors)
        self.counts = TokenCounts(tensors)

    def reset(self, max_rows: int) -> None:
        for state in self.state.values():
            self.counts.give_back(state.slot)
        super().reset(max_rows)

    def remove_row(self, row: int) -> None:
        state = self.state.get(row)
        if state is not None:
            self.counts.give_back(state.slot)
        super().remove_row(row)

    def state_for(self, seq: Sequence) -> _PenaltyRow | None:
        p = seq.sampling_params
        if p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0:
            return None
        state = _PenaltyRow(seq, self.counts.take())
        if p.repetition_penalty != 1.0:
            self.counts.set_prompt(state.slot, seq.prompt_token_ids)
        return state

    def make_edit(
        self, positions: np.ndarray, states: list[_PenaltyRow], num_rows: int
    ) -> LogitsEdit:
        slots: list[int] = []
        new_tokens: list[int] = []
        for state in states:
            seq = state.seq
            if seq.num_output_tokens < state.counted:  # tokens taken back: count afresh
                self.counts.output[state.slot].zero_()
                state.counted = 0
            fresh = seq.token_ids[seq.num_prompt_tokens + state.counted :]
            slots += [state.slot] * len(fresh)
            new_tokens += fresh
            state.counted += len(fresh)
        self.counts.add(slots, new_tokens)
        params = [state.seq.sampling_params for state in states]
        row_slots = self.t.ints([state.slot for state in states])
        prompt_seen = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_seen = self.counts.prompt_seen[row_slots]
        return Penalize(
            PenaltyTensors(
                rows=self.t.ints(positions),
                output_counts=self.counts.output[row_slots],
                prompt_seen=prompt_seen,
                presence=self.t.floats([p.presence_penalty for p in params]),
                frequency=self.t.floats([p.frequency_penalty for p in params]),
                repetition=self.t.floats([p.repetition_penalty for p in params]),
            )
        )
