"""Logits processors: every per-row change of the logits before sampling, one interface.

A processor keeps its own state for the rows of the running batch that ask for it, and nothing
for the others. The sampling builder forwards it the batch's row events (a sequence takes a
row: `add_row`; gives it back: `remove_row`), so a processor decides once, when a sequence
starts running, whether that row asks; each step it says which of the step's rows ask
(`asking`: the sampler copies those rows alone, as float32, and edits the copy) and makes their
edit (`edit`, addressed to the copy's rows), from its state and, where it depends on them, its
sequences' tokens so far (read on the host for its rows only: bad words, min_tokens, the
thinking budget; penalties read only the tokens new since their last step). A processor with no rows costs a truth test per step; the edits' tensors
cover their own rows only (`tp_engine.core.sampling.edits`).

Order, as vLLM's sampler (allowed_token_ids, bad_words, then the processors that can move the
argmax: min_tokens, logit_bias; then penalties), with structured-output masks and the forced
end of thinking after them:

    AllowedTokens  BadWords  MinTokens  LogitBias  Penalties  GrammarMasks  ThinkingBudget

The masks set tokens to -inf, which biases and penalties leave at -inf, so where a mask sits
among them changes no result; the forced token overrides everything and so comes last.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tp_engine.common.thinking import forced_think_end, thinking_over
from tp_engine.common.transfers import to_device_async
from tp_engine.core.sampling.edits import (
    AddBias,
    AllowOnly,
    BanTokens,
    ForceTokens,
    LogitsEdit,
    MaskByGrammar,
    Penalize,
)
from tp_engine.core.sampling.tensors import GrammarMask, PenaltyTensors
from tp_engine.core.sequence import Sequence
from tp_engine.features.structured.grammar import Phase, fill_bitmasks


class Tensors:
    """Host arrays to tensors on the sampling device, without a pageable copy (one would wait
    for the forward pass that rank 0 overlaps with)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    def ints(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return self.put(torch.as_tensor(np.asarray(values, dtype=np.int64)))

    def floats(self, values: list[float] | np.ndarray) -> torch.Tensor:
        return self.put(torch.as_tensor(np.asarray(values, dtype=np.float32)))

    def put_array(self, values: np.ndarray) -> torch.Tensor:
        return self.put(torch.from_numpy(np.ascontiguousarray(values)))

    def put(self, host: torch.Tensor) -> torch.Tensor:
        return to_device_async(host, self.device)


class LogitsProcessor(ABC):
    """Per-row state of one kind of logits change (see the module docstring)."""

    # Whether a row's edit depends on its output tokens so far: then a speculative verify
    # entry's later positions need the drafts before them, which only a processor that takes
    # `DraftsAhead` in `edit` can do; the others' rows are not drafted (`blocks_drafts`).
    reads_output = True

    def __init__(self, tensors: Tensors) -> None:
        self.t = tensors
        self.vocab_size = tensors.vocab_size
        # Batch row -> this processor's state for the sequence in it (rows that ask only), and
        # the same as a mask over rows for the step's gather.
        self.state: dict[int, Any] = {}
        self._asks = np.zeros(0, dtype=bool)

    def reset(self, max_rows: int) -> None:
        self.state.clear()
        self._asks = np.zeros(max_rows, dtype=bool)

    def add_row(self, row: int, seq: Sequence) -> None:
        state = self.state_for(seq)
        if state is not None:
            self.state[row] = state
            self._asks[row] = True

    def remove_row(self, row: int) -> None:
        if self.state.pop(row, None) is not None:
            self._asks[row] = False

    def asks(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` have state here."""
        return self._asks[rows] if self.state else np.zeros(rows.size, dtype=bool)

    def blocks_drafts(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` this processor keeps from being drafted."""
        if not self.reads_output:
            return np.zeros(rows.size, dtype=bool)
        return self.asks(rows)

    def asking(self, rows: np.ndarray, live: np.ndarray) -> np.ndarray | None:
        """The positions among this step's sampled rows (the batch rows `rows`) that ask for
        this processor; None when none does. `live` False: the row's sequence stopped running
        since; nothing is applied to it."""
        if not self.state:
            return None
        positions = np.flatnonzero(self._asks[rows] & live)
        return positions if positions.size else None

    def edit(
        self,
        rows: np.ndarray,
        positions: np.ndarray,
        edited_index: np.ndarray,
        num_edited: int,
        ahead: DraftsAhead | None = None,
    ) -> LogitsEdit | None:
        """The edit of `positions` (from `asking`), addressed to the edited copy of the step's
        logits: position i is its row `edited_index[i]` of `num_edited`. `ahead`: the drafts
        before each sampled row of a speculative verify entry (only processors that read the
        output look at it; their rows are not drafted otherwise)."""
        states = [self.state[row] for row in rows[positions].tolist()]
        return self.make_edit(edited_index[positions], states, num_edited)

    @abstractmethod
    def state_for(self, seq: Sequence) -> Any | None:
        """This processor's state for `seq`, now taking a row; None if it does not ask."""

    @abstractmethod
    def make_edit(
        self, positions: np.ndarray, states: list[Any], num_rows: int
    ) -> LogitsEdit | None:
        """The edit for rows `positions` (of the edited copy's `num_rows`) with `states`."""

    def _ban(
        self, positions: Iterable[int], token_lists: Iterable[Iterable[int]]
    ) -> LogitsEdit | None:
        rows: list[int] = []
        ids: list[int] = []
        for pos, tokens in zip(positions, token_lists, strict=True):
            tokens = list(tokens)
            rows += [pos] * len(tokens)
            ids += tokens
        if not rows:
            return None
        return BanTokens(self.t.ints(rows), self.t.ints(ids))


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


@dataclass(frozen=True)
class DraftsAhead:
    """A step's sampled rows that verify drafts: row i samples `ahead[i]` positions past its
    sequence's next one, after the drafts `drafts[i][:ahead[i]]` (its entry's)."""

    ahead: np.ndarray
    drafts: list[np.ndarray | None]

    def before(self, i: int) -> list[int]:
        j = int(self.ahead[i])
        drafts = self.drafts[i]
        return [] if j == 0 or drafts is None else drafts[:j].tolist()


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
            (int(pos), seq.grammar)
            for pos, seq in zip(positions, states, strict=True)
            if seq.grammar.masks_next
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


def builtin_processors(tensors: Tensors, eos_token_ids: Iterable[int]) -> list[LogitsProcessor]:
    """The engine's processors, in the order they apply (see the module docstring)."""
    return [
        AllowedTokens(tensors),
        BadWords(tensors),
        MinTokens(tensors, eos_token_ids),
        LogitBias(tensors),
        Penalties(tensors),
        GrammarMasks(tensors),
        ThinkingBudget(tensors),
    ]
