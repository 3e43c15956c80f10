"""Continuous batching on rank 0: which sequences run this step and how many tokens each gets.

The scheduler is one class over four modules: this one (admission, decodes, prefill chunks,
preemption), `verify_entries` (speculative decoding's verify entries), `scheduler_update`
(applying a step) and `scheduled_step` (the values it hands over). It never runs a proposer:
the step pipeline asks one between `draft_slots()` and `schedule(drafts)` (`drafting`). It
drives the KV manager (`kv`) through the `KVTier` interface.

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

import numpy as np

from shm_ipc.step_plan import batch_rows
from tp_engine.config import EngineConfig
from tp_engine.core.engine_states import Gate
from tp_engine.core.kv.base import KVTier
from tp_engine.core.running_batch import RunningBatch, TableChanges
from tp_engine.core.scheduled_step import (
    Drafts,
    EntryLists,
    LateDrafts,
    RequestRejectedError,
    ScheduledStep,
)
from tp_engine.core.scheduler_update import StepUpdate
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.core.verify_entries import VerifyPlanning, _Verify

__all__ = ["Scheduler"]


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class Scheduler(VerifyPlanning, StepUpdate):
    """Owns the waiting queue and the running batch; drives the BlockManager."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: KVTier,
        eos_token_ids: Iterable[int] = (),
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

    def _split_running(
        self,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """The running rows this step looks at (admission order), and of them the decodes
        (`single`, with each one's next position and known tokens), the rows planned one by
        one and how many are about to end."""
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
        return rows, single, start, num_known, one_by_one, num_ending

    def schedule(self, drafts: Drafts | None = None) -> ScheduledStep:
        """Pick this step's batch; `drafts`: what a proposer made for rows that `draft_slots`
        offered (speculative decoding), each a verify entry if it has any. An empty step is a
        normal result (nothing to do, or waiting requests that do not fit yet)."""
        b = self.batch
        rows, single, start, num_known, one_by_one, num_ending = self._split_running()
        verify = None
        if drafts is not None and single.size:
            single, start, num_known, verify = self._take_drafts(single, start, num_known, drafts)

        preempted: list[Sequence] = []
        in_step = self._allocate_decode_blocks(single, start, preempted)
        if in_step is not None:
            single, start, num_known = single[in_step], start[in_step], num_known[in_step]
        budget = self.max_num_batched_tokens - single.size
        rows_left = self.max_num_seqs if self.enable_chunked_prefill else None
        entries = EntryLists()
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
        reads_copies_up = False
        if not preempted and self.gate.admitting:
            # Sequences about to end leave their place in the step to new ones already.
            loading = self._admit(entries, budget, self.max_num_seqs + num_ending, rows_left)
            if loading and not (single.size or entries.rows):
                # Nothing else to overlap the copies up with: the first one computes now and
                # the plan's forward pass waits for its copies.
                self._add_entry(entries, *loading[0])
                reads_copies_up = True
        return self._finish_step(single, start, num_known, entries, preempted, reads_copies_up)

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
        self, entries: EntryLists, budget: int, max_running: int, rows_left: int | None
    ) -> list[tuple[Sequence, int]]:
        """Admit waiting sequences in order while they fit; `rows_left`: prompt-logprob rows
        this step may still take (None: no limit). Returns those admitted without computing in
        this step, with the tokens they would have: their blocks from a tier below are copied
        up beside this step's forward pass (`KVTier.loading`), so they compute from the next
        step on (vLLM's requests waiting for remote KV)."""
        bm = self.block_manager
        loading: list[tuple[Sequence, int]] = []
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
            if bm.loading(seq):
                loading.append((seq, num_tokens))
                continue
            self._add_entry(entries, seq, num_tokens)
            budget -= num_tokens
        return loading

    def _next_admissible(self) -> Sequence | None:
        """The first waiting sequence the gate admits (the head, unless the gate holds some
        back: a LoRA request whose adapter has no slot yet waits, as in vLLM, while later
        requests pass it)."""
        admits = self.gate.admits
        if admits is None:
            return self.waiting[0]
        return next(filter(admits, self.waiting), None)

    def _add_entry(
        self, entries: EntryLists, seq: Sequence, num_tokens: int, drafts: np.ndarray | None = None
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
        entries: EntryLists,
        preempted: list[Sequence],
        reads_copies_up: bool = False,
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
        late = None
        if entries.late:
            late_rows, late_counts, late_entries, late_offsets = zip(*entries.late, strict=True)
            late = LateDrafts(
                np.asarray(late_rows, dtype=np.intp),
                np.asarray(late_counts, dtype=np.int32),
                list(late_entries),
                list(late_offsets),
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
            # An empty step sends no plan: its changes wait for the next one; so do those of a
            # step whose drafts are made later (the proposer's plans carry them first).
            table_changes=b.take_changes() if rows.size and late is None else TableChanges(),
            num_removals=b.num_removals,
            num_drafts=num_drafts,
            draft_tokens=draft_tokens,
            late_drafts=late,
            reads_copies_up=reads_copies_up,
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
