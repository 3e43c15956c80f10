"""Plans to ranks on other nodes: the same bytes as the ring's, over ZeroMQ on TCP.

Ranks on rank 0's node read the shared-memory ring (`ring.py`); a rank on another node cannot
map it, so rank 0 sends it each message whole, straight from its own socket:

    rank 0  XPUB  tcp://HOST:P1  ──doorbell + header + payload──►  SUB   every remote rank
    rank 0  PULL  tcp://HOST:P2  ◄──hello, acks, error reports──   PUSH  every remote rank
    rank 0  heartbeats           tcp://HOST:P3  (`heartbeat.py`)

One remote message, in seq order with the ring's (one counter for both):

    frame 0: struct "<BQ"   kind, seq            (the local doorbell, unchanged)
    frame 1: struct "<QQQ"  step_id, length, checksum (xxh3_64 of the payload)
    frame 2: the payload    (the StepPlan or ControlCall bytes the ring slot holds)

Why straight from rank 0 and not through one relay rank per node that re-publishes into its
node's own ring: a relay is a thread on a rank that also runs the model, a second hop on every
step's critical path, and one more process whose death must be told apart; rank 0's copies cost
one send of a few kilobytes per remote rank per step (8 ranks: tens of microseconds), which is
what vLLM's `MessageQueue` pays for its remote readers too.

Flow control is the ring's rule, kept for remote readers by acks: a remote rank sends
`ReaderAck(seq)` on the back channel once it holds a message, and rank 0 never sends message
`seq` while a remote rank has not acknowledged `seq - num_slots`. So neither side's queues grow
without bound, and the high-water marks can stay unlimited: ZeroMQ never drops a message, and a
lost or reordered one is a seq mismatch, raised as `CorruptMessageError`.

The readiness handshake is the ring's too (`channel.py`): rank 0 waits for one subscription per
remote rank on this XPUB (XPUB_VERBOSE) and for every hello before the first message.

Addresses: rank 0 binds and announces `announce_host()`: `$TP_ENGINE_HOST_IP` when set (as
vLLM's `VLLM_HOST_IP`), else the local address that routes to `$MASTER_ADDR` (a UDP "connect",
no packet sent), else 127.0.0.1. Never `$MASTER_ADDR` itself: that is node 0's address only on
node 0, and a name there may resolve to an address no socket can bind. Ports are picked by the
kernel, one set per run. The sockets are not authenticated (neither is torch.distributed's
store): keep them on the cluster's own network.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct

import zmq

ENV_HOST_IP = "TP_ENGINE_HOST_IP"
REMOTE_HEADER = struct.Struct("<QQQ")  # step_id, length, checksum


def announce_host() -> str:
    """The address rank 0 binds its TCP sockets on and tells the other nodes (module
    docstring)."""
    explicit = os.environ.get(ENV_HOST_IP)
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR")
    if master:
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 9))  # sets the route only; UDP sends nothing on connect
            return str(s.getsockname()[0])
    return "127.0.0.1"


def tcp_url(host: str) -> str:
    """A bind address on `host` with a port the kernel picks (IPv6 literals bracketed)."""
    return f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"


def bound_address(sock: zmq.Socket) -> str:
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


class RemoteFanout:
    """Rank 0's sending end for `ranks` on other nodes: the TCP XPUB and their acks."""

    def __init__(self, ctx: zmq.Context, host: str, ranks: tuple[int, ...]):
        self.ranks = ranks
        self.acked = dict.fromkeys(ranks, 0)  # rank -> highest seq it holds
        self.subscribed = 0
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per reader
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop: acks bound what is in flight
        try:
            self.pub.bind(tcp_url(host))
        except BaseException:
            self.pub.close(linger=0)
            raise
        self.address = bound_address(self.pub)

    def count_subscriptions(self) -> None:
        while True:
            try:
                msg = self.pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.subscribed += msg[:1] == b"\x01"

    def ack(self, rank: int, seq: int) -> None:
        if seq > self.acked.get(rank, seq):
            self.acked[rank] = seq

    def lagging(self, seq: int, num_slots: int) -> list[int]:
        """Remote ranks that must acknowledge more before message `seq` may go."""
        return [rank for rank in self.ranks if self.acked[rank] < seq - num_slots]

    def send(self, doorbell: bytes, step_id: int, payload: bytes, checksum: int) -> None:
        header = REMOTE_HEADER.pack(step_id, len(payload), checksum)
        self.pub.send_multipart([doorbell, header, payload], copy=False)

    def close(self, doorbell: bytes, linger_ms: int) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.pub.send(doorbell, zmq.NOBLOCK)
        self.pub.close(linger=linger_ms)
