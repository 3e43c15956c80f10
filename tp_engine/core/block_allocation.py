"""Blocks for the scheduled tokens, and preemption when there are none.

When a running sequence cannot get a block, the most recently admitted running sequence that is
not already part of this step is preempted (its blocks are freed and it is recomputed later,
usually from the prefix cache); if that is the sequence itself, it steps aside.

Ownership: one `BlockAllocation` per `Scheduler` (`tp_engine.core.scheduler`), over the
scheduler's running batch, KV manager and request queue, which it is given; it owns the count
of preemptions. The step planner and the verify planner ask it for blocks; the update and
`Scheduler.finish` give a sequence's row and blocks back through `retire`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tp_engine.core.kv.base import KVTier
from tp_engine.core.request_queue import RequestQueue
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.sequence import Sequence

__all__ = ["BlockAllocation"]


class BlockAllocation:
    """Blocks for running sequences, preempting for them (see the module docstring)."""

    def __init__(self, batch: RunningBatch, kv: KVTier, queue: RequestQueue) -> None:
        self.batch = batch
        self.kv = kv
        self.queue = queue
        # Preemptions since start (vLLM's num_preemptions_total).
        self.num_preemptions = 0
        # Finished sequences whose blocks another server still reads (a prefill server of
        # prefill/decode disaggregation: `Sequence.keeps_blocks`), by id, until `release_kept`.
        self.kept: dict[str, Sequence] = {}

    def decode_blocks(
        self, single: np.ndarray, start: np.ndarray, preempted: list[Sequence]
    ) -> np.ndarray | None:
        """Blocks for the decodes (rows `single`, their tokens at positions `start`) that need
        one: a sequence crossing into a new block. Returns which decodes stay in the step (a
        victim of preemption, or a sequence that stepped aside, does not), None for all."""
        b, bs = self.batch, self.kv.block_size
        # The token at `start` needs block start // bs: a new one iff the row holds no more.
        need = np.flatnonzero(start >= b.num_blocks[single] * bs)
        if need.size == 0:
            return None
        block_ids = self.kv.take_blocks(need.size)
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

            def before(i: int = i) -> set[int]:
                return set(single[:i][keep[:i]].tolist())

            self.allocate_or_preempt(seq, 1, before, victims)
            if victims:
                preempted += victims
                # Victims' rows (this sequence's own, if it stepped aside) were freed just now.
                keep[b.serial[single] == 0] = False
        return keep

    def allocate_or_preempt(
        self,
        seq: Sequence,
        num_tokens: int,
        in_step_rows: Callable[[], set[int]],
        preempted: list[Sequence],
    ) -> bool:
        """Blocks for `num_tokens` more tokens of running `seq`, preempting the most recently
        admitted running sequences outside this step (`in_step_rows()`, asked only when it
        comes to that) until they fit. False if `seq` itself had to step aside."""
        bm = self.kv
        in_step: set[int] | None = None
        assert seq.row is not None
        while not bm.allocate_slots(seq, num_tokens, start=self.batch.scheduled_end(seq.row)):
            if in_step is None:
                in_step = in_step_rows()
            victim = self.pick_victim(in_step)
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self.batch.sync_blocks(seq)
        return True

    def pick_victim(self, in_step_rows: set[int]) -> Sequence:
        """The most recently admitted running sequence that this step has not scheduled."""
        for row in reversed(self.batch.order.tolist()):
            if row not in in_step_rows:
                seq = self.batch.seqs[row]
                assert seq is not None
                return seq
        raise AssertionError("unreachable: the sequence asking for blocks is itself a candidate")

    def preempt(self, seq: Sequence) -> None:
        """`seq` gives its row and blocks back and waits again, at the front of the queue."""
        self.retire(seq)
        # A step in flight may still compute for it; `update` discards that (the row's serial).
        seq.num_computed_tokens = seq.num_inflight_tokens = seq.num_placeholders = 0
        seq.prompt_arrived = False  # its prompt's K/V from elsewhere is gone: computed again
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.queue.requeue(seq)

    def retire(self, seq: Sequence, *, finished: bool = False) -> None:
        """`seq` stops running: its row and its blocks go back, except the blocks of one that
        `finished` and `keeps_blocks` (held in `kept` until `release_kept`)."""
        self.batch.remove(seq)
        if finished and seq.keeps_blocks:
            self.kept[seq.seq_id] = seq
        else:
            self.kv.free(seq)

    def release_kept(self, seq_id: str) -> None:
        """The blocks of a finished sequence kept for another server go back."""
        seq = self.kept.pop(seq_id, None)
        if seq is not None:
            self.kv.free(seq)
