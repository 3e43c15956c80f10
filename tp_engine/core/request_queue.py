"""The scheduler's requests: the waiting queue and every unfinished sequence it holds, by id.

Ownership: one `RequestQueue` per `Scheduler` (`tp_engine.core.scheduler`); it owns the
`waiting` deque (first come first served; preempted sequences go back to its front) and the
id → sequence table of every sequence the scheduler holds, waiting or running. The running
ones' rows are the `RunningBatch`'s; a sequence leaves the table when it finishes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tp_engine.core.scheduled_step import RequestRejectedError
from tp_engine.core.sequence import Sequence, SequenceStatus

__all__ = ["RequestQueue"]


class RequestQueue:
    """The waiting queue and the table of unfinished sequences (see the module docstring)."""

    def __init__(self) -> None:
        self.waiting: deque[Sequence] = deque()
        self._seqs: dict[str, Sequence] = {}

    def __len__(self) -> int:
        """How many sequences wait."""
        return len(self.waiting)

    def get(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence `seq_id` (waiting or running), None if unknown."""
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back (RequestRejectedError if its id is in use)."""
        if seq.seq_id in self._seqs:
            raise RequestRejectedError(f"sequence id {seq.seq_id!r} is already in use")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq

    def pop(self, seq_id: str) -> Sequence | None:
        """Forget `seq_id` (it finishes); a waiting one also leaves the queue. None if unknown."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None and seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        return seq

    def forget(self, seq: Sequence) -> None:
        """A running sequence finished (its row and blocks went back already)."""
        del self._seqs[seq.seq_id]

    def take(self, seq: Sequence) -> None:
        """A waiting sequence is admitted: it leaves the queue and runs."""
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING

    def requeue(self, seq: Sequence) -> None:
        """A preempted sequence waits again, at the front: preempted work resumes before new
        requests, oldest first."""
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def next_admissible(self, admits: Callable[[Sequence], bool] | None) -> Sequence | None:
        """The first waiting sequence `admits` lets in (the head, unless it holds some back: a
        LoRA request whose adapter has no slot yet waits, as in vLLM, while later requests
        pass it)."""
        if admits is None:
            return self.waiting[0]
        return next(filter(admits, self.waiting), None)
