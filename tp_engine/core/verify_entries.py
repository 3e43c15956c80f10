"""Verify entries of speculative decoding: how the scheduler plans them.

A decode that got drafts (`tp_engine.core.drafting` asks the proposer) becomes a verify entry:
its own token gets its block first, preempting for it as any decode would; its drafts are
optional work and only take blocks left free once every scheduled sequence's own tokens have
theirs (cut to fit), so a draft never preempts anyone. Drafts a proposer makes only after
allocation are left as zeros (`LateDrafts`) and filled in by `fill_drafts`.

Ownership: one `VerifyPlanner` per `Scheduler`, over the running batch, the KV manager and the
block allocation it is given; it keeps no state between steps. The step planner
(`step_planner`) hands it the decodes that got drafts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tp_engine.core.block_allocation import BlockAllocation
from tp_engine.core.kv.base import KVTier
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.scheduled_step import (
    Drafts,
    DraftSlots,
    EntryLists,
    ScheduledStep,
)
from tp_engine.core.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class PlannedVerify:
    """A verify entry being planned: its sequence, the drafts it gets (so far) and the drafts
    themselves (None until a proposer that drafts after allocation has made them)."""

    seq: Sequence
    num_drafts: int
    drafts: np.ndarray | None

    @property
    def row(self) -> int:
        """Its sequence's row (it runs)."""
        assert self.seq.row is not None
        return self.seq.row


class VerifyPlanner:
    """Plans the verify entries of a step (see the module docstring)."""

    def __init__(self, batch: RunningBatch, kv: KVTier, alloc: BlockAllocation) -> None:
        self.batch = batch
        self.kv = kv
        self.alloc = alloc

    def draft_slots(
        self,
        single: np.ndarray,
        start: np.ndarray,
        num_known: np.ndarray,
        num_speculative_tokens: int,
    ) -> DraftSlots | None:
        """Of the decodes (rows `single`, their next positions `start` and known tokens, as
        `StepPlanner.split_running` finds them), those the next `schedule()` may turn into
        verify entries, and the most drafts each may have (None: none may)."""
        if not single.size:
            return None
        b = self.batch
        # j drafts can emit j + 1 tokens: stay within the length limit, so a verify entry
        # never writes K/V past what `check_fits` reserved (the last token is never fed back).
        max_drafts = np.minimum(b.length_end[single] - num_known - 1, num_speculative_tokens)
        max_drafts[start >= num_known] = 0  # reads a placeholder (not with speculation)
        candidates = np.flatnonzero(max_drafts > 0)
        if not candidates.size:
            return None
        return DraftSlots(single[candidates], max_drafts[candidates].astype(np.int32))

    def take_drafts(
        self,
        single: np.ndarray,
        start: np.ndarray,
        num_known: np.ndarray,
        drafts: Drafts,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, int, np.ndarray | None]] | None]:
        """The decodes (rows `single`) that got drafts leave the single-token path and become
        verify entries. Returns the remaining decodes' arrays and the verify entries as (row,
        drafts, the drafts or None until allocated), admission order (None: no entry)."""
        counts = drafts.counts.tolist()
        if drafts.tokens is None:
            per_row: list[np.ndarray | None] = [None] * len(counts)
        else:
            ends = np.cumsum(drafts.counts).tolist()
            per_row = [drafts.tokens[end - n : end] for n, end in zip(counts, ends, strict=True)]
        verify = [
            (row, n, d)
            for row, n, d in zip(drafts.rows.tolist(), counts, per_row, strict=True)
            if n > 0
        ]
        if not verify:
            return single, start, num_known, None
        keep = ~np.isin(single, [row for row, _, _ in verify])
        return single[keep], start[keep], num_known[keep], verify

    def reserve(
        self,
        verify: list[tuple[int, int, np.ndarray | None]],
        single: np.ndarray,
        budget: int,
        preempted: list[Sequence],
    ) -> tuple[int, list[PlannedVerify]]:
        """The token budget and each verify entry's (row, drafts wanted, drafts) own token's
        block, preempting for it as for any decode: fewer drafts when the budget is short.
        Returns the budget left and the entries kept (in order); their drafts get blocks later,
        from what is free (`add_entries`)."""
        b = self.batch
        # Each entry's own token first; drafts share what is left of the budget, in order.
        spare = budget - len(verify)
        planned: list[PlannedVerify] = []
        for row, wanted, drafts in verify:
            seq = b.seqs[row]
            if seq is None or seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(wanted, max(0, spare))
            in_step = lambda: set(single.tolist()) | {v.row for v in planned}  # noqa: E731
            if not self.alloc.allocate_or_preempt(seq, 1, in_step, preempted):
                spare += 1  # its own token is not used either
                continue
            planned.append(PlannedVerify(seq, n, drafts))
            budget -= 1 + n
            spare -= n
        return budget, planned

    def add_entries(self, entries: EntryLists, planned: list[PlannedVerify]) -> int:
        """Plan the verify entries (own tokens' blocks held already): their drafts cut to the
        positions the blocks they hold and the free blocks can take, in order, so that a draft
        never makes anyone be preempted; drafts not made yet (a proposer that drafts after
        allocation) are left to the step pipeline (`LateDrafts`). Returns the budget of the
        drafts cut."""
        b, bm = self.batch, self.kv
        bs = bm.block_size
        cut = 0
        ready: list[PlannedVerify] = []
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
            ready.append(PlannedVerify(seq, n, None if v.drafts is None else v.drafts[:n]))
        for v in ready:
            late = v.drafts is None and v.num_drafts > 0
            if late:
                # Zeros until the proposer has made them (`fill_drafts`).
                offset = sum(d.size for d in entries.draft_tokens)
                entries.late.append((v.row, v.num_drafts, len(entries.inputs), offset))
            drafts = np.zeros(v.num_drafts, dtype=np.int32) if late else v.drafts
            entries.add(self.batch, v.seq, 1 + v.num_drafts, drafts if v.num_drafts else None)
        return cut

    def fill_drafts(self, step: ScheduledStep, tokens: np.ndarray) -> ScheduledStep:
        """`step` with the drafts of its `late_drafts` entries, `tokens` row after row (as
        many as each was given), and the table changes since it was scheduled (what the
        proposer's own plans did not carry)."""
        late = step.late_drafts
        assert late is not None and step.draft_tokens is not None
        draft_tokens = step.draft_tokens.copy()
        chunk_inputs = list(step.chunk_inputs)
        ends = np.cumsum(late.counts).tolist()
        for n, end, entry, offset in zip(
            late.counts.tolist(), ends, late.entries, late.offsets, strict=True
        ):
            made = tokens[end - n : end]
            draft_tokens[offset : offset + n] = made
            chunk_inputs[entry] = chunk_inputs[entry][:-n] + made.tolist()
        return dataclasses.replace(
            step,
            draft_tokens=draft_tokens,
            chunk_inputs=chunk_inputs,
            late_drafts=None,
            table_changes=self.batch.take_changes(),
        )
