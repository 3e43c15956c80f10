"""Exceptions of the rank-0 → workers channel.

Every error names the rank at fault and, where there is one, the step it was on: a stuck or
broken tensor-parallel run is debugged by finding which rank stopped where. The same facts are
kept as attributes (`rank`, `step_id`) so that the engine can act on them without parsing text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shm_ipc.error_channel import WorkerErrorReport


class ChannelError(RuntimeError):
    """Base class: something went wrong on the plan channel.

    `rank` is the rank at fault (the one that is stuck, dead or reported the error), `step_id`
    the step it was on; either is None where it is not known.
    """

    def __init__(self, message: str, *, rank: int | None = None, step_id: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.step_id = step_id


class ChannelTimeout(ChannelError, TimeoutError):
    """A wait ran past its timeout while the peer process is still alive (stuck, not dead)."""


class OwnerDiedError(ChannelError):
    """Rank 0 (the writer) is gone; a worker should exit non-zero."""


class ReaderDiedError(ChannelError):
    """A worker process (a reader) is gone; rank 0 cannot go on without it."""


class ChannelClosed(ChannelError):
    """Rank 0 closed the channel without sending an EXIT plan first."""


class CorruptMessageError(ChannelError):
    """A slot's sequence number, length or checksum does not match its doorbell, or the payload
    does not decode: a protocol bug or memory corruption, never something to retry."""


class WorkerError(ChannelError):
    """A worker reported an exception on the back channel; `report` holds what it sent."""

    def __init__(self, report: WorkerErrorReport):
        where = "outside a step" if report.step_id is None else f"at step {report.step_id}"
        super().__init__(
            f"rank {report.rank} failed {where}: {report.type}: {report.message}\n"
            f"--- traceback from rank {report.rank} ---\n{report.traceback}",
            rank=report.rank,
            step_id=report.step_id,
        )
        self.report = report
