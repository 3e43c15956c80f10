"""Liveness across nodes: one TCP connection per remote rank, with heartbeats both ways.

Pids say nothing across machines (another node's pid is another process, or none), so rank 0
and the ranks on other nodes watch each other through a connection instead:

    rank 0   HeartbeatHub   listens on tcp://HOST:PORT (in the channel handle)
    rank r   HeartbeatLink  connects, sends its rank (4 bytes), then one byte every interval;
                            the hub answers every beat with one byte

A process that dies, SIGKILL included, has its socket closed by its kernel: the peer reads end
of file at once, so a killed rank (or a killed rank 0) is known within one poll, tens of
milliseconds. A node that is cut off or hung sends nothing: the peer declares it gone after
`timeout_s` without a beat (`$TP_ENGINE_NODE_TIMEOUT_S`, 10 s by default: long enough for a
loaded host's scheduling hiccups, short against any request's patience).

Each side runs one daemon thread owning its sockets; the owner thread asks `alive(rank)` (hub)
or `alive()` (link), which read what that thread recorded. Plain sockets rather than ZeroMQ:
ZeroMQ hides which peer's connection closed (ROUTER_NOTIFY is a draft API, off in the wheels),
and that is the one fact wanted here. Nothing is decoded but a 4-byte rank.

The sockets are not authenticated, like torch.distributed's store: bind them to the cluster's
own network (`shm_ipc.remote.announce_host`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import struct
import threading
import time

logger = logging.getLogger(__name__)

ENV_TIMEOUT = "TP_ENGINE_NODE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 10.0
INTERVAL_S = 0.25  # between beats; a quarter second keeps a quiet connection visibly alive
_RANK = struct.Struct("<I")
_BEAT = b"\x01"
_JOIN_TIMEOUT_S = 2.0


def node_timeout_s() -> float:
    """How long a silent peer on another node counts as alive: `$TP_ENGINE_NODE_TIMEOUT_S`."""
    raw = os.environ.get(ENV_TIMEOUT)
    if not raw:
        return DEFAULT_TIMEOUT_S
    value = float(raw)
    if value <= 0:
        raise ValueError(f"{ENV_TIMEOUT} must be positive, got {raw!r}")
    return value


class HeartbeatHub:
    """Rank 0's end: accepts every remote rank's connection and times each one."""

    def __init__(self, host: str, timeout_s: float | None = None):
        self.timeout_s = node_timeout_s() if timeout_s is None else timeout_s
        self._listener = socket.create_server((host, 0))
        self._listener.setblocking(False)
        self.address = f"tcp://{host}:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._seen: dict[int, float] = {}  # rank -> last beat (monotonic)
        self._closed_by_peer: set[int] = set()  # ranks whose connection ended
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat-hub", daemon=True)
        self._thread.start()

    def joined(self, rank: int) -> bool:
        with self._lock:
            return rank in self._seen

    def alive(self, rank: int) -> bool:
        """False once `rank`'s connection ended or fell silent for `timeout_s`; a rank that
        never connected is alive until `expect`'s clock runs out."""
        with self._lock:
            if rank in self._closed_by_peer:
                return False
            seen = self._seen.get(rank)
        return seen is None or time.monotonic() - seen < self.timeout_s

    def why_gone(self, rank: int) -> str:
        with self._lock:
            if rank in self._closed_by_peer:
                return "its heartbeat connection closed"
        return f"no heartbeat for {self.timeout_s:g} s"

    def expect(self, rank: int) -> None:
        """Start `rank`'s clock now (its hello arrived), whether or not it has connected."""
        with self._lock:
            self._seen.setdefault(rank, time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(_JOIN_TIMEOUT_S)

    # -- the hub's thread ------------------------------------------------------------------

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        pending: dict[socket.socket, bytes] = {}  # connected, rank not yet read
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(INTERVAL_S):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is self._listener:
                        with contextlib.suppress(BlockingIOError):
                            conn, _ = self._listener.accept()
                            conn.setblocking(False)
                            pending[conn] = b""
                            sel.register(conn, selectors.EVENT_READ, None)
                    elif key.data is None:
                        self._read_rank(sel, sock, pending)
                    else:
                        self._read_beats(sel, sock, key.data)
        finally:
            for key in list(sel.get_map().values()):
                with contextlib.suppress(OSError):
                    key.fileobj.close()  # type: ignore[union-attr]
            sel.close()

    def _read_rank(
        self, sel: selectors.BaseSelector, sock: socket.socket, pending: dict[socket.socket, bytes]
    ) -> None:
        data = _recv(sock)
        if data is None:
            return
        if not data:
            del pending[sock]
            sel.unregister(sock)
            sock.close()
            return
        pending[sock] += data
        if len(pending[sock]) >= _RANK.size:
            (rank,) = _RANK.unpack(pending.pop(sock)[: _RANK.size])
            with self._lock:
                self._seen[rank] = time.monotonic()
            sel.modify(sock, selectors.EVENT_READ, rank)

    def _read_beats(self, sel: selectors.BaseSelector, sock: socket.socket, rank: int) -> None:
        data = _recv(sock)
        if data is None:
            return
        if not data:  # end of file: the rank's process is gone
            with self._lock:
                self._closed_by_peer.add(rank)
            sel.unregister(sock)
            sock.close()
            logger.info("rank %d: its heartbeat connection closed", rank)
            return
        with self._lock:
            self._seen[rank] = time.monotonic()
        with contextlib.suppress(BlockingIOError, OSError):
            sock.send(_BEAT)


class HeartbeatLink:
    """A remote rank's end: beats to rank 0 and times rank 0's answers."""

    def __init__(self, address: str, rank: int, timeout_s: float | None = None):
        self.timeout_s = node_timeout_s() if timeout_s is None else timeout_s
        host, port = _split_tcp(address)
        self._sock = socket.create_connection((host, port), timeout=self.timeout_s)
        self._sock.sendall(_RANK.pack(rank))
        self._sock.setblocking(False)
        self._lock = threading.Lock()
        self._seen = time.monotonic()
        self._closed_by_peer = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rank{rank}-heartbeat", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """False once rank 0's end closed or it stopped answering for `timeout_s`."""
        with self._lock:
            return not self._closed_by_peer and time.monotonic() - self._seen < self.timeout_s

    def why_gone(self) -> str:
        with self._lock:
            if self._closed_by_peer:
                return "its heartbeat connection closed"
        return f"no heartbeat for {self.timeout_s:g} s"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(_JOIN_TIMEOUT_S)

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._sock, selectors.EVENT_READ)
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    with contextlib.suppress(BlockingIOError, OSError):
                        self._sock.send(_BEAT)
                    next_beat = now + INTERVAL_S
                if sel.select(max(0.0, next_beat - time.monotonic())):
                    data = _recv(self._sock)
                    if data is None:
                        continue
                    with self._lock:
                        if data:
                            self._seen = time.monotonic()
                        else:
                            self._closed_by_peer = True
                    if not data:
                        return
        finally:
            sel.close()
            self._sock.close()


def _recv(sock: socket.socket) -> bytes | None:
    """What is there to read; b"" at end of file or on a reset connection, None when nothing
    is there after all (a spurious wake-up)."""
    try:
        return sock.recv(4096)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _split_tcp(address: str) -> tuple[str, int]:
    if not address.startswith("tcp://"):
        raise ValueError(f"not a tcp:// address: {address!r}")
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host.strip("[]"), int(port)
