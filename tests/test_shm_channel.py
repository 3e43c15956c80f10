"""The plan channel: in-process protocol tests, then real processes (spawned, marked slow).

Every test ends by checking that its run left nothing behind: no /dev/shm region, no socket
file, no run directory (looked up by the names in the run's handle). Timing assertions are
upper bounds far above what the code needs, except where a sleep in a reader makes a lower bound
certain.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

import numpy as np
import pytest

from shm_ipc import (
    ChannelClosed,
    ChannelError,
    ChannelHandle,
    ChannelTimeout,
    Command,
    CorruptMessageError,
    OwnerDiedError,
    PlanBroadcaster,
    PlanReceiver,
    ReaderDiedError,
    StepPlan,
    WorkerError,
)

SPAWN = mp.get_context("spawn")
SLOT_BYTES = 4096  # small, so that about half of the random plans travel in the doorbell

# Reader process exit codes, so that a test can tell why a reader stopped.
EXIT_OK, EXIT_WRONG_PLAN, EXIT_OWNER_DIED, EXIT_CLOSED, EXIT_REPORTED = 0, 2, 17, 18, 19


def make_plan(step_id: int, max_tokens: int = 2100) -> StepPlan:
    """A random but reproducible plan: every array is a function of `step_id` alone, so a
    reader can rebuild it and compare. Sizes range from an empty batch to ~2.5 slots."""
    rng = np.random.default_rng(step_id)
    num_tokens = int(rng.integers(0, max_tokens + 1))
    num_seqs = int(rng.integers(1, 9)) if num_tokens else 0
    cuts = np.sort(rng.integers(0, num_tokens + 1, max(num_seqs - 1, 0)))
    qsl = np.concatenate([[0], cuts, [num_tokens]]) if num_seqs else np.zeros(1)
    num_logits = min(num_seqs, num_tokens)
    edit_sizes = rng.integers(0, 200, int(rng.integers(0, num_seqs + 1)))  # rows of new blocks
    return StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=rng.integers(0, 151_936, num_tokens, dtype=np.int32),
        query_start_loc=qsl.astype(np.int32),
        seq_lens=rng.integers(1, 40_960, num_seqs, dtype=np.int32),
        rows=rng.integers(0, 512, num_seqs, dtype=np.int32),
        logits_indices=rng.integers(0, max(num_tokens, 1), num_logits, dtype=np.int32),
        edit_rows=rng.integers(0, 512, edit_sizes.size, dtype=np.int32),
        edit_starts=rng.integers(0, 2560, edit_sizes.size, dtype=np.int32),
        edit_offsets=np.concatenate([[0], np.cumsum(edit_sizes)]).astype(np.int32),
        edit_blocks=rng.integers(0, 1 << 20, int(edit_sizes.sum()), dtype=np.int32),
    )


def same_plan(a: StepPlan, b: StepPlan) -> bool:
    return (a.step_id, a.command) == (b.step_id, b.command) and a.encode() == b.encode()


def assert_nothing_left(handle: ChannelHandle) -> None:
    left = [
        p for p in (handle.shm_path, handle.plan_socket, handle.back_socket) if os.path.exists(p)
    ]
    left += [handle.run_dir] if os.path.exists(handle.run_dir) else []
    assert not left, f"left behind: {left}"


# -- process bodies (module level, so that "spawn" children can import them) --------------------


def reader_main(handle_bytes: bytes, rank: int, opts: dict) -> None:
    """A worker: receive until EXIT, rebuild each plan from its step id and compare.

    opts: num_steps (expected count), delay_s (sleep after each plan), die_at / fail_at (step at
    which to SIGKILL itself / raise and report an error).
    """
    handle = ChannelHandle.from_bytes(handle_bytes)
    try:
        with PlanReceiver(handle, rank) as rx:
            expected = 0
            while True:
                plan = rx.recv()
                if plan.command is Command.EXIT:
                    break
                if plan.step_id != expected or not same_plan(plan, make_plan(plan.step_id)):
                    print(
                        f"rank {rank}: wrong plan {plan.step_id}, want {expected}", file=sys.stderr
                    )
                    sys.exit(EXIT_WRONG_PLAN)
                if plan.step_id == opts.get("die_at"):
                    os.kill(os.getpid(), signal.SIGKILL)
                if plan.step_id == opts.get("fail_at"):
                    try:
                        raise ValueError(f"boom at step {plan.step_id}")
                    except ValueError as exc:
                        rx.report_error(plan.step_id, exc)
                    sys.exit(EXIT_REPORTED)  # close() in __exit__ lingers to deliver the report
                if opts.get("delay_s"):
                    time.sleep(opts["delay_s"])
                expected += 1
    except OwnerDiedError:
        sys.exit(EXIT_OWNER_DIED)
    except ChannelClosed:
        sys.exit(EXIT_CLOSED)
    sys.exit(EXIT_OK if expected == opts["num_steps"] else EXIT_WRONG_PLAN)


def writer_main(conn: Connection, num_readers: int, num_steps: int, handshake: bool) -> None:
    """Rank 0 in its own process, SIGKILLed after `num_steps` plans (or before the handshake)."""
    bc = PlanBroadcaster(num_readers, slot_bytes=SLOT_BYTES, num_slots=4, timeout_s=30.0)
    conn.send_bytes(bc.handle.to_bytes())  # synchronous: delivered before the kill below
    if handshake:
        bc.wait_for_readers()
        for step in range(num_steps):
            bc.publish(make_plan(step))
    os.kill(os.getpid(), signal.SIGKILL)


# -- helpers -------------------------------------------------------------------------------------


@pytest.fixture
def procs() -> Iterator[list[mp.process.BaseProcess]]:
    """Processes a test starts; any still alive at teardown is killed (a failed test must not
    leave a reader blocked forever)."""
    started: list[mp.process.BaseProcess] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(10)


def start_readers(
    procs: list, handle: ChannelHandle, ranks: list[int], **opts: object
) -> dict[int, mp.process.BaseProcess]:
    per_rank: dict[int, dict] = {}
    for rank in ranks:
        rank_opts = {k: v for k, v in opts.items() if not isinstance(v, dict)}
        rank_opts.update({k: v[rank] for k, v in opts.items() if isinstance(v, dict) and rank in v})
        per_rank[rank] = rank_opts
    readers = {
        rank: SPAWN.Process(target=reader_main, args=(handle.to_bytes(), rank, per_rank[rank]))
        for rank in ranks
    }
    for p in readers.values():
        p.start()
        procs.append(p)
    return readers


def join_all(readers: dict[int, mp.process.BaseProcess], timeout_s: float) -> dict[int, int | None]:
    deadline = time.monotonic() + timeout_s
    for p in readers.values():
        p.join(max(0.0, deadline - time.monotonic()))
    return {rank: p.exitcode for rank, p in readers.items()}


# -- in-process tests (one process plays rank 0 and rank 1) ---------------------------------------


def test_handle_roundtrips_as_bytes_and_rejects_garbage() -> None:
    with PlanBroadcaster(2, slot_bytes=1024, num_slots=3) as bc:
        raw = bc.handle.to_bytes()
        assert isinstance(raw, bytes)
        assert ChannelHandle.from_bytes(bytearray(raw)) == bc.handle
        assert ChannelHandle.from_bytes(np.frombuffer(raw, np.uint8).data) == bc.handle
        for bad in (b"", b"\x80\x04garbage", b"\xc1", raw[:-3]):
            with pytest.raises(ValueError):
                ChannelHandle.from_bytes(bad)
    assert_nothing_left(bc.handle)


def test_names_are_private_and_removed_after_handshake() -> None:
    with PlanBroadcaster(1, slot_bytes=1024) as bc:
        h = bc.handle
        assert stat.S_IMODE(os.stat(h.run_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(h.shm_path).st_mode) == 0o600
        assert h.shm_name.startswith(f"tpe-{os.getpid()}-") and h.owner_pid == os.getpid()
        with PlanReceiver(h, 1) as rx:
            bc.wait_for_readers(10)
            assert_nothing_left(h)  # names gone, channel still works
            bc.publish(make_plan(0))
            assert same_plan(rx.recv(), make_plan(0))
    assert_nothing_left(h)


def test_close_without_handshake_removes_everything() -> None:
    bc = PlanBroadcaster(3)
    assert os.path.exists(bc.handle.shm_path)
    bc.close()
    bc.close()  # idempotent
    assert_nothing_left(bc.handle)
    with pytest.raises(ChannelError, match="closed"):
        bc.publish(make_plan(0))


def test_run_dir_under_xdg_runtime_dir(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with PlanBroadcaster(1) as bc:
        assert os.path.dirname(bc.handle.run_dir) == str(tmp_path)
    assert_nothing_left(bc.handle)


def test_roundtrip_in_slot_and_in_doorbell() -> None:
    with (
        PlanBroadcaster(1, slot_bytes=SLOT_BYTES, num_slots=2) as bc,
        PlanReceiver(bc.handle, 1) as rx,
    ):
        bc.wait_for_readers(10)
        sizes = []
        for step in range(40):
            plan = make_plan(step)
            sizes.append(plan.encoded_size())
            bc.publish(plan)
            got = rx.recv()
            assert same_plan(got, plan)
            assert not got.input_ids.flags.writeable
        assert min(sizes) <= SLOT_BYTES < max(sizes)  # both paths taken
        bc.publish(StepPlan.exit(40))
        assert rx.recv().command is Command.EXIT
        assert rx.last_step_id == 40
    assert_nothing_left(bc.handle)


def test_corrupted_slot_is_detected_naming_rank_and_step() -> None:
    with PlanBroadcaster(1, slot_bytes=SLOT_BYTES) as bc, PlanReceiver(bc.handle, 1) as rx:
        bc.wait_for_readers(10)
        plan = make_plan(3, max_tokens=50)
        assert plan.encoded_size() <= SLOT_BYTES
        bc.publish(plan)
        ring = bc._ring  # white box: flip one payload byte behind the protocol's back
        with ring.payload_view(0, plan.encoded_size()) as buf:
            buf[-1] ^= 0xFF
        with pytest.raises(CorruptMessageError, match=r"rank 1, step 3: checksum") as err:
            rx.recv()
        assert (err.value.rank, err.value.step_id) == (1, 3)


def test_sequence_mismatch_is_detected() -> None:
    with PlanBroadcaster(1, slot_bytes=SLOT_BYTES) as bc, PlanReceiver(bc.handle, 1) as rx:
        bc.wait_for_readers(10)
        bc.publish(make_plan(0, max_tokens=50))
        bc._ring.mm[64:72] = (99).to_bytes(8, "little")  # slot 0's seq
        with pytest.raises(
            CorruptMessageError, match="slot 0 holds message 99, the doorbell says 1"
        ):
            rx.recv()


def test_idle_recv_does_not_fail_but_an_explicit_timeout_names_the_rank() -> None:
    with PlanBroadcaster(1) as bc, PlanReceiver(bc.handle, 1) as rx:
        bc.wait_for_readers(10)
        bc.publish(make_plan(7))
        rx.recv()
        start = time.monotonic()
        with pytest.raises(ChannelTimeout, match=r"rank 1 waited 1\.2 s for the plan after step 7"):
            rx.recv(timeout_s=1.2)  # rank 0 is alive, so only the explicit timeout ends this
        assert 1.2 <= time.monotonic() - start < 10


def test_full_ring_times_out_naming_rank_and_step() -> None:
    with PlanBroadcaster(1, num_slots=2, timeout_s=0.5) as bc, PlanReceiver(bc.handle, 1):
        bc.wait_for_readers(10)
        bc.publish(make_plan(10))
        bc.publish(make_plan(11))
        start = time.monotonic()
        with pytest.raises(
            ChannelTimeout, match=r"waited 0.5 s for rank 1 to acknowledge step 10"
        ) as err:
            bc.publish(make_plan(12))
        assert (err.value.rank, err.value.step_id) == (1, 10)
        assert time.monotonic() - start < 10


def test_handshake_timeout_names_missing_ranks() -> None:
    with PlanBroadcaster(3) as bc, PlanReceiver(bc.handle, 2):
        with pytest.raises(ChannelTimeout, match=r"no hello from ranks \[1, 3\]"):
            bc.wait_for_readers(0.5)
        with pytest.raises(ChannelError, match="before wait_for_readers"):
            bc.publish(make_plan(0))
    assert_nothing_left(bc.handle)


def test_error_report_reaches_rank_0() -> None:
    with PlanBroadcaster(1) as bc, PlanReceiver(bc.handle, 1) as rx:
        bc.wait_for_readers(10)
        assert bc.poll_errors() == []
        try:
            raise KeyError("no such block")
        except KeyError as exc:
            assert rx.report_error(42, exc)
        deadline = time.monotonic() + 10
        reports = []
        while not reports and time.monotonic() < deadline:
            reports = bc.poll_errors()
        [report] = reports
        assert (report.rank, report.step_id, report.type) == (1, 42, "KeyError")
        assert bc.poll_errors() == [] and bc.reports_seen() == [report]  # taken, still seen
        assert "no such block" in report.message and "KeyError" in report.traceback
        rx.report_error(None, RuntimeError("again"))  # outside a step
        with pytest.raises(WorkerError, match="rank 1 failed outside a step: RuntimeError: again"):
            while time.monotonic() < deadline:
                bc.publish(make_plan(0))
                rx.recv()


def test_close_wakes_a_waiting_reader() -> None:
    bc = PlanBroadcaster(1)
    with PlanReceiver(bc.handle, 1) as rx:
        bc.wait_for_readers(10)
        bc.close()
        with pytest.raises(ChannelClosed, match="rank 0 closed the channel"):
            rx.recv(timeout_s=10)
    assert_nothing_left(bc.handle)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        PlanBroadcaster(1, slot_bytes=8)
    with PlanBroadcaster(2) as bc:
        for rank in (0, 3):
            with pytest.raises(ValueError, match=r"1\.\.2"):
                PlanReceiver(bc.handle, rank)
    assert_nothing_left(bc.handle)


# -- real processes --------------------------------------------------------------------------------


@pytest.mark.slow
def test_thousands_of_random_plans_reach_three_readers(procs: list) -> None:
    num_steps = 3000
    with PlanBroadcaster(3, slot_bytes=SLOT_BYTES, num_slots=4, timeout_s=30.0) as bc:
        readers = start_readers(procs, bc.handle, [1, 2, 3], num_steps=num_steps)
        bc.wait_for_readers(60)
        oversized = 0
        for step in range(num_steps):
            plan = make_plan(step)
            oversized += plan.encoded_size() > SLOT_BYTES
            bc.publish(plan)
        bc.publish(StepPlan.exit(num_steps))
        assert join_all(readers, 60) == {1: EXIT_OK, 2: EXIT_OK, 3: EXIT_OK}
        assert bc.poll_errors() == []
        assert 0.2 * num_steps < oversized < 0.8 * num_steps  # both paths well exercised
    assert_nothing_left(bc.handle)


@pytest.mark.slow
def test_slow_reader_blocks_the_writer_but_loses_nothing(procs: list) -> None:
    num_steps, num_slots, delay_s = 120, 2, 0.005
    with PlanBroadcaster(2, slot_bytes=SLOT_BYTES, num_slots=num_slots) as bc:
        readers = start_readers(procs, bc.handle, [1, 2], num_steps=num_steps, delay_s={2: delay_s})
        bc.wait_for_readers(60)
        start = time.monotonic()
        for step in range(num_steps):
            bc.publish(make_plan(step))
        elapsed = time.monotonic() - start
        bc.publish(StepPlan.exit(num_steps))
        assert join_all(readers, 60) == {1: EXIT_OK, 2: EXIT_OK}
    # The writer can run at most num_slots plans ahead of the sleeping reader, so the sleeps
    # bound the publishing time from below (a sleep never returns early).
    assert elapsed >= (num_steps - num_slots - 1) * delay_s
    assert_nothing_left(bc.handle)


@pytest.mark.slow
def test_killed_reader_is_reported_quickly_by_rank(procs: list) -> None:
    with PlanBroadcaster(2, slot_bytes=SLOT_BYTES, timeout_s=60.0) as bc:
        readers = start_readers(procs, bc.handle, [1, 2], num_steps=10_000, die_at={2: 50})
        bc.wait_for_readers(60)
        start = time.monotonic()
        with pytest.raises(
            ReaderDiedError, match=r"rank 2 \(pid \d+\) died without acknowledging step"
        ) as err:
            for step in range(10_000):
                bc.publish(make_plan(step))
        assert err.value.rank == 2 and err.value.step_id is not None and err.value.step_id >= 50
        assert time.monotonic() - start < 20  # far below the 60 s timeout: found by pid, not time
        assert readers[2].exitcode in (None, -signal.SIGKILL)
    assert join_all(readers, 20) == {1: EXIT_CLOSED, 2: -signal.SIGKILL}
    assert_nothing_left(bc.handle)


@pytest.mark.slow
def test_stuck_reader_times_out_naming_rank_and_step(procs: list) -> None:
    with PlanBroadcaster(2, slot_bytes=SLOT_BYTES, num_slots=2, timeout_s=1.0) as bc:
        readers = start_readers(procs, bc.handle, [1, 2], num_steps=10_000)
        bc.wait_for_readers(60)
        os.kill(readers[1].pid, signal.SIGSTOP)  # alive but not acknowledging anything
        try:
            start = time.monotonic()
            with pytest.raises(
                ChannelTimeout, match=r"waited 1.0 s for rank 1 to acknowledge step 0"
            ):
                for step in range(100):
                    bc.publish(make_plan(step))
            assert time.monotonic() - start < 15
        finally:
            readers[1].kill()  # SIGKILL also ends a stopped process
    assert join_all(readers, 20) == {1: -signal.SIGKILL, 2: EXIT_CLOSED}
    assert_nothing_left(bc.handle)


@pytest.mark.slow
def test_worker_error_report_reaches_rank_0(procs: list) -> None:
    with PlanBroadcaster(2, slot_bytes=SLOT_BYTES, timeout_s=60.0) as bc:
        readers = start_readers(procs, bc.handle, [1, 2], num_steps=10_000, fail_at={2: 5})
        bc.wait_for_readers(60)
        with pytest.raises(
            WorkerError, match="rank 2 failed at step 5: ValueError: boom at step 5"
        ) as err:
            for step in range(10_000):
                bc.publish(make_plan(step))
        report = err.value.report
        assert (report.rank, report.step_id, report.type) == (2, 5, "ValueError")
        assert "reader_main" in report.traceback  # the worker's own traceback came across
    assert join_all(readers, 20) == {1: EXIT_CLOSED, 2: EXIT_REPORTED}
    assert_nothing_left(bc.handle)


@pytest.mark.slow
@pytest.mark.parametrize("handshake", [True, False], ids=["running", "during-start-up"])
def test_killed_rank_0_makes_readers_exit(procs: list, handshake: bool) -> None:
    recv_end, send_end = SPAWN.Pipe(duplex=False)
    writer = SPAWN.Process(target=writer_main, args=(send_end, 2, 200, handshake))
    writer.start()
    procs.append(writer)
    handle = ChannelHandle.from_bytes(recv_end.recv_bytes())
    readers = start_readers(procs, handle, [1, 2], num_steps=10_000)
    writer.join(60)
    assert writer.exitcode == -signal.SIGKILL
    died = time.monotonic()
    # Without a handshake the readers are the only ones who can remove rank 0's names.
    assert join_all(readers, 30) == {1: EXIT_OWNER_DIED, 2: EXIT_OWNER_DIED}
    assert time.monotonic() - died < 20
    assert_nothing_left(handle)


@pytest.mark.slow
def test_check_readers_notices_a_dead_reader_without_a_full_ring(procs: list) -> None:
    with PlanBroadcaster(1, num_slots=8, timeout_s=60.0) as bc:
        readers = start_readers(procs, bc.handle, [1], num_steps=10_000, die_at={1: 2})
        bc.wait_for_readers(60)
        for step in range(3):
            bc.publish(make_plan(step))  # the ring never fills, so publish cannot notice
        readers[1].join(30)
        assert readers[1].exitcode == -signal.SIGKILL
        with pytest.raises(
            ReaderDiedError, match=r"rank 1 \(pid \d+\) died \(last step published: 2\)"
        ):
            bc.check_readers()
    assert_nothing_left(bc.handle)
