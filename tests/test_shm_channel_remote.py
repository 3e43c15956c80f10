"""The plan channel's path to ranks on other nodes (TCP, acks, heartbeats), in one process.

A "remote" reader here is a `PlanReceiver` whose rank the broadcaster was told is on another
node: it never maps the ring (the test checks it has none) and gets every message over TCP on
127.0.0.1. The honest multi-node runs, with a second node in its own namespaces, are in
tests/test_multinode.py.
"""

from __future__ import annotations

import socket
import struct
import time

import pytest

from shm_ipc import (
    ChannelTimeout,
    Command,
    CorruptMessageError,
    OwnerDiedError,
    PlanBroadcaster,
    PlanReceiver,
    ReaderDiedError,
    StepPlan,
)
from shm_ipc.channel import DOORBELL, DoorbellKind
from shm_ipc.heartbeat import HeartbeatHub, HeartbeatLink
from shm_ipc.remote import ENV_HOST_IP, announce_host
from tests.test_shm_channel import SLOT_BYTES, assert_nothing_left, make_plan, same_plan

HOST = "127.0.0.1"


def two_node_channel(**kwargs) -> PlanBroadcaster:
    """Ranks 1 (rank 0's node) and 2, 3 (node 1)."""
    return PlanBroadcaster(
        3, remote_readers=[2, 3], nodes=[0, 0, 1, 1], host=HOST, slot_bytes=SLOT_BYTES, **kwargs
    )


def test_local_and_remote_readers_get_the_same_messages_in_order() -> None:
    with two_node_channel(num_slots=2) as bc:
        h = bc.handle
        assert (h.ring_readers, h.remote_readers) == (1, (2, 3))
        assert h.remote_plan_address.startswith("tcp://127.0.0.1:")
        readers = [PlanReceiver(h, rank) for rank in (1, 2, 3)]
        try:
            assert [r._ring is None for r in readers] == [False, True, True]
            bc.wait_for_readers(10)
            assert_nothing_left(h)
            sizes = []
            for step in range(30):  # more than the ring's slots: the acks must come back
                plan = make_plan(step)
                sizes.append(plan.encoded_size())
                bc.publish(plan)
                for reader in readers:
                    assert same_plan(reader.recv(timeout_s=10), plan)
            assert min(sizes) <= SLOT_BYTES < max(sizes)  # in a slot and in the doorbell
            bc.publish(StepPlan.exit(30))
            assert all(r.recv(timeout_s=10).command is Command.EXIT for r in readers)
        finally:
            for reader in readers:
                reader.close()
    assert_nothing_left(h)


def test_a_remote_reader_that_does_not_ack_holds_the_writer_and_is_named_with_its_node() -> None:
    with two_node_channel(num_slots=2, timeout_s=0.6) as bc:
        readers = [PlanReceiver(bc.handle, rank) for rank in (1, 2, 3)]
        try:
            bc.wait_for_readers(10)
            bc.publish(make_plan(0, max_tokens=20))
            bc.publish(make_plan(1, max_tokens=20))
            for reader in readers[:2]:  # rank 3 reads nothing, so acks nothing
                reader.recv(timeout_s=10)
                reader.recv(timeout_s=10)
            with pytest.raises(ChannelTimeout, match=r"rank 3 \(node 1\) to acknowledge message 1"):
                bc.publish(make_plan(2, max_tokens=20))
        finally:
            for reader in readers:
                reader.close()


def test_messages_name_ranks_with_their_nodes() -> None:
    with two_node_channel() as bc:
        assert bc.describe([1, 2, 3]) == "rank 1 (node 0) and ranks 2 and 3 (node 1)"
    with PlanBroadcaster(3) as one_node:
        assert one_node.describe([2, 3]) == "rank 2 and rank 3"


def test_handshake_timeout_names_the_missing_node() -> None:
    missing = r"ranks \[2, 3\] \(node 1: ranks \[2, 3\]\)"
    with (
        two_node_channel() as bc,
        PlanReceiver(bc.handle, 1),
        pytest.raises(ChannelTimeout, match=missing),
    ):
        bc.wait_for_readers(0.5)


