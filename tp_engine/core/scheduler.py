"""Continuous batching on rank 0: which sequences run this step and how many tokens each gets.

Each `schedule()` fills a token budget (`max_num_batched_tokens`) under a sequence cap
(`max_num_seqs`), in this order:

1. running sequences that decode (one token each),
2. running sequences whose prompt is being prefilled in chunks,
3. waiting sequences, first come first served; the last one admitted is cut to the budget
   (chunked prefill) or waits for a later step (chunked prefill off).

When a running sequence cannot get a block, the most recently admitted running sequence that is
not already part of this step is preempted (its blocks are freed and it is recomputed later,
usually from the prefix cache); if that is the sequence itself, it steps aside. Nothing is
admitted in a step that preempted, since the pool is evidently tight. A request that could never
fit is refused by `add`, so every admitted sequence can always make progress: no livelock.
Speculative drafts are optional work: they get blocks only once every scheduled sequence's own
tokens have theirs, and only free ones (cut to fit), so a draft never preempts anyone.

`update()` takes the sampled token of every sequence that finished its uncomputed tokens this
step, advances the token accounting, registers newly full blocks in the prefix cache and
finishes sequences on EOS, a stop token id, max_tokens or max_model_len. A prompt-only sequence
(max_tokens 0) never samples: it finishes ("length") once its prompt is computed. `discard()`
undoes a scheduled step whose tokens will never be applied (an exception between the two).

Running sequences live in a `RunningBatch` (one row each), so the common case, every running
sequence decoding, is numpy over the rows: which rows decode, which need a new block (one in
`block_size` steps: Python for those alone), their placeholders, and in `update` their new
tokens and the stop checks. Per-sequence Python runs for the rare events: admission, prefill
chunks, a new block, preemption, finishing, stop token ids, prompt logprobs.

Asynchronous scheduling calls `schedule()` for step t+1 before `update()` of step t: a sequence
sampled in step t then decodes a placeholder (its token is read on the device from step t's
sampled rows). A sequence whose placeholder is sure to be its last token (max_tokens,
max_model_len) is not scheduled again; one that stops on EOS or a stop token has its extra row
discarded by the next `update()`. Since every rank runs the steps in order, a block freed while
a step still writes to it is only reused by later steps. A row is recognised by the serial of
the sequence it held when the step was scheduled, so a row given to another sequence meanwhile
is never mistaken for the old one.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from shm_ipc.step_plan import batch_rows
from tp_engine.config import EngineConfig
from tp_engine.core.engine_states import Gate
from tp_engine.core.kv.block_manager import BlockManager
from tp_engine.core.running_batch import RunningBatch, TableChanges
from tp_engine.core.sequence import Sequence, SequenceStatus


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class DraftProposer(Protocol):
    """Guesses the next tokens of decoding sequences (speculative decoding)."""

    num_speculative_tokens: int
    # False: `propose` runs before the verify entries' blocks are allocated and may give a row
    # fewer drafts than asked (n-gram lookup). True: it runs once they are allocated and gives
    # exactly the drafts asked (a draft model, which writes its own K/V at those positions).
    drafts_after_allocation: bool

    def eligible(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` may be drafted at all."""
        ...

    def propose(self, rows: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for batch `rows` (at most `max_drafts[i]` for row i): the draft tokens of
        every row, row after row, and how many each row has."""
        ...


class RequestRejectedError(ValueError):
    """A request that can never be served as asked; the message says why."""


@dataclass(frozen=True, eq=False)
class ScheduledStep:
    """One step's batch as the scheduler planned it. Arrays are parallel, in batch order: the
    `num_single` single-token entries of the vectorised path first (running decodes, admission
    order), then the entries planned one by one (prefill chunks, admissions)."""

    # [B] intp: each entry's RunningBatch row, and [B] int64 the serial of the sequence that
    # held it when scheduled (`update` ignores rows that changed hands since).
    rows: np.ndarray
    serials: np.ndarray
    # [B] int32: new tokens computed this step, and the position of the first of them.
    num_scheduled: np.ndarray
    starts: np.ndarray
    # [B] bool: this step computes the entry's last uncomputed token, so its logits are sampled.
    samples: np.ndarray
    # [B] bool: the entry's input is the sample of the step in flight (asynchronous
    # scheduling), at [B] int32 `placeholder_rows` among that step's sampled rows.
    reads_placeholder: np.ndarray
    placeholder_rows: np.ndarray
    # [num_single] int32: the known input token of each single-token entry (where it is not a
    # placeholder); then the known input tokens of every other entry, one list each.
    single_inputs: np.ndarray
    chunk_inputs: list[list[int]]
    # Sequences this step sent back to the waiting queue.
    preempted: list[Sequence]
    # Entries that decode (one token after their prompt), for throughput figures.
    num_decodes: int
    # What changed in the block tables since the last step (for the workers' mirrors).
    table_changes: TableChanges
    # `RunningBatch.num_removals` when the step was scheduled: while it is unchanged, no row
    # has changed hands and `update` need not compare serials (None: compare them).
    num_removals: int | None = None
    # Speculative decoding: [B] int32 the drafted tokens each entry verifies (0 for all but
    # verify entries, whose inputs are [last token, drafts...]), and the drafts, entry after
    # entry. A verify entry is sampled at every one of its positions. None: no drafts.
    num_drafts: np.ndarray | None = None
    draft_tokens: np.ndarray | None = None

    @property
    def num_entries(self) -> int:
        return int(self.rows.size)

    @property
    def num_single(self) -> int:
        return int(self.single_inputs.size)

    @property
    def num_samples(self) -> int:
        """Entries that sample (each emits at least one token when applied)."""
        return int(np.count_nonzero(self.samples))

    @property
    def sampled_drafts(self) -> np.ndarray | None:
        """[S] the drafts of each sampled entry (None: no drafts in this step)."""
        if self.num_drafts is None:
            return None
        return self.num_drafts[self.samples]

    @property
    def num_sampled_rows(self) -> int:
        """Logits rows sampled: one per sampled entry, plus one per draft it verifies."""
        extra = 0 if self.num_drafts is None else int(self.num_drafts.sum())
        return self.num_samples + extra

    @property
    def num_batched_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    @property
    def is_empty(self) -> bool:
        return self.rows.size == 0


@dataclass
class _Entries:
    """The one-by-one entries of a step being planned (converted to arrays at the end)."""

    rows: list[int] = field(default_factory=list)
    serials: list[int] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    reads_placeholder: list[bool] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    draft_tokens: list[np.ndarray] = field(default_factory=list)
    num_decodes: int = 0


@dataclass(frozen=True)
class _Verify:
    """A verify entry being planned: its sequence, the drafts it gets (so far) and the drafts
    themselves (None until a proposer that drafts after allocation has made them)."""

    seq: Sequence
    num_drafts: int
    drafts: np.ndarray | None


@dataclass(frozen=True)
class UpdateResult:
    """What applying a step did."""

    # Sequences that received a token, in sampled-row order (finished ones included).
    sampled: list[Sequence]
    # Sequences that finished in this update (sampled ones and prompt-only ones).
    finished: list[Sequence]
    # [S] int32: tokens appended for each of the step's sampled entries, in sampled order: 0
    # where its sequence stopped running before the step was applied, fewer than it emitted
    # where a token of a speculative run stopped it (what the counters of output count).
    num_appended: np.ndarray


class Scheduler:
    """Owns the waiting queue and the running batch; drives the BlockManager."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
        proposer: DraftProposer | None = None,
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._eos_ids = sorted(self.eos_token_ids)
        self.batch = RunningBatch(
            batch_rows(config.max_num_seqs),
            math.ceil(config.max_model_len / block_manager.block_size),
            config.max_model_len,
        )
        self.waiting: deque[Sequence] = deque()
        self._seqs: dict[str, Sequence] = {}
        # Read-only ones and zeros that a decode step's arrays are slices of (an np.ones call
        # costs a microsecond or so, a slice a fifth of that).
        self._ones = _read_only(np.ones(self.batch.max_rows, dtype=np.int32))
        self._zeros = _read_only(np.zeros(self.batch.max_rows, dtype=np.int32))
        # Preemptions since start (vLLM's num_preemptions_total).
        self.num_preemptions = 0
        # Speculative decoding: drafts for the decoding sequences, verified in the step.
        self.proposer = proposer
        # What the engine's state allows (paused: no admissions; paused "keep": no steps).
        self.gate = Gate()

    # -- requests --------------------------------------------------------------------------------

    @property
    def running(self) -> list[Sequence]:
        """Running sequences in admission order."""
        seqs = self.batch.seqs
        return [seqs[row] for row in self.batch.order.tolist()]  # type: ignore[misc]

    def check_integrity(self) -> None:
        """The block manager's invariants, with the running sequences' tables and counters
        (AssertionError if one is broken; for tests)."""
        self.block_manager.check_integrity(
            self.running, self.batch.num_computed[self.batch.order].tolist()
        )

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or len(self.batch) > 0

    def get(self, seq_id: str) -> Sequence | None:
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, or raise RequestRejectedError if it could never be served."""
        self.check_fits(seq)
        if seq.seq_id in self._seqs:
            raise RequestRejectedError(f"sequence id {seq.seq_id!r} is already in use")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq

    def abort(self, seq_id: str) -> Sequence | None:
        """End a sequence in any state and free its blocks; None if it is unknown or finished."""
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> Sequence | None:
        """End a request from outside the step loop (an abort, or a stop string the caller saw);
        None if it is unknown or finished already."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self._retire(seq)
        seq.status = status
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        return seq

    def check_fits(self, seq: Sequence) -> None:
        """Raise RequestRejectedError if `seq` could never be served (too long for the model
        or the whole KV cache)."""
        max_tokens = seq.sampling_params.max_tokens
        prompt_len = seq.num_prompt_tokens
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise RequestRejectedError(
                    f"this model's maximum context length is {self.max_model_len} tokens, and the "
                    f"prompt has {prompt_len} tokens, leaving no room to generate"
                )
            total = self.max_model_len
        else:
            total = prompt_len + max_tokens
            if total > self.max_model_len:
                raise RequestRejectedError(
                    f"this model's maximum context length is {self.max_model_len} tokens, but "
                    f"{total} were requested ({prompt_len} in the prompt and {max_tokens} for the "
                    "completion); shorten the prompt or lower max_tokens"
                )
        # The last sampled token is never fed back, so it needs no KV slot; a prompt-only
        # request computes its whole prompt and samples nothing.
        blocks = self.block_manager.blocks_needed(max(total - 1, prompt_len))
        if blocks > self.block_manager.num_blocks:
            raise RequestRejectedError(
                f"the request needs up to {total} tokens = {blocks} KV blocks of "
                f"{self.block_manager.block_size} tokens, but the whole KV cache has "
                f"{self.block_manager.num_blocks} blocks"
            )

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        """Pick this step's batch. An empty step is a normal result (nothing to do, or waiting
        requests that do not fit yet)."""
        b = self.batch
        # Running rows, admission order (intp); none while the engine holds them (paused "keep").
        rows = b.order if self.gate.stepping else b.order[:0]
        placeholders = b.num_placeholders[rows]
        num_known = b.num_tokens[rows]  # tokens known (prompt + sampled), per running row
        start = b.num_computed[rows] + b.num_inflight[rows]  # where each one's next token is
        # Tokens to compute before each one's next sample, counting in-flight steps (their
        # tokens as scheduled, their samples as tokens).
        unc = num_known + placeholders - start
        # A prompt-only sequence whose last chunk is in flight, or (asynchronous scheduling)
        # one whose in-flight sample is sure to be its last (max_tokens, max_model_len), ends
        # when that step is applied.
        ending = unc == 0
        if np.count_nonzero(placeholders):
            ending |= (placeholders > 0) & (num_known + placeholders >= b.length_end[rows])
        # One-by-one: prefills, and sequences still collecting prompt logprobs (their rows,
        # looked at only when some row asks for them).
        one_by_one = unc > 1
        if b.num_wanting_prompt_logprobs:
            one_by_one |= b.wants_prompt_logprobs[rows] & (
                b.num_computed[rows] < b.prompt_len[rows]
            )
        num_ending = int(np.count_nonzero(ending))
        if num_ending:
            one_by_one &= ~ending
        # Decodes: one token each, admission order. Usually every running sequence.
        single = rows
        if num_ending or np.count_nonzero(one_by_one):
            is_single = ~(ending | one_by_one)
            single, start, num_known = rows[is_single], start[is_single], num_known[is_single]

        verify = None
        if self.proposer is not None and single.size:
            single, start, num_known, verify = self._propose(single, start, num_known)

        preempted: list[Sequence] = []
        in_step = self._allocate_decode_blocks(single, start, preempted)
        if in_step is not None:
            single, start, num_known = single[in_step], start[in_step], num_known[in_step]
        budget = self.max_num_batched_tokens - single.size
        rows_left = self.max_num_seqs if self.enable_chunked_prefill else None
        entries = _Entries()
        # Verify entries' own tokens and prefill chunks get their blocks first, preempting as
        # any decode would; drafts are optional work and only take blocks left free after that.
        planned: list[_Verify] = []
        if verify is not None:
            budget, planned = self._reserve_verify_entries(verify, single, budget, preempted)
        chunks: list[tuple[Sequence, int]] = []
        for row in rows[one_by_one].tolist():
            seq = b.seqs[row]
            if budget == 0:
                break
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens = min(b.num_uncomputed(row), budget)
            takes_rows = rows_left is not None and seq.needs_prompt_logits
            if takes_rows:
                # Prompt logprobs need a [vocab] logits row per prompt token computed. With
                # chunked prefill a step takes at most max_num_seqs of them (the logits rows
                # the GPU memory profile budgets for), so a long prompt asking for them
                # cannot exhaust memory.
                num_tokens = min(num_tokens, rows_left)
                if num_tokens == 0:
                    continue
            in_step = lambda: (  # noqa: E731
                set(single.tolist()) | {v.seq.row for v in planned} | {s.row for s, _ in chunks}
            )
            if not self._allocate_or_preempt(seq, num_tokens, in_step, preempted):
                continue
            chunks.append((seq, num_tokens))
            budget -= num_tokens
            if takes_rows:
                rows_left -= num_tokens
        if planned:
            # Drafts cut short by the free blocks leave their budget to admissions.
            budget += self._add_verify_entries(entries, planned)
        for seq, num_tokens in chunks:
            self._add_entry(entries, seq, num_tokens)
        if not preempted and self.gate.admitting:
            # Sequences about to end leave their place in the step to new ones already.
            self._admit(entries, budget, self.max_num_seqs + num_ending, rows_left)
        return self._finish_step(single, start, num_known, entries, preempted)

    def _propose(
        self, single: np.ndarray, start: np.ndarray, num_known: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, np.ndarray | None]] | None]:
        """Pick the decodes (rows `single`) that get drafts; they leave the single-token path
        and become verify entries. Returns the remaining decodes' arrays and the verify entries
        as (row, drafts wanted, the drafts or None until allocated), admission order (None:
        no entry)."""
        proposer = self.proposer
        assert proposer is not None
        b = self.batch
        # j drafts can emit j + 1 tokens: stay within the length limit, so a verify entry
        # never writes K/V past what `check_fits` reserved (the last token is never fed back).
        max_drafts = np.minimum(
            b.length_end[single] - num_known - 1, proposer.num_speculative_tokens
        )
        max_drafts[start >= num_known] = 0  # reads a placeholder (not with speculation)
        np.maximum(max_drafts, 0, out=max_drafts)
        candidates = np.flatnonzero(max_drafts)
        if candidates.size:
            candidates = candidates[proposer.eligible(single[candidates])]
        if not candidates.size:
            return single, start, num_known, None
        rows, wanted = single[candidates], max_drafts[candidates]
        drafts: list[np.ndarray | None] = [None] * rows.size
        if not proposer.drafts_after_allocation:
            tokens, wanted = proposer.propose(rows, wanted)
            ends = np.cumsum(wanted).tolist()
            drafts = [tokens[end - n : end] for n, end in zip(wanted.tolist(), ends, strict=True)]
        drafted = wanted > 0
        verify = [
            (row, n, d)
            for row, n, d, ok in zip(
                rows.tolist(), wanted.tolist(), drafts, drafted.tolist(), strict=True
            )
            if ok
        ]
        if not verify:
            return single, start, num_known, None
        keep = np.ones(single.size, dtype=bool)
        keep[candidates[drafted]] = False
        return single[keep], start[keep], num_known[keep], verify

    def _reserve_verify_entries(
        self,
        verify: list[tuple[int, int, np.ndarray | None]],
        single: np.ndarray,
        budget: int,
        preempted: list[Sequence],
    ) -> tuple[int, list[_Verify]]:
        """The token budget and each verify entry's (row, drafts wanted, drafts) own token's
        block, preempting for it as for any decode: fewer drafts when the budget is short.
        Returns the budget left and the entries kept (in order); their drafts get blocks later,
        from what is free (`_add_verify_entries`)."""
        b = self.batch
        # Each entry's own token first; drafts share what is left of the budget, in order.
        spare = budget - len(verify)
        planned: list[_Verify] = []
        for row, wanted, drafts in verify:
            seq = b.seqs[row]
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(wanted, max(0, spare))
            in_step = lambda: set(single.tolist()) | {v.seq.row for v in planned}  # noqa: E731
            if not self._allocate_or_preempt(seq, 1, in_step, preempted):
                spare += 1  # its own token is not used either
                continue
            planned.append(_Verify(seq, n, drafts))
            budget -= 1 + n
            spare -= n
        return budget, planned

    def _add_verify_entries(self, entries: _Entries, planned: list[_Verify]) -> int:
        """Plan the verify entries (own tokens' blocks held already): their drafts cut to the
        positions the blocks they hold and the free blocks can take, in order, so that a draft
        never makes anyone be preempted; then a proposer that drafts after allocation is asked
        for them. Returns the budget of the drafts cut."""
        b, bm, bs = self.batch, self.block_manager, self.block_size
        cut = 0
        ready: list[_Verify] = []
        for v in planned:
            seq, n = v.seq, v.num_drafts
            assert seq.row is not None
            start = b.scheduled_end(seq.row)
            if n:
                # Positions start + 1 .. start + n, after the entry's own token at start.
                room = (len(seq.block_table) + bm.num_free_blocks) * bs - (start + 1)
                fit = max(0, min(n, room))
                if fit:
                    assert bm.allocate_slots(seq, 1 + fit, start=start), "the room was free"
                    b.sync_blocks(seq)
                cut += n - fit
                n = fit
            ready.append(_Verify(seq, n, None if v.drafts is None else v.drafts[:n]))
        late = [v for v in ready if v.drafts is None and v.num_drafts]
        if late:
            assert self.proposer is not None
            rows = np.array([v.seq.row for v in late], dtype=np.intp)
            wanted = np.array([v.num_drafts for v in late], dtype=np.int32)
            tokens, counts = self.proposer.propose(rows, wanted)
            assert np.array_equal(counts, wanted), "a late proposer gives the drafts asked"
            ends = np.cumsum(wanted).tolist()
            made = {
                id(v.seq): tokens[end - v.num_drafts : end]
                for v, end in zip(late, ends, strict=True)
            }
            ready = [_Verify(v.seq, v.num_drafts, made.get(id(v.seq), v.drafts)) for v in ready]
        for v in ready:
            self._add_entry(entries, v.seq, 1 + v.num_drafts, v.drafts if v.num_drafts else None)
        return cut

    def _allocate_decode_blocks(
        self, single: np.ndarray, start: np.ndarray, preempted: list[Sequence]
    ) -> np.ndarray | None:
        """Blocks for the decodes (rows `single`, their tokens at positions `start`) that need
        one: a sequence crossing into a new block. Returns which decodes stay in the step (a
        victim of preemption, or a sequence that stepped aside, does not), None for all."""
        b, bs = self.batch, self.block_size
        # The token at `start` needs block start // bs: a new one iff the row holds no more.
        need = np.flatnonzero(start >= b.num_blocks[single] * bs)
        if need.size == 0:
            return None
        block_ids = self.block_manager.take_blocks(need.size)
        if block_ids is not None:  # the common case: one block each, nobody preempted
            b.append_blocks(single[need], block_ids)
            return None
        keep = np.ones(single.size, dtype=bool)
        for i in need.tolist():  # short of blocks: one by one, preempting as needed
            if not keep[i]:
                continue  # preempted by an earlier decode of this step
            seq = b.seqs[int(single[i])]
            assert seq is not None
            # Decodes before this one are in the step; the rest may be preempted for it.
            victims: list[Sequence] = []
            self._allocate_or_preempt(
                seq, 1, lambda i=i: set(single[:i][keep[:i]].tolist()), victims
            )
            if victims:
                preempted += victims
                # Victims' rows (this sequence's own, if it stepped aside) were freed just now.
                keep[b.serial[single] == 0] = False
        return keep

    def _allocate_or_preempt(
        self,
        seq: Sequence,
        num_tokens: int,
        in_step_rows: Callable[[], set[int]],
        preempted: list[Sequence],
    ) -> bool:
        """Blocks for `num_tokens` more tokens of running `seq`, preempting the most recently
        admitted running sequences outside this step (`in_step_rows()`, asked only when it
        comes to that) until they fit. False if `seq` itself had to step aside."""
        bm = self.block_manager
        in_step: set[int] | None = None
        assert seq.row is not None
        while not bm.allocate_slots(seq, num_tokens, start=self.batch.scheduled_end(seq.row)):
            if in_step is None:
                in_step = in_step_rows()
            victim = self._pick_victim(in_step)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.batch.sync_blocks(seq)
        return True

    def _admit(
        self, entries: _Entries, budget: int, max_running: int, rows_left: int | None
    ) -> None:
        """Admit waiting sequences in order while they fit; `rows_left`: prompt-logprob rows
        this step may still take (None: no limit)."""
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.batch) < max_running:
            seq = self._next_admissible()
            if seq is None:
                break
            cached_prefix = bm.find_cached_prefix(seq)
            num_tokens = seq.num_tokens - len(cached_prefix) * bm.block_size
            if num_tokens > budget:
                if not self.enable_chunked_prefill:
                    break  # first come, first served: nobody overtakes the head of the queue
                num_tokens = budget
            takes_rows = rows_left is not None and seq.needs_prompt_logits
            if takes_rows:
                num_tokens = min(num_tokens, rows_left)
                if num_tokens == 0:
                    break
            if not bm.allocate_slots(seq, num_tokens, cached_prefix):
                break
            if takes_rows:
                rows_left -= num_tokens
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.queue_time_s is None:
                seq.queue_time_s = max(0.0, time.monotonic() - seq.arrival_time)
            self.batch.add(seq)
            self.batch.sync_blocks(seq)
            self._add_entry(entries, seq, num_tokens)
            budget -= num_tokens

    def _next_admissible(self) -> Sequence | None:
        """The first waiting sequence the gate admits (the head, unless the gate holds some
        back: a LoRA request whose adapter has no slot yet waits, as in vLLM, while later
        requests pass it)."""
        admits = self.gate.admits
        if admits is None:
            return self.waiting[0]
        return next(filter(admits, self.waiting), None)

    def _add_entry(
        self, entries: _Entries, seq: Sequence, num_tokens: int, drafts: np.ndarray | None = None
    ) -> None:
        """Plan `num_tokens` of running `seq` in this step (the one-by-one path); a verify entry
        (`drafts`) computes its last token and then its drafts."""
        b, row = self.batch, seq.row
        assert row is not None
        start = b.scheduled_end(row)
        num_drafts = 0 if drafts is None else int(drafts.size)
        num_known = num_tokens - num_drafts
        samples = num_known == b.num_uncomputed(row) and not seq.is_prompt_only
        placeholder = start >= seq.num_tokens  # the sample of the step in flight
        entries.rows.append(row)
        entries.serials.append(seq.serial)
        entries.num_scheduled.append(num_tokens)
        entries.starts.append(start)
        entries.samples.append(samples)
        entries.reads_placeholder.append(placeholder)
        entries.placeholder_rows.append(int(b.sample_row[row]) if placeholder else 0)
        inputs = [] if placeholder else seq.token_ids[start : start + num_known]
        entries.num_drafts.append(num_drafts)
        if num_drafts:
            assert samples and num_known == 1 and not placeholder, seq
            inputs += drafts.tolist()  # type: ignore[union-attr]
            entries.draft_tokens.append(drafts)  # type: ignore[arg-type]
        entries.inputs.append(inputs)
        if placeholder:
            assert num_tokens == 1, seq
        if num_known == 1 and start >= seq.num_prompt_tokens:
            entries.num_decodes += num_tokens
        b.num_inflight[row] += num_tokens

    def _finish_step(
        self,
        single: np.ndarray,
        start: np.ndarray,
        num_known: np.ndarray,
        entries: _Entries,
        preempted: list[Sequence],
    ) -> ScheduledStep:
        """The step's arrays: the single-token entries (rows `single`, with tokens at positions
        `start` of their `num_known` known ones; vectorised) then the others; sample rows are
        numbered in this order, and the rows' in-flight counters advance."""
        b = self.batch
        reads_placeholder = start >= num_known  # [S]
        # With synchronous scheduling (and mostly with asynchronous too) no decode reads one.
        single_inputs = b.last_token[single]  # [S] a copy
        if np.count_nonzero(reads_placeholder):
            placeholder_rows = np.where(reads_placeholder, b.sample_row[single], 0)
            single_inputs[reads_placeholder] = 0
        else:
            placeholder_rows = self._zeros[: single.size]
        samples = ~b.prompt_only[single]
        # Before the one-by-one entries join: their counters advanced as they were planned.
        b.num_inflight[single] += 1
        rows, starts, num_scheduled = single, start, self._ones[: single.size]
        if entries.rows:  # prefill chunks and admissions after the decodes
            rows = np.concatenate([rows, np.asarray(entries.rows, dtype=np.intp)])
            starts = np.concatenate([starts, np.asarray(entries.starts, dtype=np.int32)])
            num_scheduled = np.concatenate(
                [num_scheduled, np.asarray(entries.num_scheduled, dtype=np.int32)]
            )
            samples = np.concatenate([samples, np.asarray(entries.samples, dtype=bool)])
            reads_placeholder = np.concatenate(
                [reads_placeholder, np.asarray(entries.reads_placeholder, dtype=bool)]
            )
            placeholder_rows = np.concatenate(
                [placeholder_rows, np.asarray(entries.placeholder_rows, dtype=np.int32)]
            )
        num_drafts = draft_tokens = None
        if entries.draft_tokens:
            num_drafts = np.concatenate(
                [np.zeros(single.size, dtype=np.int32), np.asarray(entries.num_drafts, np.int32)]
            )
            draft_tokens = np.concatenate(entries.draft_tokens).astype(np.int32, copy=False)
        num_samples = int(np.count_nonzero(samples))
        sampled_rows = rows if num_samples == rows.size else rows[samples]
        b.num_placeholders[sampled_rows] += 1
        b.sample_row[sampled_rows] = np.arange(num_samples, dtype=np.int32)
        decodes = int(np.count_nonzero(start >= b.prompt_len[single]))
        return ScheduledStep(
            rows=rows,
            serials=b.serial[rows],
            num_scheduled=num_scheduled,
            starts=starts.astype(np.int32, copy=False),
            samples=samples,
            reads_placeholder=reads_placeholder,
            placeholder_rows=placeholder_rows.astype(np.int32, copy=False),
            single_inputs=single_inputs,
            chunk_inputs=entries.inputs,
            preempted=preempted,
            num_decodes=decodes + entries.num_decodes,
            # An empty step sends no plan: its changes wait for the next one.
            table_changes=b.take_changes() if rows.size else TableChanges(),
            num_removals=b.num_removals,
            num_drafts=num_drafts,
            draft_tokens=draft_tokens,
        )

    def _pick_victim(self, in_step_rows: set[int]) -> Sequence:
        """The most recently admitted running sequence that this step has not scheduled."""
        for row in reversed(self.batch.order.tolist()):
            if row not in in_step_rows:
                seq = self.batch.seqs[row]
                assert seq is not None
                return seq
        raise AssertionError("unreachable: the sequence asking for blocks is itself a candidate")

    def _preempt(self, seq: Sequence) -> None:
        self._retire(seq)
        seq.status = SequenceStatus.WAITING
        # A step in flight may still compute for it; `update` discards that (the row's serial).
        seq.num_computed_tokens = seq.num_inflight_tokens = seq.num_placeholders = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the front: preempted work resumes before new requests, oldest first.
        self.waiting.appendleft(seq)

    def _retire(self, seq: Sequence) -> None:
        """`seq` stops running: its row and its blocks go back."""
        self.batch.remove(seq)
        self.block_manager.free(seq)

    # -- applying a step ---------------------------------------------------------------------------

    def update(
        self,
        step: ScheduledStep,
        sampled_token_ids: np.ndarray,
        num_emitted: np.ndarray | None = None,
    ) -> UpdateResult:
        """Apply a finished step: the new tokens of each True in `step.samples`, in batch order,
        one each, or (speculative decoding) `num_emitted[i]` for sampled entry i, entry after
        entry. A verify entry that emits a tokens accepted a - 1 of its drafts: its other
        drafts are rolled back here (their K/V is not counted as computed, and blocks holding
        nothing but rejected positions go back to the pool)."""
        tokens = np.asarray(sampled_token_ids, dtype=np.int64)
        num_samples = step.num_samples
        if num_emitted is None:
            if tokens.shape != (num_samples,):
                raise ValueError(f"expected {num_samples} sampled tokens, got {tokens.shape[0]}")
        else:
            num_emitted = np.asarray(num_emitted, dtype=np.int32)
            if num_emitted.shape != (num_samples,) or tokens.size != int(num_emitted.sum()):
                raise ValueError(
                    f"expected token counts for {num_samples} sampled entries summing to the "
                    f"{tokens.size} tokens, got {num_emitted.shape}"
                )
            if np.count_nonzero(num_emitted < 1) or (
                step.num_drafts is not None
                and np.count_nonzero(num_emitted > step.num_drafts[step.samples] + 1)
            ):
                raise ValueError("each sampled entry emits 1 .. drafts + 1 tokens")
        b = self.batch
        rows, num = step.rows, step.num_scheduled
        # Tokens of each entry whose K/V stays: all but the rejected drafts.
        kept = num
        if num_emitted is not None and step.num_drafts is not None:
            kept = num.copy()
            kept[step.samples] -= step.num_drafts[step.samples] - (num_emitted - 1)
        sampled = rows if num_samples == rows.size else rows[step.samples]
        sampled_live = None  # [S] which sampled entries still run their sequence (None: all)
        # Rows still running the sequence they held when the step was scheduled; the others
        # were aborted, preempted or finished meanwhile, and their entries are discarded.
        if step.num_removals != b.num_removals:  # else no row has changed hands since
            live = b.live(rows, step.serials)
            if np.count_nonzero(live) < live.size:
                sampled_live = live[step.samples]
                sampled = sampled[sampled_live]
                if num_emitted is None:
                    tokens = tokens[sampled_live]
                else:
                    tokens = tokens[np.repeat(sampled_live, num_emitted)]
                    num_emitted = num_emitted[sampled_live]
                rows, num, kept = rows[live], num[live], kept[live]
        computed = b.num_computed[rows] + kept
        b.num_computed[rows] = computed
        b.num_inflight[rows] -= num
        # Accepted drafts are computed before they are known tokens: until they are appended,
        # only the known ones can go into the prefix cache.
        ahead = None
        if num_emitted is not None:
            known = b.num_tokens[rows]
            if np.count_nonzero(computed > known):
                ahead = rows[computed > known]
                computed = np.minimum(computed, known)
        self._commit_full_blocks(rows, computed, computed - kept)

        b.num_placeholders[sampled] -= 1
        seqs = list(map(b.seqs.__getitem__, sampled.tolist()))
        num_appended = np.zeros(num_samples, dtype=np.int32)
        if num_emitted is None or num_emitted.size == num_emitted.sum():
            finished = self._append(sampled, tokens)
            appended: np.ndarray | int = 1
        else:
            finished, appended = self._append_ragged(sampled, tokens, num_emitted)
        if sampled_live is None:
            num_appended[:] = appended
        else:
            num_appended[sampled_live] = appended
        if num_emitted is not None:
            self._release_unused_blocks(sampled[b.serial[sampled] != 0])
        if ahead is not None:
            ahead = ahead[b.serial[ahead] != 0]  # still running (a stop gives the row back)
            self._commit_full_blocks(
                ahead, np.minimum(b.num_computed[ahead], b.num_tokens[ahead]), before=None
            )
        # A prompt-only sequence ends once its prompt is computed (none usually run): "length"
        # (max_tokens 0), or "stop" for a pooling request, whose prompt is all it asked for.
        if b.num_prompt_only:
            prompt_done = rows[b.prompt_only[rows] & (computed >= b.num_tokens[rows])]
            for row in prompt_done.tolist():
                seq = b.seqs[row]
                assert seq is not None
                status = (
                    SequenceStatus.FINISHED_LENGTH_CAPPED
                    if seq.pooling_params is None
                    else SequenceStatus.FINISHED_STOPPED
                )
                finished.append(self._end(seq, status))
        return UpdateResult(seqs, finished, num_appended)  # type: ignore[arg-type]

    def _commit_full_blocks(
        self, rows: np.ndarray, computed: np.ndarray, before: np.ndarray | None
    ) -> None:
        """Register in the prefix cache the blocks of `rows` now full of computed K/V of known
        tokens (`computed` of them; `before`: as many before this step, to skip rows that
        crossed no block boundary, as most decodes; None: look at every row)."""
        if not self.block_manager.enable_prefix_caching or not rows.size:
            return
        bs = self.block_size
        if before is not None:
            crossed = (computed // bs > before // bs).nonzero()[0]
            rows, computed = rows[crossed], computed[crossed]
        if rows.size:
            self.block_manager.commit_computed_blocks_of(
                [self.batch.seqs[row] for row in rows.tolist()],  # type: ignore[misc]
                computed.tolist(),
            )

    def _append(self, rows: np.ndarray, tokens: np.ndarray) -> list[Sequence]:
        """Append one token to each of `rows`; returns the sequences it stopped."""
        b = self.batch
        num_tokens = b.num_tokens[rows] + 1  # after this token
        b.num_tokens[rows] = num_tokens
        b.last_token[rows] = tokens
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            b.seqs[row].token_ids.append(token)  # type: ignore[union-attr]
        return self._stop(rows, tokens, num_tokens)

    def _append_ragged(
        self, rows: np.ndarray, tokens: np.ndarray, num_emitted: np.ndarray
    ) -> tuple[list[Sequence], np.ndarray]:
        """Append `num_emitted[i]` tokens to row i, one round per position, so that each token
        meets the stop checks as it would alone: a sequence stopped by its j-th token gets no
        more. Returns the sequences stopped and the tokens appended to each row."""
        b = self.batch
        serials = b.serial[rows]
        offsets = np.cumsum(num_emitted) - num_emitted
        finished: list[Sequence] = []
        appended = np.zeros(rows.size, dtype=np.int32)
        for j in range(int(num_emitted.max())):
            # Rows with a j-th token whose sequence is still running (a stop frees the row).
            going = (num_emitted > j) & (b.serial[rows] == serials)
            finished += self._append(rows[going], tokens[offsets[going] + j])
            appended += going
        return finished, appended

    def _release_unused_blocks(self, rows: np.ndarray) -> None:
        """Rows (running) that hold blocks past their known tokens, reserved for drafts that
        were rejected, give them back (the next step allocates what its drafts need)."""
        b = self.batch
        needed = -(-b.num_tokens[rows] // self.block_size)  # blocks for every known token
        surplus = b.num_blocks[rows] > needed
        for row, keep in zip(rows[surplus].tolist(), needed[surplus].tolist(), strict=True):
            self.block_manager.free_tail(b.seqs[row], keep)  # type: ignore[arg-type]
            b.truncate_blocks(row, keep)

    def _stop(self, rows: np.ndarray, tokens: np.ndarray, num_tokens: np.ndarray) -> list[Sequence]:
        """End the sequences (at `rows`, `num_tokens` long now) whose new token stops them: EOS,
        a stop token id (both only past min_tokens), max_tokens or max_model_len.

        Vectorised down to the candidates (a length reached, an EOS id, or a row with stop
        token ids at all); min_tokens and the stop ids are checked in Python for those alone.
        """
        b = self.batch
        by_length = num_tokens >= b.length_end[rows]
        candidates = by_length
        # Rows with stop ids are looked at only if some row has them, EOS flags only if some
        # token is an EOS id.
        if b.num_with_stop_ids:
            candidates = candidates | b.has_stop_ids[rows]
        if self._eos_ids:
            is_eos = tokens == self._eos_ids[0]
            for eos_id in self._eos_ids[1:]:  # one or two ids: cheaper than np.isin
                is_eos |= tokens == eos_id
            if np.count_nonzero(is_eos):
                candidates = candidates | (is_eos & b.stops_on_eos[rows])
        finished = []
        for i in candidates.nonzero()[0].tolist():
            seq = b.seqs[int(rows[i])]
            assert seq is not None
            token = int(tokens[i])
            params = seq.sampling_params
            past_min = seq.num_output_tokens >= params.min_tokens
            if past_min and not params.ignore_eos and token in self.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif past_min and token in params.stop_token_ids:
                seq.stop_reason = token
                status = SequenceStatus.FINISHED_STOPPED
            elif by_length[i]:
                status = SequenceStatus.FINISHED_LENGTH_CAPPED
            else:
                continue
            finished.append(self._end(seq, status))
        return finished

    def _end(self, seq: Sequence | None, status: SequenceStatus) -> Sequence:
        assert seq is not None
        self._retire(seq)
        seq.status = status
        del self._seqs[seq.seq_id]
        return seq

    def discard(self, step: ScheduledStep) -> None:
        """Undo the in-flight accounting of a scheduled step whose tokens will never be applied
        (an exception, or Ctrl-C, between scheduling and update): its sequences compute those
        tokens again, and blocks reserved for its drafts are returned."""
        b = self.batch
        live = b.live(step.rows, step.serials)
        b.num_inflight[step.rows[live]] -= step.num_scheduled[live]
        b.num_placeholders[step.rows[step.samples & live]] -= 1
        if step.num_drafts is not None:
            # Blocks reserved for the drafts go back now, not at the row's next drafted step:
            # until then they would sit idle while others wait or get preempted for blocks.
            self._release_unused_blocks(step.rows[live & (step.num_drafts > 0)])
