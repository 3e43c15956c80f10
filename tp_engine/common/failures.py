"""Turning a failed step into one error that names the rank at fault.

When a worker fails, rank 0 usually sees only a broken collective; the failed rank's own report
(on the channel's back channel) or its death says what happened. Survivors' collectives break
too and they report that, so the evidence is weighed: a real exception first, then a rank that
died without a word (SIGKILL, OOM), and only last a "connection closed by peer" report.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from shm_ipc import ChannelError, PlanBroadcaster, ReaderDiedError, WorkerError, WorkerErrorReport

# How long rank 0 keeps listening for a worker's error report after a step failed.
_ERROR_REPORT_WAIT_S = 5.0
# How long an idle check that found one rank gone waits for others going with it: a node lost
# takes all its ranks, but their connections are seen closing a few ms apart, and their
# heartbeats (a hung node's) fall silent up to one beat interval (0.25 s) apart.
_TOGETHER_WAIT_S = 0.5


class EngineDeadError(RuntimeError):
    """The engine cannot step any more: a rank failed or died. `rank` names it when known."""

    def __init__(self, message: str, rank: int | None = None, step_id: int | None = None):
        super().__init__(message)
        self.rank = rank
        self.step_id = step_id


class FailureGuard:
    """Turns a failed step (or start-up) into EngineDeadError naming the rank at fault.

    `channel`: the plan channel to the workers (None with one rank), whose back channel and
    liveness checks hold the evidence.
    """

    def __init__(self, channel: PlanBroadcaster | None, what: str) -> None:
        self.channel = channel
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: Any) -> Literal[False]:
        # Never swallows: an exception goes on as it is, or as the diagnosis raised here.
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, EngineDeadError):
            return False
        if isinstance(exc, ValueError) and self.what == "start-up":
            # A configuration rank 0 refuses (every rank refuses the same): the caller's error,
            # not a broken rank, so it keeps its type and message.
            return False
        raise self._diagnose(exc) from exc

    def _diagnose(self, exc: Exception) -> EngineDeadError:
        # A report or a death seen by the channel may itself be a consequence (a survivor whose
        # collective broke): it joins the evidence below. Other channel errors (a timeout, a
        # corrupt slot) are the diagnosis.
        worker_failed = isinstance(exc, (WorkerError, ReaderDiedError))
        if isinstance(exc, ChannelError) and not worker_failed:
            return EngineDeadError(str(exc), rank=exc.rank, step_id=exc.step_id)
        channel = self.channel
        if channel is not None:
            # Another rank probably failed first and rank 0 only saw its collective break. Wait
            # (briefly) until every worker has either reported or died, then blame the root
            # cause: a real exception, else a rank that died without a word (SIGKILL, OOM),
            # and only last a rank whose own collective merely broke because of the others.
            reports: list[WorkerErrorReport] = [exc.report] if isinstance(exc, WorkerError) else []
            reports, dead = _evidence(channel, reports, [], _ERROR_REPORT_WAIT_S)
            culprit = self._root_cause(reports, dead)
            if culprit is not None:
                return culprit
        if isinstance(exc, ChannelError):
            return EngineDeadError(str(exc), rank=exc.rank, step_id=exc.step_id)
        return EngineDeadError(
            f"rank 0 failed during {self.what}: {type(exc).__name__}: {exc}", rank=0
        )

    def _root_cause(
        self, reports: list[WorkerErrorReport], dead: list[int]
    ) -> EngineDeadError | None:
        primary = [r for r in reports if not _is_peer_loss(r)]
        if primary:
            return _from_report(primary[0])
        reported = {r.rank for r in reports}
        silent = sorted(rank for rank in dead if rank not in reported)
        if silent:
            # Nothing tells which went first when several died without a word (a rank whose
            # collective broke may abort in C++ too): every one of them is named, with its
            # node when the run spans nodes.
            names = (
                " and ".join(f"rank {rank}" for rank in silent)
                if self.channel is None
                else self.channel.describe(silent)
            )
            return EngineDeadError(
                f"{names} died during {self.what} without reporting an error "
                "(killed, or out of memory?)",
                rank=silent[0] if len(silent) == 1 else None,
            )
        return _from_report(reports[0]) if reports else None


def diagnose_stall(channel: PlanBroadcaster | None, step_id: int) -> EngineDeadError | None:
    """What the workers say about a step rank 0 is stuck in: the root cause among their error
    reports and deaths (as `FailureGuard` finds it), or None when every worker is silent and
    alive, i.e. a rank is truly hung.

    For the server's watchdog thread, while the engine thread is blocked inside a collective
    or is itself waiting for the rest of the evidence (`_evidence`) with the reports it has
    taken: so every report that has arrived counts, not only those no one has read.
    """
    if channel is None:
        return None
    guard = FailureGuard(channel, f"step {step_id}")
    return guard._root_cause(channel.reports_seen(), channel.dead_readers())


def check_ranks(channel: PlanBroadcaster | None) -> EngineDeadError | None:
    """Between steps: the root cause among error reports and deaths since the last step, or
    None when every worker is alive and silent. Cheap (pid and heartbeat clocks, a non-blocking
    read of the back channel), so an idle engine loop can ask it a few times a second: a node
    lost while nothing runs is otherwise noticed only by the next request's collective. Once it
    finds a rank gone, it waits up to `_TOGETHER_WAIT_S` for the ranks going with it."""
    if channel is None:
        return None
    dead, reports = channel.dead_readers(), channel.poll_errors()
    if not dead and not reports:
        return None
    # Ranks that go together are noticed one by one: a moment for the others, so that the
    # error names every rank of a lost node, not the first one seen.
    reports, dead = _evidence(channel, reports, dead, _TOGETHER_WAIT_S)
    return FailureGuard(channel, "an idle wait")._root_cause(reports, dead)


def _evidence(
    channel: PlanBroadcaster, reports: list[WorkerErrorReport], dead: list[int], wait_s: float
) -> tuple[list[WorkerErrorReport], list[int]]:
    """`reports` and `dead` with what the channel adds within `wait_s`: it stops early once every
    worker has either reported or died."""
    deadline = time.monotonic() + wait_s
    while True:
        reports = reports + channel.poll_errors()
        dead = channel.dead_readers()
        if len({r.rank for r in reports} | set(dead)) == channel.handle.num_readers:
            return reports, dead
        if time.monotonic() >= deadline:
            return reports + channel.poll_errors(), dead
        time.sleep(0.05)


# Messages of a rank whose collective broke because a peer vanished: a consequence, not a cause.
_PEER_LOSS_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
)


def _is_peer_loss(report: WorkerErrorReport) -> bool:
    message = report.message.lower()
    return any(marker in message for marker in _PEER_LOSS_MARKERS)


def _from_report(report: WorkerErrorReport) -> EngineDeadError:
    error = WorkerError(report)
    return EngineDeadError(str(error), rank=error.rank, step_id=error.step_id)