def test_a_remote_reader_whose_connection_closes_is_dead_at_once() -> None:
    with two_node_channel() as bc:
        readers = [PlanReceiver(bc.handle, rank) for rank in (1, 2, 3)]
        try:
            bc.wait_for_readers(10)
            assert bc.dead_readers() == []
            readers[2]._owner.close()  # rank 3's heartbeat connection ends, as at its death
            deadline = time.monotonic() + 5
            while bc.dead_readers() != [3] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert bc.dead_readers() == [3]
            with pytest.raises(
                ReaderDiedError, match=r"rank 3 \(node 1\) is gone .*: its heartbeat conn"
            ):
                bc.check_readers()
        finally:
            for reader in readers:
                reader.close()


def test_remote_reader_sees_rank_0_gone_when_its_heartbeats_end() -> None:
    with two_node_channel() as bc:
        readers = [PlanReceiver(bc.handle, rank) for rank in (1, 2, 3)]
        try:
            bc.wait_for_readers(10)
            bc.publish(make_plan(5, max_tokens=20))
            readers[1].recv(timeout_s=10)
            assert readers[1].owner_alive()
            bc._hub.close()  # white box: rank 0's end of the heartbeats goes, as at its death
            start = time.monotonic()
            with pytest.raises(OwnerDiedError, match=r"rank 2: rank 0 \(node 0\) is gone"):
                readers[1].recv()  # no timeout: only the owner check can end this wait
            assert time.monotonic() - start < 5
        finally:
            for reader in readers:
                reader.close()


def test_a_lost_or_garbled_remote_message_is_detected() -> None:
    with two_node_channel() as bc:
        readers = [PlanReceiver(bc.handle, rank) for rank in (1, 2, 3)]
        try:
            bc.wait_for_readers(10)
            fanout = bc._fanout  # white box: what a lossy or broken path would deliver
            fanout.send(DOORBELL.pack(DoorbellKind.PLAN, 2), 9, b"x", 0)  # seq 1 never came
            for reader in readers[1:]:
                with pytest.raises(CorruptMessageError, match="message 2, expected 1"):
                    reader.recv(timeout_s=10)
            fanout.send(DOORBELL.pack(DoorbellKind.PLAN, 1), 9, b"xyz", 12345)
            with pytest.raises(CorruptMessageError, match="rank 3, step 9: checksum mismatch"):
                readers[2].recv(timeout_s=10)
        finally:
            for reader in readers:
                reader.close()


def test_a_remote_readers_error_report_reaches_rank_0_over_tcp() -> None:
    with two_node_channel() as bc:
        readers = [PlanReceiver(bc.handle, rank) for rank in (1, 2, 3)]
        try:
            bc.wait_for_readers(10)
            bc.publish(make_plan(4, max_tokens=20))
            readers[2].recv(timeout_s=10)
            assert readers[2].report_error(4, RuntimeError("stage exploded"))
            deadline = time.monotonic() + 10
            reports = []
            while not reports and time.monotonic() < deadline:
                reports = bc.poll_errors()
                time.sleep(0.02)
            assert [(r.rank, r.step_id, r.type) for r in reports] == [(3, 4, "RuntimeError")]
            assert "stage exploded" in reports[0].message
        finally:
            for reader in readers:
                reader.close()


def test_heartbeat_silence_counts_as_gone_after_the_timeout() -> None:
    hub = HeartbeatHub(HOST, timeout_s=0.5)
    try:
        host, port = hub.address[len("tcp://") :].rsplit(":", 1)
        mute = socket.create_connection((host, int(port)))
        mute.sendall(struct.pack("<I", 7))  # joins as rank 7, then never beats
        deadline = time.monotonic() + 5
        while not hub.joined(7) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert hub.alive(7)
        time.sleep(0.7)
        assert not hub.alive(7) and "no heartbeat for 0.5 s" in hub.why_gone(7)
        link = HeartbeatLink(hub.address, 8, timeout_s=0.5)
        time.sleep(0.8)  # beats keep both ends alive past the timeout
        assert hub.alive(8) and link.alive()
        link.close()
        mute.close()
    finally:
        hub.close()


def test_announced_host_comes_from_the_variable_else_the_route_to_master(monkeypatch) -> None:
    monkeypatch.setenv(ENV_HOST_IP, "10.1.2.3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert announce_host() == "10.1.2.3"
    monkeypatch.delenv(ENV_HOST_IP)
    assert announce_host() == "127.0.0.1"  # the local address that routes to MASTER_ADDR
    monkeypatch.delenv("MASTER_ADDR")
    assert announce_host() == "127.0.0.1"
