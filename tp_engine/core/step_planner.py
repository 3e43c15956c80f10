"""One step's batch: which running and waiting sequences run this step and how many tokens each
gets (`Scheduler.schedule`, `tp_engine.core.scheduler`).

Each `schedule()` fills a token budget (`max_num_batched_tokens`) under a sequence cap
(`max_num_seqs`), in this order:

1. running sequences that decode (one token each),
2. running sequences whose prompt is being prefilled in chunks,
3. waiting sequences, first come first served; the last one admitted is cut to the budget
   (chunked prefill) or waits for a later step (chunked prefill off).

A sequence short of blocks preempts others (`block_allocation`). Nothing is admitted in a step
that preempted, since the pool is evidently tight. A request that could never fit is refused by
`Scheduler.add`, so every admitted sequence can always make progress: no livelock. Speculative
drafts are optional work (`verify_entries`): they get blocks only once every scheduled
sequence's own tokens have theirs, and only free ones (cut to fit), so a draft never preempts
anyone.

The common case, every running sequence decoding, is numpy over the `RunningBatch`'s rows:
which rows decode, which need a new block (one in `block_size` steps: Python for those alone)
and their placeholders. Per-sequence Python runs for the rare events: admission, prefill
chunks, a new block, preemption, prompt logprobs.

Ownership: one `StepPlanner` per `Scheduler`, over the running batch, the KV manager, the
request queue, the block allocation and the verify planner it is given; it owns the step's
limits and the gate (what the engine's state lets run), which the core sets.
"""

from __future__ import annotations

import time

import numpy as np

from tp_engine.config import EngineConfig
from tp_engine.core.block_allocation import BlockAllocation
from tp_engine.core.engine_states import Gate
from tp_engine.core.kv.base import KVTier
from tp_engine.core.request_queue import RequestQueue
from tp_engine.core.running_batch import RunningBatch, TableChanges
from tp_engine.core.scheduled_step import Drafts, EntryLists, LateDrafts, ScheduledStep
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.core.verify_entries import PlannedVerify, VerifyPlanner

__all__ = ["StepPlanner"]


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


