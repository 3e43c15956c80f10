"""The back channel, workers → rank 0: a hello at start-up, then exception reports (and, from
ranks on other nodes, an ack per message).

Ownership: rank 0 binds one PULL socket in the run directory (`BackChannelReader`), and on TCP
too when some ranks are on other nodes; every worker connects a PUSH socket to it
(`BackChannelWriter`). PUSH queues rather than drops, so a hello or a
report sent before the connection is up waits in the worker's queue instead of being lost, and
closing the writer lingers briefly so that a report sent just before a worker exits still
arrives. Messages are `shm_ipc.wire` records (typed msgpack maps, nothing is unpickled) tagged
by their class name under "kind":

    {"kind": "ReaderHello", "rank": int, "pid": int}
    {"kind": "WorkerErrorReport", "rank": int, "step_id": int | None, "type": str,
     "message": str, "traceback": str}
    {"kind": "ReaderAck", "rank": int, "seq": int}     (remote ranks only: `shm_ipc.remote`)

The hello registers the worker's pid, which rank 0 watches while it waits for acknowledgements,
so a dead worker is noticed in a fraction of a second rather than at the end of a timeout.
"""

from __future__ import annotations

import logging
import traceback

import zmq

from shm_ipc import wire

logger = logging.getLogger(__name__)

# How long a closing worker keeps trying to deliver queued reports (rank 0 may be dead).
_WRITER_LINGER_MS = 500


class WorkerErrorReport(wire.Message, frozen=True):
    """An exception raised on a worker, as rank 0 receives it."""

    rank: int
    step_id: int | None  # None: raised outside a step (start-up, weight loading, ...)
    type: str  # exception class name, e.g. "ValueError"
    message: str  # str(exc)
    traceback: str  # the formatted traceback, as the worker printed it

    @classmethod
    def from_exception(
        cls, rank: int, step_id: int | None, exc: BaseException
    ) -> WorkerErrorReport:
        return cls(
            rank=rank,
            step_id=step_id,
            type=type(exc).__name__,
            message=str(exc),
            traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        )


class ReaderHello(wire.Message, frozen=True):
    """A worker has mapped the ring and connected its sockets."""

    rank: int
    pid: int


class ReaderAck(wire.Message, frozen=True):
    """A rank on another node holds message `seq` (the ring's ack, for a reader without it)."""

    rank: int
    seq: int


BackMessage = WorkerErrorReport | ReaderHello | ReaderAck
_DECODER = wire.decoder(BackMessage)


def decode_back_message(data: bytes) -> BackMessage:
    """Parse one back-channel message; raises ValueError on anything malformed."""
    return wire.decode(_DECODER, data, ValueError, "malformed back-channel message")


class BackChannelReader:
    """Rank 0's end: a PULL socket bound at `path` (and on `tcp_url` too, when given: its
    address is then `tcp_address`), read without blocking."""

    def __init__(self, ctx: zmq.Context, path: str, tcp_url: str | None = None):
        self.socket = ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.tcp_address = ""
        try:
            self.socket.bind(f"ipc://{path}")
            if tcp_url is not None:
                self.socket.bind(tcp_url)
                self.tcp_address = self.socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        except BaseException:
            self.socket.close()
            raise

    def poll(self, timeout_s: float = 0.0) -> list[BackMessage]:
        """Every message that has arrived, waiting up to `timeout_s` for the first one.

        A malformed message is logged and dropped: it can only come from a bug in this package,
        and losing rank 0 to a garbled error report would hide the error it was reporting.
        """
        messages: list[BackMessage] = []
        if not self.socket.poll(int(timeout_s * 1000)):
            return messages
        while True:
            try:
                data = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            try:
                messages.append(decode_back_message(data))
            except ValueError as exc:
                logger.warning("dropping a back-channel message: %s", exc)

    def close(self) -> None:
        self.socket.close(linger=0)


class BackChannelWriter:
    """A worker's end: a PUSH socket connected to rank 0's PULL socket at `endpoint`
    (`ipc://...` on rank 0's node, `tcp://...` on the others)."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, _WRITER_LINGER_MS)
        try:
            self.socket.connect(endpoint)
        except BaseException:
            self.socket.close(linger=0)
            raise

    def send(self, message: BackMessage) -> bool:
        """Queue a message without blocking; False if it could not be queued (rank 0 gone and
        the queue full), since a worker that is failing must not hang on its own report."""
        try:
            self.socket.send(wire.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not queue %s for rank 0", type(message).__name__)
            return False
        return True

    def close(self) -> None:
        self.socket.close()  # lingers _WRITER_LINGER_MS for queued reports
