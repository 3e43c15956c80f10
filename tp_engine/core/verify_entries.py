"""Verify entries of speculative decoding: how the scheduler plans them.

A decode that got drafts (`tp_engine.core.drafting` asks the proposer) becomes a verify entry:
its own token gets its block first, preempting for it as any decode would; its drafts are
optional work and only take blocks left free once every scheduled sequence's own tokens have
theirs (cut to fit), so a draft never preempts anyone. Drafts a proposer makes only after
allocation are left as zeros (`LateDrafts`) and filled in by `fill_drafts`.

Ownership: a mixin of `Scheduler`, whose attributes it uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tp_engine.core.scheduled_step import (
    Drafts,
    DraftSlots,
    EntryLists,
    ScheduledStep,
)
from tp_engine.core.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class _Verify:
    """A verify entry being planned: its sequence, the drafts it gets (so far) and the drafts
    themselves (None until a proposer that drafts after allocation has made them)."""

    seq: Sequence
    num_drafts: int
    drafts: np.ndarray | None


class VerifyPlanning:
    """`Scheduler`'s planning of verify entries (see the module docstring)."""

    def draft_slots(self, num_speculative_tokens: int) -> DraftSlots | None:
        """The decodes the next `schedule()` may turn into verify entries, and the most drafts
        each may have (None: none may). The step pipeline asks a proposer for them and hands
        the drafts to `schedule`; nothing changes in between."""
        _, single, start, num_known, _, _ = self._split_running()
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

    def _take_drafts(
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

    def _add_verify_entries(self, entries: EntryLists, planned: list[_Verify]) -> int:
        """Plan the verify entries (own tokens' blocks held already): their drafts cut to the
        positions the blocks they hold and the free blocks can take, in order, so that a draft
        never makes anyone be preempted; drafts not made yet (a proposer that drafts after
        allocation) are left to the step pipeline (`LateDrafts`). Returns the budget of the
        drafts cut."""
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
        for v in ready:
            late = v.drafts is None and v.num_drafts > 0
            if late:
                # Zeros until the proposer has made them (`fill_drafts`).
                offset = sum(d.size for d in entries.draft_tokens)
                entries.late.append((v.seq.row, v.num_drafts, len(entries.inputs), offset))
            drafts = np.zeros(v.num_drafts, dtype=np.int32) if late else v.drafts
            self._add_entry(entries, v.seq, 1 + v.num_drafts, drafts if v.num_drafts else None)
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
