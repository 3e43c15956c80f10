"""`shm_ipc.channel.term_context`: terminating a ZeroMQ context never hangs a shutdown."""

from __future__ import annotations

import logging
import time

import zmq

from shm_ipc.channel import term_context


def test_a_context_that_will_not_terminate_is_left_after_the_timeout(caplog):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)  # left open: a plain ctx.term() would block for good
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="shm_ipc.channel"):
        term_context(ctx, "test", timeout_s=0.3)
    assert time.monotonic() - start < 5
    assert "did not terminate" in caplog.text
    sock.close(linger=0)  # lets the background term finish


def test_a_context_whose_sockets_are_closed_terminates(caplog):
    ctx = zmq.Context()
    ctx.socket(zmq.PUSH).close(linger=0)
    with caplog.at_level(logging.WARNING, logger="shm_ipc.channel"):
        term_context(ctx, "test", timeout_s=5)
    assert ctx.closed and caplog.text == ""
