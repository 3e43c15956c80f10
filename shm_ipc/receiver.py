"""A worker's end of the plan channel: `PlanReceiver`. Protocol in `channel.py`, layout in
`ring.py`.

Ownership: `recv` returns a `StepPlan` whose arrays are read-only views into a private copy of
the payload, not into shared memory (or a `ControlCall`, whose args are decoded from that copy). The copy is made, the slot acknowledged at once, and the
checksum verified on the copy: rank 0 gets the slot back without waiting for the forward pass,
the plan stays valid for as long as the caller keeps it, and a plan that is not exactly what
rank 0 wrote cannot get through. The copy costs microseconds (plans are kilobytes to a few
hundred kilobytes), against milliseconds for the forward pass it feeds.

A rank on another node than rank 0 (`handle.is_remote`) has no ring: it gets each message whole
over TCP (`remote.py`), acknowledges it on the back channel, and knows rank 0 alive by its
heartbeats (`heartbeat.py`) rather than its pid. Everything after the bytes arrive (the seq,
length and checksum checks, the decode) is the same code for both.
"""

from __future__ import annotations

import os
import time

import xxhash
import zmq

from shm_ipc.channel import DOORBELL, OWNER_CHECK_INTERVAL_S, DoorbellKind, term_context
from shm_ipc.control_call import ControlCall, ControlDecodeError
from shm_ipc.error_channel import BackChannelWriter, ReaderAck, ReaderHello, WorkerErrorReport
from shm_ipc.errors import (
    ChannelClosed,
    ChannelError,
    ChannelTimeout,
    CorruptMessageError,
    OwnerDiedError,
)
from shm_ipc.handle import ChannelHandle, remove_handle_names
from shm_ipc.heartbeat import HeartbeatLink
from shm_ipc.liveness import ProcessWatch
from shm_ipc.remote import REMOTE_HEADER
from shm_ipc.ring import ShmRing, Where
from shm_ipc.step_plan import PlanDecodeError, StepPlan


