"""Rank 0's end of the plan channel: `PlanBroadcaster`. Protocol in `channel.py`, layout in
`ring.py`.

Ownership: rank 0 builds a `StepPlan` per step (and, between steps, a `ControlCall` now and
then) and hands it to `publish`, which encodes it straight into a ring slot (or into the
doorbell when it is bigger than a slot) and returns once the doorbell is sent; it blocks only
when the ring is full, i.e. while the slowest reader is `num_slots` messages behind. Ranks on
other nodes (`remote_readers`) get each message whole over TCP (`remote.py`) under the same
bound, and are watched by heartbeats (`heartbeat.py`) instead of pids.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence

import xxhash
import zmq

from shm_ipc.channel import CHECK_INTERVAL_S, DOORBELL, DoorbellKind, term_context
from shm_ipc.control_call import ControlCall
from shm_ipc.error_channel import BackChannelReader, ReaderAck, ReaderHello, WorkerErrorReport
from shm_ipc.errors import ChannelError, ChannelTimeout, ReaderDiedError, WorkerError
from shm_ipc.handle import ChannelHandle, RunNames, remove_names
from shm_ipc.heartbeat import HeartbeatHub
from shm_ipc.liveness import ProcessWatch
from shm_ipc.remote import RemoteFanout, announce_host, tcp_url
from shm_ipc.ring import ShmRing, SlotHeader, Where
from shm_ipc.step_plan import StepPlan

logger = logging.getLogger(__name__)

# Rank 0 polls acks with exponential back-off up to this sleep: on a GPU run the ring is almost
# never full (ranks move in lockstep through their collectives), so the back-off bounds the cost
# of the rare wait without spinning a core that a worker may need.
_MAX_BACKOFF_S = 1e-3
# How long `close` keeps trying to deliver the CLOSE doorbell to live readers.
_CLOSE_LINGER_MS = 500
# After finding a reader dead, how long to wait for the error report it may have sent just
# before dying (a report says far more than "rank 2 died").
_LAST_REPORT_WAIT_S = 0.2


def _remove_names_if_creator(creator_pid: int, names: RunNames) -> None:
    # A forked child inherits this finalizer; only the process that made the names removes them.
    if os.getpid() == creator_pid:
        remove_names(names.shm_name, (names.plan_socket, names.back_socket), names.run_dir)


class _RemoteWatch:
    """A rank on another node, as the heartbeat hub sees it (the `ProcessWatch` interface)."""

    def __init__(self, hub: HeartbeatHub, rank: int):
        self.hub = hub
        self.rank = rank
        hub.expect(rank)

    def alive(self) -> bool:
        return self.hub.alive(self.rank)


class PlanBroadcaster:
    """Sends every `StepPlan` to `num_readers` workers (ranks 1..num_readers).

    Use: build, send `handle.to_bytes()` to the workers, `wait_for_readers()`, then `publish`
    each plan; `poll_errors()` between steps; `close()` (or use it as a context manager).
    `timeout_s` bounds every wait for a reader; a dead reader is reported sooner. Not
    thread-safe: one thread (the engine loop) owns it.

    `remote_readers`: the ranks on other nodes than this one (they get every message over TCP
    on `host`, `remote.announce_host()` by default); `nodes`: every rank's node, by rank, for
    the messages that name a rank.
    """

    def __init__(
        self,
        num_readers: int,
        *,
        remote_readers: Sequence[int] = (),
        nodes: Sequence[int] = (),
        host: str | None = None,
        slot_bytes: int = 1 << 20,
        num_slots: int = 4,
        timeout_s: float = 30.0,
    ):
        remote = tuple(sorted(set(remote_readers)))
        if any(not 1 <= rank <= num_readers for rank in remote):
            raise ValueError(f"remote_readers {list(remote)} must be in 1..{num_readers}")
        if num_readers < 0:
            raise ValueError(f"num_readers must be >= 0, got {num_readers}")
        if slot_bytes < 64 or num_slots < 1:
            raise ValueError(
                f"need slot_bytes >= 64 and num_slots >= 1, got {slot_bytes}, {num_slots}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._ring: ShmRing | None = None
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._back: BackChannelReader | None = None
        self._fanout: RemoteFanout | None = None
        self._hub: HeartbeatHub | None = None
        self._closed = False
        self._ready = False
        names = RunNames.create()
        # Registered before anything can fail, so that a failed constructor, a forgotten close()
        # and interpreter exit all remove the names too (SIGKILL is covered by the handshake).
        self._remove_names = weakref.finalize(self, _remove_names_if_creator, os.getpid(), names)
        try:
            self._ring = ShmRing.create(
                names.shm_name,
                num_slots=num_slots,
                num_readers=num_readers - len(remote),
                slot_bytes=slot_bytes,
                owner_pid=os.getpid(),
            )
            self._ctx = zmq.Context()
            self._pub = self._ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # report every subscriber (handshake)
            self._pub.setsockopt(zmq.SNDHWM, 0)  # never drop; the ring bounds what is in flight
            self._pub.bind(f"ipc://{names.plan_socket}")
            if remote:
                host = announce_host() if host is None else host
                self._back = BackChannelReader(self._ctx, names.back_socket, tcp_url(host))
                self._fanout = RemoteFanout(self._ctx, host, remote)
                self._hub = HeartbeatHub(host)
            else:
                self._back = BackChannelReader(self._ctx, names.back_socket)
        except BaseException:
            self.close()
            raise
        self.handle = ChannelHandle(
            shm_name=names.shm_name,
            plan_socket=names.plan_socket,
            back_socket=names.back_socket,
            run_dir=names.run_dir,
            owner_pid=os.getpid(),
            slot_bytes=slot_bytes,
            num_slots=num_slots,
            num_readers=num_readers,
            remote_readers=remote,
            remote_plan_address="" if self._fanout is None else self._fanout.address,
            remote_back_address=self._back.tcp_address,
            heartbeat_address="" if self._hub is None else self._hub.address,
            nodes=tuple(nodes),
        )
        self._watches: dict[
            int, ProcessWatch | _RemoteWatch
        ] = {}  # rank -> its process, from its hello
        self._reports: list[WorkerErrorReport] = []  # every report, in order of arrival
        self._reports_taken = 0  # how many of them were returned or raised
        self._back_lock = threading.RLock()
        self._next_seq = 1
        self._slot_steps: list[int | None] = [None] * num_slots  # step last written per slot

    # -- start-up --------------------------------------------------------------------------

    def wait_for_readers(self, timeout_s: float | None = None) -> None:
        """Handshake: wait until every reader has said hello and subscribed, then remove every
        file-system name of the run. Idempotent. Raises `ChannelTimeout` naming the missing
        ranks, `ReaderDiedError` or `WorkerError`."""
        if self._ready:
            return
        pub, back, n = self._live_pub(), self._live_back(), self.handle.num_readers
        n_local, fanout = self.handle.ring_readers, self._fanout
        n_remote = 0 if fanout is None else len(fanout.ranks)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(pub, zmq.POLLIN)
        poller.register(back.socket, zmq.POLLIN)
        subscribed = 0
        while (
            subscribed < n_local
            or (fanout is not None and fanout.subscribed < n_remote)
            or len(self._watches) < n
        ):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(1, n + 1)) - self._watches.keys())
                remote_subs = (
                    "" if fanout is None else f", {fanout.subscribed} of {n_remote} remote"
                )
                raise ChannelTimeout(
                    f"rank 0 waited {timeout} s for readers to attach: no hello from ranks "
                    f"{missing}{self._nodes_note(missing)}; {subscribed} of {n_local} doorbell "
                    f"subscriptions{remote_subs}",
                    rank=missing[0] if missing else None,
                )
            poller.poll(int(min(remaining, CHECK_INTERVAL_S) * 1000) + 1)
            while True:
                try:
                    msg = pub.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                subscribed += msg[:1] == b"\x01"  # b"\x00" would be an unsubscription
            if fanout is not None:
                fanout.count_subscriptions()
            self._drain_back_channel()
            self._raise_reported_error()
            for rank in list(self._watches):  # a copy: _check_alive may register new hellos
                self._check_alive(rank, "while attaching")
        self._ready = True
        self._remove_names()  # every reader has mapped the ring and connected: names not needed
        if fanout is not None:
            for node, ranks in self._ranks_by_node(fanout.ranks).items():
                logger.info(
                    "node %d ready: ranks %s get plans over %s", node, ranks, fanout.address
                )

    # -- steady state ----------------------------------------------------------------------

    def publish(self, plan: StepPlan | ControlCall) -> None:
        """Send `plan` (a StepPlan or a ControlCall) to every reader, after every message
        published before it. Blocks only while the ring is full.

        Raises `ValueError` for a plan whose shapes or dtypes disagree (or a call whose header
        does not fit); `WorkerError` as soon as
        any worker has reported an exception (it will not acknowledge again, so going on could
        only hang); `ReaderDiedError` when a reader it waits for is gone; `ChannelTimeout` after
        `timeout_s` on one slot.
        """
        ring, pub = self._live_ring(), self._live_pub()
        if not self._ready:
            raise ChannelError("rank 0: publish() before wait_for_readers()")
        # A malformed plan is rank 0's bug: raise it here (ValueError naming the field) rather
        # than silently casting a wrong dtype into the slot or failing to decode on every worker.
        plan.validate()
        self._drain_back_channel()
        self._raise_reported_error()
        seq = self._next_seq
        slot = ring.slot_of(seq)
        if not ring.is_free(slot):
            self._wait_slot_free(slot, plan.step_id)
        fanout = self._fanout
        if fanout is not None and fanout.lagging(seq, ring.num_slots):
            self._wait_remote_acks(fanout, seq, plan.step_id)
        # Encode first, so that a plan that fails to encode leaves the slot FREE (acks still 1).
        size = plan.encoded_size()
        kind = DoorbellKind.CONTROL if isinstance(plan, ControlCall) else DoorbellKind.PLAN
        frames: list[bytes] = [DOORBELL.pack(kind, seq)]
        data = b""
        if size <= ring.slot_bytes:
            with ring.payload_view(slot, size) as buf:
                plan.encode_into(buf)  # straight into shared memory, no intermediate copy
                checksum = xxhash.xxh3_64_intdigest(buf)
                if fanout is not None:
                    data = bytes(buf)
            where = Where.SLOT
        else:
            data = plan.encode()
            checksum = xxhash.xxh3_64_intdigest(data)
            where = Where.DOORBELL
            frames.append(data)
        ring.reset_acks(slot)  # before the doorbell: see ring.py, rule 2
        ring.write_header(slot, SlotHeader(seq, plan.step_id, size, checksum, where))
        pub.send_multipart(frames, copy=False)  # publishes: see ring.py, rule 3
        if fanout is not None:
            fanout.send(frames[0], plan.step_id, data, checksum)
        self._slot_steps[slot] = plan.step_id
        self._next_seq = seq + 1

    def poll_errors(self) -> list[WorkerErrorReport]:
        """Error reports from workers that arrived since the last call; never blocks. Safe to
        call from another thread (the server's watchdog) while the owner thread publishes."""
        with self._back_lock:
            self._drain_back_channel()
            errors = self._reports[self._reports_taken :]
            self._reports_taken = len(self._reports)
        return errors

    def reports_seen(self) -> list[WorkerErrorReport]:
        """Every error report that has arrived, whoever took it (`poll_errors`, a raised
        `WorkerError`); never blocks. For a diagnosis on another thread (the server's watchdog)
        while the owner thread may be weighing the same reports."""
        with self._back_lock:
            self._drain_back_channel()
            return list(self._reports)

    def dead_readers(self) -> list[int]:
        """Ranks whose process is gone, in rank order; never blocks, reads no reports."""
        return [rank for rank, watch in sorted(self._watches.items()) if not watch.alive()]

    def check_readers(self) -> None:
        """Raise `WorkerError` if a worker has reported an exception, `ReaderDiedError` if a
        reader's process is gone; never blocks (except briefly to collect a dead reader's last
        report). `publish` only notices a silent death once the ring is full; call this when
        rank 0 itself is about to wait on the workers, e.g. before a collective."""
        self._drain_back_channel()
        self._raise_reported_error()
        for rank in list(self._watches):
            self._check_alive(rank, f"(last step published: {self._last_step_published()})")

    # -- waits and checks ------------------------------------------------------------------

    def _last_step_published(self) -> int | None:
        if self._next_seq == 1:
            return None
        return self._slot_steps[self._live_ring().slot_of(self._next_seq - 1)]

    def _wait_slot_free(self, slot: int, next_step: int) -> None:
        ring = self._live_ring()
        old_step = self._slot_steps[slot]
        start = time.monotonic()
        deadline = start + self.timeout_s
        next_check = start + CHECK_INTERVAL_S
        delay = 20e-6
        while not ring.is_free(slot):
            now = time.monotonic()
            if now >= next_check or now >= deadline:
                self._drain_back_channel()
                self._raise_reported_error()
                pending = [self.handle.ring_rank(i) for i in ring.pending_readers(slot)]
                for rank in pending:
                    self._check_alive(rank, f"without acknowledging step {old_step}", old_step)
                if pending and now >= deadline:
                    raise ChannelTimeout(
                        f"rank 0 waited {self.timeout_s} s for rank {pending[0]} to acknowledge "
                        f"step {old_step} (pending ranks {pending}; needed to publish step "
                        f"{next_step})",
                        rank=pending[0],
                        step_id=old_step,
                    )
                next_check = now + CHECK_INTERVAL_S
            time.sleep(delay)
            delay = min(2 * delay, _MAX_BACKOFF_S)

    def _wait_remote_acks(self, fanout: RemoteFanout, seq: int, next_step: int) -> None:
        """Hold message `seq` until every remote rank holds `seq - num_slots` (the ring's
        bound, kept by acks for the readers without a ring)."""
        num_slots = self._live_ring().num_slots
        deadline = time.monotonic() + self.timeout_s
        while lagging := fanout.lagging(seq, num_slots):
            self._drain_back_channel(timeout_s=CHECK_INTERVAL_S)
            self._raise_reported_error()
            for rank in lagging:
                self._check_alive(rank, f"without acknowledging message {seq - num_slots}")
            if time.monotonic() >= deadline and fanout.lagging(seq, num_slots):
                rank = lagging[0]
                raise ChannelTimeout(
                    f"rank 0 waited {self.timeout_s} s for {self.handle.name(rank)} to "
                    f"acknowledge message {seq - num_slots} (needed to publish step {next_step})",
                    rank=rank,
                )

    def _check_alive(self, rank: int, doing: str, step_id: int | None = None) -> None:
        watch = self._watches[rank]
        if watch.alive():
            return
        # A worker that failed usually reports, then exits: prefer its report to "it died".
        self._drain_back_channel(timeout_s=_LAST_REPORT_WAIT_S)
        self._raise_reported_error()
        if isinstance(watch, _RemoteWatch):
            raise ReaderDiedError(
                f"{self.handle.name(rank)} is gone {doing}: {watch.hub.why_gone(rank)}",
                rank=rank,
                step_id=step_id,
            )
        raise ReaderDiedError(
            f"rank {rank} (pid {watch.pid}) died {doing}", rank=rank, step_id=step_id
        )

    def describe(self, ranks: Sequence[int]) -> str:
        """ "rank 1 and rank 3", or "rank 1 and ranks 2 and 3 (node 1)" when the run spans
        nodes: how messages name `ranks`."""
        if not self.handle.remote_readers:
            return " and ".join(f"rank {rank}" for rank in ranks)
        parts = []
        for node, group in self._ranks_by_node(ranks).items():
            names = " and ".join(str(rank) for rank in group)
            parts.append(f"rank{'s' if len(group) > 1 else ''} {names} (node {node})")
        return " and ".join(parts)

    def _ranks_by_node(self, ranks: Sequence[int]) -> dict[int, list[int]]:
        by_node: dict[int, list[int]] = {}
        for rank in ranks:
            by_node.setdefault(self.handle.node_of(rank), []).append(rank)
        return by_node

    def _nodes_note(self, ranks: Sequence[int]) -> str:
        if not self.handle.remote_readers or not ranks:
            return ""
        parts = [f"node {node}: ranks {rs}" for node, rs in self._ranks_by_node(ranks).items()]
        return f" ({'; '.join(parts)})"

    def _drain_back_channel(self, timeout_s: float = 0.0) -> None:
        # A zmq socket is not thread-safe: one reader at a time (re-entrant for poll_errors).
        with self._back_lock:
            for msg in self._live_back().poll(timeout_s):
                if isinstance(msg, ReaderAck):
                    if self._fanout is not None:
                        self._fanout.ack(msg.rank, msg.seq)
                elif isinstance(msg, ReaderHello):
                    self._register(msg)
                else:
                    self._reports.append(msg)

    def _register(self, hello: ReaderHello) -> None:
        n = self.handle.num_readers
        if not 1 <= hello.rank <= n:
            raise ChannelError(f"rank 0 got a hello from rank {hello.rank}; readers are 1..{n}")
        known = self._watches.get(hello.rank)
        if self._ready or (known is not None and known.pid != hello.pid):
            raise ChannelError(
                f"rank 0 got a second hello from rank {hello.rank} (pid {hello.pid}): two "
                "workers share a rank, or a worker restarted, which this channel cannot follow",
                rank=hello.rank,
            )
        if self._hub is not None and self.handle.is_remote(hello.rank):
            # Its pid means nothing here: another node's process table.
            self._watches[hello.rank] = _RemoteWatch(self._hub, hello.rank)
        else:
            self._watches[hello.rank] = ProcessWatch(hello.pid)

    def _raise_reported_error(self) -> None:
        if self._reports_taken < len(self._reports):
            self._reports_taken += 1
            raise WorkerError(self._reports[self._reports_taken - 1])

    def _live_ring(self) -> ShmRing:
        if self._closed or self._ring is None:
            raise ChannelError("rank 0: the plan channel is closed")
        return self._ring

    def _live_pub(self) -> zmq.Socket:
        self._live_ring()
        assert self._pub is not None  # set whenever the ring is
        return self._pub

    def _live_back(self) -> BackChannelReader:
        self._live_ring()
        assert self._back is not None
        return self._back

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Tell live readers the channel is closed, release everything. Idempotent.

        Send `StepPlan.exit(...)` first for an orderly shutdown: CLOSE makes a reader's `recv`
        raise `ChannelClosed`, which a worker should treat as an error exit.
        """
        if self._closed:
            return
        self._closed = True
        close_doorbell = DOORBELL.pack(DoorbellKind.CLOSE, self._next_seq)
        if self._pub is not None:
            # Best effort: a reader that misses it notices rank 0's exit instead.
            with contextlib.suppress(zmq.ZMQError):
                self._pub.send(close_doorbell, zmq.NOBLOCK)
            self._pub.close(linger=_CLOSE_LINGER_MS)
        if self._fanout is not None:
            self._fanout.close(close_doorbell, _CLOSE_LINGER_MS)
        if self._hub is not None:
            self._hub.close()
        if self._back is not None:
            self._back.close()
        if self._ctx is not None:
            term_context(self._ctx, "rank 0 plan channel")
        if self._ring is not None:
            self._ring.close()
        self._remove_names()

    def __enter__(self) -> PlanBroadcaster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
