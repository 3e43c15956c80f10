"""Root-cause diagnosis on rank 0 from the workers' reports and deaths (no processes).

`FailureGuard` (a step that raised) and `diagnose_stall` (the server's watchdog, while rank 0 is
stuck in a collective) must blame the rank that failed first, never a survivor whose collective
merely broke because of it.
"""

from __future__ import annotations

from types import SimpleNamespace

from shm_ipc.error_channel import WorkerErrorReport
from tp_engine.common.failures import check_ranks, diagnose_stall


class FakeChannel:
    def __init__(self, reports: list[WorkerErrorReport], dead: list[int]) -> None:
        self.reports, self.dead = reports, dead
        self.seen = list(reports)  # as PlanBroadcaster.reports_seen: polled or not
        self.handle = SimpleNamespace(num_readers=3)

    def poll_errors(self) -> list[WorkerErrorReport]:
        reports, self.reports = self.reports, []
        return reports

    def reports_seen(self) -> list[WorkerErrorReport]:
        return list(self.seen)

    def dead_readers(self) -> list[int]:
        return self.dead

    def describe(self, ranks: list[int]) -> str:
        return " and ".join(f"rank {rank}" for rank in ranks)  # one node, as PlanBroadcaster


def report(rank: int, message: str, type_: str = "RuntimeError") -> WorkerErrorReport:
    return WorkerErrorReport(rank=rank, step_id=8, type=type_, message=message, traceback="")


def channel_with(reports: list[WorkerErrorReport], dead: list[int]) -> FakeChannel:
    return FakeChannel(reports, dead)


def test_stall_blames_the_rank_that_raised_not_the_one_whose_collective_broke():
    peer_loss = report(1, "[gloo] Connection closed by peer [127.0.0.1]:1234")
    raised = report(2, "injected fault on rank 2 at step 8", "InjectedFault")
    cause = diagnose_stall(channel_with([peer_loss, raised], dead=[1, 2]), 8)
    assert cause is not None and cause.rank == 2 and cause.step_id == 8
    assert "injected fault on rank 2 at step 8" in str(cause)


def test_stall_counts_reports_the_engine_thread_has_already_taken():
    # Seen in CI: the engine thread took both reports (its step had raised) and waited for the
    # third worker; the watchdog, firing meanwhile, found only deaths and blamed "rank 1 and
    # rank 2 ... without reporting an error" in place of rank 2's exception.
    peer_loss = report(1, "[gloo] Connection closed by peer [127.0.0.1]:1234")
    raised = report(2, "injected fault on rank 2 at step 8", "InjectedFault")
    channel = channel_with([peer_loss, raised], dead=[1, 2])
    assert channel.poll_errors() == [peer_loss, raised]  # the engine thread's `_evidence`
    cause = diagnose_stall(channel, 8)
    assert cause is not None and cause.rank == 2
    assert "injected fault on rank 2 at step 8" in str(cause)


def test_stall_blames_a_rank_that_died_silently():
    peer_loss = report(1, "Connection reset by peer")
    cause = diagnose_stall(channel_with([peer_loss], dead=[1, 3]), 8)
    assert cause is not None and cause.rank == 3 and "without reporting an error" in str(cause)


def test_stall_with_every_worker_silent_and_alive_is_a_hang():
    assert diagnose_stall(channel_with([], dead=[]), 8) is None
    assert diagnose_stall(None, 3) is None


def test_several_silent_deaths_are_all_named():
    # Which died first is unknown (a rank whose collective broke can abort without a word):
    # naming only the lowest rank blamed a survivor once (rank 2 for an exit on rank 3).
    cause = diagnose_stall(channel_with([], dead=[3, 2]), 8)
    assert cause is not None and cause.rank is None
    assert "rank 2 and rank 3 died during step 8 without reporting an error" in str(cause)


class DyingNode(FakeChannel):
    """Ranks 2 and 3 of a lost node, the second seen gone a few polls after the first."""

    def __init__(self) -> None:
        super().__init__([], dead=[2])
        self.polls = 0

    def dead_readers(self) -> list[int]:
        self.polls += 1
        return [2, 3] if self.polls > 3 else [2]


def test_an_idle_check_names_every_rank_of_a_node_lost_together():
    # Seen in CI: the error named rank 2 alone, its node's rank 3 noticed a poll later.
    cause = check_ranks(DyingNode())
    assert cause is not None and "rank 2 and rank 3 died during an idle wait" in str(cause)


def test_an_idle_check_with_every_worker_alive_returns_at_once():
    assert check_ranks(channel_with([], dead=[])) is None