class PlanReceiver:
    """Receives every plan rank 0 publishes, in order. `rank` is 1..handle.num_readers.

    The constructor maps the ring, connects and says hello; it does not block (rank 0's
    `wait_for_readers` completes the handshake). Close it, or use it as a context manager.
    Not thread-safe: one thread (the worker loop) owns it.
    """

    def __init__(self, handle: ChannelHandle, rank: int):
        if not 1 <= rank <= handle.num_readers:
            raise ValueError(f"reader rank must be in 1..{handle.num_readers}, got {rank}")
        self.handle = handle
        self.rank = rank
        self.remote = handle.is_remote(rank)
        self._ring_index = handle.ring_index(rank)  # this reader's ack byte in every slot
        self._ring: ShmRing | None = None
        self._ctx: zmq.Context | None = None
        self._sub: zmq.Socket | None = None
        self._back: BackChannelWriter | None = None
        self._closed = False
        self._next_seq = 1
        self._last_step: int | None = None  # step of the last plan received, for errors
        self._owner: ProcessWatch | HeartbeatLink
        if self.remote:
            self._connect_remote()
            return
        self._owner = ProcessWatch(handle.owner_pid)
        if not self._owner.alive():
            self._owner_died()
        try:
            self._ring = ShmRing.attach(
                handle.shm_name,
                num_slots=handle.num_slots,
                num_readers=handle.ring_readers,
                slot_bytes=handle.slot_bytes,
                owner_pid=handle.owner_pid,
            )
        except FileNotFoundError:
            if not self._owner.alive():  # died since the check above; a reader cleaned up
                self._owner_died()
            raise ChannelError(
                f"rank {rank}: {handle.shm_path} does not exist: rank 0 already finished its "
                "handshake (is another worker using this rank?) or is not running",
                rank=rank,
            ) from None
        try:
            self._ctx = zmq.Context()
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop; the ring bounds what is in flight
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.connect(f"ipc://{handle.plan_socket}")
            self._back = BackChannelWriter(self._ctx, f"ipc://{handle.back_socket}")
            # Sent after the ring is mapped and both sockets connect: once rank 0 has every
            # hello (and subscription) it removes the names these steps need.
            self._back.send(ReaderHello(rank=rank, pid=os.getpid()))
        except BaseException:
            self.close()
            raise

    def _connect_remote(self) -> None:
        """A rank on another node: TCP sockets and a heartbeat link to rank 0, no ring."""
        handle = self.handle
        try:
            self._owner = HeartbeatLink(handle.heartbeat_address, self.rank)
            self._ctx = zmq.Context()
            self._sub = self._ctx.socket(zmq.SUB)
            self._sub.setsockopt(zmq.SUBSCRIBE, b"")
            self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop; acks bound what is in flight
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.connect(handle.remote_plan_address)
            self._back = BackChannelWriter(self._ctx, handle.remote_back_address)
            self._back.send(ReaderHello(rank=self.rank, pid=os.getpid()))
        except BaseException:
            self.close()
            raise

    def owner_alive(self) -> bool:
        """Whether rank 0 is still there (safe to call from another thread)."""
        return self._owner.alive()

    @property
    def last_step_id(self) -> int | None:
        return self._last_step

    def recv(self, timeout_s: float | None = None) -> StepPlan | ControlCall:
        """The next message (a plan or a control call), in publish order. Blocks until it
        comes: being idle is normal.

        Raises `OwnerDiedError` within about `OWNER_CHECK_INTERVAL_S` of rank 0 dying,
        `ChannelClosed` if rank 0 closed the channel, `CorruptMessageError` on a sequence,
        length or checksum mismatch, and `ChannelTimeout` only if `timeout_s` is given.
        """
        self._check_open()
        frames = self._wait_doorbell(timeout_s)
        if len(frames[0]) != DOORBELL.size:
            raise self._corrupt(f"a {len(frames[0])}-byte doorbell")
        kind, seq = DOORBELL.unpack(frames[0])
        if kind == DoorbellKind.CLOSE:
            raise ChannelClosed(
                f"rank {self.rank}: rank 0 closed the channel after step {self._last_step}",
                rank=0,
                step_id=self._last_step,
            )
        if kind not in (DoorbellKind.PLAN, DoorbellKind.CONTROL) or seq != self._next_seq:
            raise self._corrupt(
                f"doorbell kind {kind} for message {seq}, expected {self._next_seq}"
            )
        if self._ring is None:
            data, step, length, checksum = self._take_remote(seq, frames)
            where = "over tcp"
        else:
            data, step, length, checksum = self._take_from_ring(self._ring, seq, frames)
            where = f"(slot {self._ring.slot_of(seq)})"
        self._next_seq = seq + 1
        if len(data) != length or xxhash.xxh3_64_intdigest(data) != checksum:
            raise self._corrupt(f"checksum mismatch in message {seq} {where}", step)
        try:
            if kind == DoorbellKind.CONTROL:
                plan: StepPlan | ControlCall = ControlCall.decode(data)
            else:
                plan = StepPlan.decode(data)
        except (PlanDecodeError, ControlDecodeError) as exc:
            raise self._corrupt(f"payload does not decode: {exc}", step) from exc
        if plan.step_id != step:
            raise self._corrupt(f"payload is step {plan.step_id}, slot header says {step}", step)
        self._last_step = step
        return plan

    def _take_from_ring(
        self, ring: ShmRing, seq: int, frames: list[bytes]
    ) -> tuple[bytes, int, int, int]:
        """Message `seq`'s payload, step, length and checksum, from its slot (or its doorbell)."""
        slot = ring.slot_of(seq)
        header = ring.read_header(slot)
        step = header.step_id
        if header.seq != seq:
            raise self._corrupt(f"slot {slot} holds message {header.seq}, the doorbell says {seq}")
        if header.where == Where.SLOT and len(frames) == 1 and header.length <= ring.slot_bytes:
            data = ring.copy_payload(slot, header.length)
            if ring.read_seq(slot) != seq:  # rank 0 overwrote the slot during the copy
                raise self._corrupt(f"slot {slot} was overwritten while being read", step)
        elif header.where == Where.DOORBELL and len(frames) == 2:
            data = frames[1]
        else:
            raise self._corrupt(
                f"slot header where={header.where} length={header.length} with a "
                f"{len(frames)}-frame doorbell",
                step,
            )
        ring.ack(slot, self._ring_index)  # last touch: ring.py, rule 4
        return data, step, header.length, header.checksum

    def _take_remote(self, seq: int, frames: list[bytes]) -> tuple[bytes, int, int, int]:
        """Message `seq` as it came over TCP (`remote.py`), acknowledged to rank 0."""
        if len(frames) != 3 or len(frames[1]) != REMOTE_HEADER.size:
            raise self._corrupt(f"a remote message of {len(frames)} frames")
        step, length, checksum = REMOTE_HEADER.unpack(frames[1])
        assert self._back is not None
        self._back.send(ReaderAck(rank=self.rank, seq=seq))
        return frames[2], step, length, checksum

    def report_error(self, step_id: int | None, exc: BaseException) -> bool:
        """Send `exc` to rank 0 (type, message, traceback) without blocking; False if it could
        not be queued. Call before exiting on an error; `close` lingers to deliver it."""
        back = self._back
        if back is None or self._closed:
            return False
        return back.send(WorkerErrorReport.from_exception(self.rank, step_id, exc))

    # -- waiting ---------------------------------------------------------------------------

    def _wait_doorbell(self, timeout_s: float | None) -> list[bytes]:
        sub = self._sub
        assert sub is not None  # set whenever the ring is
        try:  # fast path: the doorbell is already here (this reader is behind)
            return sub.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            wait_s = OWNER_CHECK_INTERVAL_S
            if deadline is not None:
                wait_s = max(0.0, min(wait_s, deadline - time.monotonic()))
            if sub.poll(int(wait_s * 1000) + 1):
                return sub.recv_multipart()
            # Checked after the poll, so a last plan (EXIT, say) sent just before rank 0 exited
            # is still delivered rather than lost to the death check.
            if not self._owner.alive():
                self._owner_died()
            if deadline is not None and time.monotonic() >= deadline:
                raise ChannelTimeout(
                    f"rank {self.rank} waited {timeout_s} s for the plan after step "
                    f"{self._last_step}",
                    rank=0,
                    step_id=self._last_step,
                )

    def _owner_died(self) -> None:
        if isinstance(self._owner, HeartbeatLink):
            # Nothing of rank 0's is named on this node.
            why = f"rank 0 (node {self.handle.node_of(0)}) is gone: {self._owner.why_gone()}"
        else:
            # Rank 0 can no longer clean up; if it died during start-up its names still exist.
            remove_handle_names(self.handle)
            why = f"rank 0 (pid {self.handle.owner_pid}) is gone"
        raise OwnerDiedError(
            f"rank {self.rank}: {why}; last step received: {self._last_step}",
            rank=0,
            step_id=self._last_step,
        )

    def _corrupt(self, what: str, step_id: int | None = None) -> CorruptMessageError:
        if step_id is not None:
            where = f"step {step_id}"
        elif self._last_step is None:
            where = "the first message"
        else:
            where = f"the message after step {self._last_step}"
        return CorruptMessageError(
            f"rank {self.rank}, {where}: {what}", rank=self.rank, step_id=step_id
        )

    def _check_open(self) -> None:
        if self._closed or self._sub is None:
            raise ChannelError(f"rank {self.rank}: the plan channel is closed", rank=self.rank)

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything (idempotent). Queued error reports get a short linger."""
        if self._closed:
            return
        self._closed = True
        if self._sub is not None:
            self._sub.close(linger=0)
        if self._back is not None:
            self._back.close()
        if self._ctx is not None:
            term_context(self._ctx, "plan receiver")
        if self._ring is not None:
            self._ring.close()
        if isinstance(getattr(self, "_owner", None), HeartbeatLink):
            self._owner.close()

    def __enter__(self) -> PlanReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