class StepPlanner:
    """Plans each step's batch (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        batch: RunningBatch,
        kv: KVTier,
        queue: RequestQueue,
        alloc: BlockAllocation,
        verify: VerifyPlanner,
    ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.resolved_max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.batch = batch
        self.kv = kv
        self.queue = queue
        self.alloc = alloc
        self.verify = verify
        # Read-only ones and zeros that a decode step's arrays are slices of (an np.ones call
        # costs a microsecond or so, a slice a fifth of that).
        self._ones = _read_only(np.ones(batch.max_rows, dtype=np.int32))
        self._zeros = _read_only(np.zeros(batch.max_rows, dtype=np.int32))
        # What the engine's state allows (paused: no admissions; paused "keep": no steps).
        self.gate = Gate()

    def split_running(
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
        rows, single, start, num_known, one_by_one, num_ending = self.split_running()
        verify = None
        if drafts is not None and single.size:
            single, start, num_known, verify = self.verify.take_drafts(
                single, start, num_known, drafts
            )

        preempted: list[Sequence] = []
        in_step = self.alloc.decode_blocks(single, start, preempted)
        if in_step is not None:
            single, start, num_known = single[in_step], start[in_step], num_known[in_step]
        budget = self.max_num_batched_tokens - single.size
        rows_left = self.max_num_seqs if self.enable_chunked_prefill else None
        entries = EntryLists()
        # Verify entries' own tokens and prefill chunks get their blocks first, preempting as
        # any decode would; drafts are optional work and only take blocks left free after that.
        planned: list[PlannedVerify] = []
        if verify is not None:
            budget, planned = self.verify.reserve(verify, single, budget, preempted)
        chunks: list[tuple[Sequence, int]] = []
        chunk_rows: list[int] = []  # their rows
        for row in rows[one_by_one].tolist():
            seq = b.seqs[row]
            if budget == 0:
                break
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens = min(b.num_uncomputed(row), budget)
            takes_rows = rows_left is not None and seq.needs_prompt_logits
            if takes_rows and rows_left is not None:
                # Prompt logprobs need a [vocab] logits row per prompt token computed. With
                # chunked prefill a step takes at most max_num_seqs of them (the logits rows
                # the GPU memory profile budgets for), so a long prompt asking for them
                # cannot exhaust memory.
                num_tokens = min(num_tokens, rows_left)
                if num_tokens == 0:
                    continue
            in_step_rows = lambda: (  # noqa: E731
                set(single.tolist()) | {v.row for v in planned} | set(chunk_rows)
            )
            if not self.alloc.allocate_or_preempt(seq, num_tokens, in_step_rows, preempted):
                continue
            chunks.append((seq, num_tokens))
            chunk_rows.append(row)
            budget -= num_tokens
            if takes_rows and rows_left is not None:
                rows_left -= num_tokens
        if planned:
            # Drafts cut short by the free blocks leave their budget to admissions.
            budget += self.verify.add_entries(entries, planned)
        for seq, num_tokens in chunks:
            entries.add(self.batch, seq, num_tokens)
        reads_copies_up = False
        if not preempted and self.gate.admitting:
            # Sequences about to end leave their place in the step to new ones already.
            loading = self._admit(entries, budget, self.max_num_seqs + num_ending, rows_left)
            if loading and not (single.size or entries.rows):
                # Nothing else to overlap the copies up with: the first one computes now and
                # the plan's forward pass waits for its copies.
                entries.add(self.batch, *loading[0])
                reads_copies_up = True
        return self._finish_step(single, start, num_known, entries, preempted, reads_copies_up)

    def _admit(
        self, entries: EntryLists, budget: int, max_running: int, rows_left: int | None
    ) -> list[tuple[Sequence, int]]:
        """Admit waiting sequences in order while they fit; `rows_left`: prompt-logprob rows
        this step may still take (None: no limit). Returns those admitted without computing in
        this step, with the tokens they would have: their blocks from a tier below are copied
        up beside this step's forward pass (`KVTier.loading`), so they compute from the next
        step on (vLLM's requests waiting for remote KV)."""
        bm = self.kv
        loading: list[tuple[Sequence, int]] = []
        while self.queue.waiting and budget > 0 and len(self.batch) < max_running:
            seq = self.queue.next_admissible(self.gate.admits)
            if seq is None:
                break
            if seq.prompt_arrived:
                # Its prompt's K/V came from a prefill server (`remote_prompts`): it holds
                # those blocks, computed, and its first token (the prefill's) is next.
                cached_prefix = None
                num_tokens = seq.num_tokens - seq.num_computed_tokens
            else:
                cached_prefix = bm.find_cached_prefix(seq)
                num_tokens = seq.num_tokens - len(cached_prefix) * bm.block_size
            if num_tokens > budget:
                if not self.enable_chunked_prefill:
                    break  # first come, first served: nobody overtakes the head of the queue
                num_tokens = budget
            takes_rows = rows_left is not None and seq.needs_prompt_logits
            if takes_rows and rows_left is not None:
                num_tokens = min(num_tokens, rows_left)
                if num_tokens == 0:
                    break
            if not bm.allocate_slots(seq, num_tokens, cached_prefix):
                break
            if takes_rows and rows_left is not None:
                rows_left -= num_tokens
            self.queue.take(seq)
            if seq.scheduled_at is None:
                seq.scheduled_at = time.monotonic()
                seq.queue_time_s = max(0.0, seq.scheduled_at - seq.arrival_time)
            self.batch.add(seq)
            self.batch.sync_blocks(seq)
            if bm.loading(seq):
                loading.append((seq, num_tokens))
                continue
            entries.add(self.batch, seq, num_tokens)
            budget -= num_tokens
        return loading

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
