"""The plan channel, rank 0 → workers: how the ring, the doorbell and the back channel fit.

Ownership: rank 0 owns a `PlanBroadcaster` (`broadcaster.py`): it creates the ring, binds both
sockets and is the only writer. Each worker owns a `PlanReceiver` (`receiver.py`) built from the
`ChannelHandle` that rank 0 broadcasts as bytes. Plans go one way; hellos and error reports come
back on the PUSH/PULL back channel (`error_channel.py`).

Sockets (ZeroMQ, ipc:// in the run's private 0700 directory):

    rank 0  XPUB  plan.sock  ──doorbell──►  SUB   every worker
    rank 0  PULL  back.sock  ◄──hello, error reports──  PUSH  every worker

Doorbell message, one per message, in seq order (1, 2, 3 ...):

    frame 0: struct "<BQ"  kind, seq
    frame 1: only when the slot header says Where.DOORBELL: the encoded message (too big for a
             slot)

    | kind    | message seq is          | decoded by                     |
    |---------|-------------------------|--------------------------------|
    | PLAN    | a StepPlan              | `StepPlan.decode`              |
    | CONTROL | a ControlCall           | `ControlCall.decode`           |
    | CLOSE   | none: rank 0 closed the | (nothing; `recv` raises        |
    |         | channel                 | `ChannelClosed`)               |

Plans and control calls share one seq counter, one ring and one flow-control rule, so a reader
gets them in exactly the order rank 0 published them: a control call lands between the steps it
was sent between. The kind lives in the doorbell rather than in the slot header so that the
slot layout (and every StepPlan byte) stays what it was; each payload's own magic checks the
kind again.

Every message takes a ring slot, even one that travels in the doorbell: its header (seq,
length, checksum) and acks live in the slot, so one flow-control rule covers both paths. Rank 0 never has
more than `num_slots` unacknowledged messages in flight, which is why the XPUB high-water mark
can be unlimited without memory growing: ZeroMQ never drops a doorbell.

Start-up handshake (the PUB/SUB "slow joiner" problem: a PUB drops messages for a subscriber
whose subscription it has not yet processed):

    worker: map the ring → connect SUB (subscribe to everything) → connect PUSH → send hello
            {rank, pid}
    rank 0: wait until it has read `num_readers` subscription messages on its XPUB (XPUB_VERBOSE,
            so each subscriber's identical subscription is reported, not only the first) AND a
            hello from every rank 1..num_readers
    rank 0: unlink the /dev/shm name, both socket files and the run directory. Mappings and
            connected sockets stay valid, so from here on no exit path, SIGKILL included, can
            leave anything behind.

A subscription message read on the XPUB means the subscription is installed, so every later
publish reaches that subscriber. A separate socket per reader would avoid the question too, but
costs one send (and one copy of an oversized plan) per reader per step.

Timeouts and liveness: rank 0 bounds every wait with `timeout_s` and, every
`CHECK_INTERVAL_S` while it waits, checks the pids that workers sent in their hellos, so a dead
worker is an error within a fraction of a second. A worker's `recv` has no timeout by default (a
server without traffic idles for hours); instead it checks rank 0's pid from the handle every
`OWNER_CHECK_INTERVAL_S` and raises `OwnerDiedError` when rank 0 is gone, after removing the
run's names in case rank 0 died before its handshake could.

The ranks on rank 0's node must share its pid namespace (as under torchrun on one machine):
pids are how each side tells a dead peer from a slow one there. Ranks on other nodes get every
message over TCP instead of the ring and are watched by heartbeats instead of pids (`remote.py`,
`heartbeat.py`); everything above holds for them too, their acks travelling on the back
channel.
"""

from __future__ import annotations

import enum
import logging
import struct
import threading

import zmq

logger = logging.getLogger(__name__)

DOORBELL = struct.Struct("<BQ")  # kind, seq
# How often a waiting side checks its peers' pids and the back channel. Short enough that a dead
# peer is reported in well under a second; long enough that the checks cost nothing measurable.
CHECK_INTERVAL_S = 0.1
# A worker waiting for a plan is normally idle, not stuck, so it checks less often.
OWNER_CHECK_INTERVAL_S = 0.5
# The longest `term_context` waits for a ZeroMQ context to terminate.
_TERM_TIMEOUT_S = 5.0


class DoorbellKind(enum.IntEnum):
    PLAN = 1  # StepPlan `seq` is ready in slot (seq - 1) % num_slots
    CLOSE = 2  # rank 0 closed the channel; no more messages will come
    CONTROL = 3  # ControlCall `seq` is ready in slot (seq - 1) % num_slots


def term_context(ctx: zmq.Context, what: str, timeout_s: float = _TERM_TIMEOUT_S) -> None:
    """`ctx.term()`, bounded: call after closing every socket of `ctx` (each with a finite
    linger). libzmq's term has been seen to block for good on a loaded machine even then, and a
    run must never hang on shutdown: after `timeout_s` the context is left to the process's
    exit (its socket files are removed with the run directory either way)."""
    done = threading.Event()

    def term() -> None:
        ctx.term()
        done.set()

    threading.Thread(target=term, name=f"zmq-term-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        logger.warning("%s: zmq context did not terminate in %.1f s; leaving it", what, timeout_s)
