"""The two ZeroMQ pipes between rank 0 and the API process, and the directory they live in.

Rank 0 makes a private (0700) directory per run with a random name (`tpe-srv-*` under
$XDG_RUNTIME_DIR or the temp dir), binds both sockets in it, then starts the API process with
the directory's path. Once the API process has said Ready both connections exist, and rank 0
removes the socket files and the directory (connected ipc sockets outlive their names), so a
crash of either process later leaves nothing in the file system. Message shapes:
`tp_engine.server.messages`.

The PUSH sockets never block the caller: their send queues are unbounded (SNDHWM 0) and
`send` uses NOBLOCK, so the engine loop never waits on a slow API process and an abort can be
sent from a `finally` of a cancelled coroutine. (A PUSH socket without a connected peer has no
queue at all: rank 0's first message, Hello, waits until the API process has connected.)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from shm_ipc.channel import term_context
from shm_ipc.paths import check_socket_path, private_dir
from tp_engine.server.messages import Message, decode, encode

TO_ENGINE = "to_engine.sock"
TO_API = "to_api.sock"


@dataclass(frozen=True)
class RunDir:
    """The private directory holding this run's two sockets."""

    path: str

    @classmethod
    def create(cls) -> RunDir:
        run = cls(private_dir("tpe-srv-"))
        check_socket_path(run.socket(TO_ENGINE), run.path)
        return run

    def socket(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        """Remove the socket files and the directory (idempotent; never removes anything else)."""
        for name in (TO_ENGINE, TO_API):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket(name))
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


def _push(ctx: zmq.Context, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def _pull(ctx: zmq.Context, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


class EnginePipes:
    """Rank 0's ends. `send` may be called from the loop and from the watchdog thread."""

    def __init__(self, run: RunDir) -> None:
        self._ctx = zmq.Context()
        self.inbox = _pull(self._ctx, f"ipc://{run.socket(TO_ENGINE)}", bind=True)
        self._outbox = _push(self._ctx, f"ipc://{run.socket(TO_API)}", bind=True)
        # ZeroMQ sockets are not thread-safe; the lock also gives the memory barrier that
        # moving a socket between threads needs.
        self._send_lock = threading.Lock()

    def send(self, msg: Message) -> bool:
        """Queue `msg` for the API process; False when no API process is connected (it has not
        connected yet, or it died: the loop notices that through its exit status)."""
        with self._send_lock:
            try:
                self._outbox.send(encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                return False
        return True

    def send_once_connected(
        self, msg: Message, keep_waiting: Callable[[], bool], timeout_s: float
    ) -> bool:
        """Send `msg` as soon as the API process has connected (it may still be importing).
        False if it did not within `timeout_s`, or as soon as `keep_waiting()` says to give up
        (the API process died, or a signal asked the server to stop)."""
        deadline = time.monotonic() + timeout_s
        while not self.send(msg):
            if not keep_waiting() or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def recv_nowait(self) -> Message | None:
        try:
            return decode(self.inbox.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def poll(self, timeout_s: float) -> bool:
        return bool(self.inbox.poll(int(timeout_s * 1000)))

    def close(self) -> None:
        with self._send_lock:
            self._outbox.close()
        self.inbox.close()
        term_context(self._ctx, "engine pipes")


class ApiPipes:
    """The API process's ends. `inbox` is a zmq.asyncio socket once `start_async` ran. `send`
    may be called from the event loop and from the request pool's threads (which send a
    request's AddRequest themselves: `EngineClient`)."""

    def __init__(self, run_dir: str) -> None:
        run = RunDir(run_dir)
        self._ctx = zmq.Context()
        self._outbox = _push(self._ctx, f"ipc://{run.socket(TO_ENGINE)}", bind=False)
        self.inbox = _pull(self._ctx, f"ipc://{run.socket(TO_API)}", bind=False)
        # One socket for every sender, so rank 0 reads the messages in the order they were
        # sent (two PUSH sockets are fair-queued: an abort could overtake its AddRequest).
        # ZeroMQ sockets are not thread-safe; the lock also gives the memory barrier that
        # moving a socket between threads needs.
        self._send_lock = threading.Lock()

    def send(self, msg: Message) -> None:
        frame = encode(msg)  # outside the lock: the loop never waits on another's encode
        with self._send_lock:
            self._outbox.send(frame, zmq.NOBLOCK)

    def recv(self, timeout_s: float) -> Message | None:
        """Blocking receive for start-up (before the event loop runs); None on timeout."""
        if not self.inbox.poll(int(timeout_s * 1000)):
            return None
        return decode(self.inbox.recv())

    def async_inbox(self) -> zmq.Socket:
        """The inbox as a zmq.asyncio socket (a view of the same socket; call inside the loop)."""
        import zmq.asyncio

        return zmq.asyncio.Socket.from_socket(self.inbox)

    def close(self) -> None:
        with self._send_lock:
            self._outbox.close()
        self.inbox.close()
        term_context(self._ctx, "API pipes")
