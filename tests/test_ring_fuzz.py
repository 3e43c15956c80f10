"""Random corruption of a ring slot: the reader returns exactly what rank 0 wrote, or raises
`CorruptMessageError` naming itself and the step. Never another plan, never a hang.

In-process, one fresh channel per example (rank 0 and rank 1 both in this process, like the
protocol tests in `test_shm_channel.py`). Rank 0 publishes a valid plan. The test then rewrites
bytes of that slot behind the protocol's back: after the doorbell and before the reader looks,
as memory corruption or a writer that broke ring.py's rule 1 would. Rank 1's `PlanReceiver.recv`
then reads the slot through the real path: seq check, where/length check, private copy,
checksum, decode.

The oracle is exact. A slot's message bytes are its header fields (seq, step_id, length,
checksum, where: the first 33 bytes) and, when the payload is kept in the slot, its first
`length` payload bytes. The rest of the slot carries nothing: header padding, ack bytes, unused
payload, and the whole payload area when the plan travels in the doorbell. If every message byte
is unchanged, `recv` must return the original plan. If any changed, it must raise
`CorruptMessageError` (a checksum collision has probability 2**-64 per example).
"""

from __future__ import annotations

import random
import re
import time

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from shm_ipc import CorruptMessageError, PlanBroadcaster, PlanReceiver, StepPlan
from shm_ipc.ring import SLOT_HEADER_SIZE, ShmRing, Where
from tests.test_step_plan_codec import plans

# Small enough that some of the random plans (up to ~1.4 KB) travel in the doorbell, which
# leaves only the slot header for the reader to check.
SLOT_BYTES = 512
NUM_SLOTS = 2
# One reader's ack byte takes a 64-byte block; SLOT_BYTES is already a multiple of 64.
PAYLOAD_OFFSET = SLOT_HEADER_SIZE + 64  # from the slot's first byte
STRIDE = PAYLOAD_OFFSET + SLOT_BYTES
# `recv` finds the doorbell already queued; waiting this long means it is stuck. ChannelTimeout
# is not a CorruptMessageError, so a stuck read fails the test instead of hanging it.
RECV_TIMEOUT_S = 2.0
# The slot header's fields, as ring.py's layout draws them: name -> (offset, size).
FIELDS = {
    "seq": (0, 8),
    "step_id": (8, 8),
    "length": (16, 8),
    "checksum": (24, 8),
    "where": (32, 1),
}
FIELDS_END = 33  # header bytes past this are padding
U64 = st.integers(0, 2**64 - 1)


# -- corruptions: each op is a plain tuple, so that a failing example prints readably ------------


@st.composite
def field_overwrite(draw: st.DrawFn, length: int) -> tuple:
    """One header field set to a new value (possibly, by chance, its old one)."""
    name = draw(st.sampled_from(sorted(FIELDS)))
    offset, size = FIELDS[name]
    if name == "length":
        values = [
            st.integers(0, max(length - 1, 0)),  # truncated
            st.integers(SLOT_BYTES + 1, 2**64 - 1),  # pointing past the slot
        ]
        if length < SLOT_BYTES:  # longer, still inside the slot
            values.append(st.integers(length + 1, SLOT_BYTES))
        value = draw(st.one_of(values))
    elif name == "where":
        value = draw(st.integers(0, 255))
    else:
        value = draw(U64)
    return ("write", offset, value.to_bytes(size, "little"))


@st.composite
def torn_length(draw: st.DrawFn) -> tuple:
    """Some of the length field's bytes overwritten, as a torn or partial store would."""
    start = draw(st.integers(0, 7))
    n = draw(st.integers(1, 8 - start))
    return ("write", FIELDS["length"][0] + start, draw(st.binary(min_size=n, max_size=n)))


@st.composite
def corruptions(draw: st.DrawFn, length: int) -> list[tuple]:
    """1 to 4 ops on one slot (offsets relative to the slot's first byte)."""
    offsets = st.one_of(
        st.integers(0, FIELDS_END - 1),  # header fields
        # the plan's bytes (in the slot) or the start of the unused payload area (in the doorbell)
        st.integers(PAYLOAD_OFFSET, PAYLOAD_OFFSET + min(max(length, 1), SLOT_BYTES) - 1),
        st.integers(0, STRIDE - 1),  # anywhere: padding, acks and unused payload included
    )
    op = st.one_of(
        st.tuples(st.just("xor"), offsets, st.integers(1, 255)),
        field_overwrite(length),
        torn_length(),
        st.tuples(st.just("write"), offsets, st.binary(min_size=1, max_size=64)),
        # The whole slot replaced by garbage, except the kept header fields: keeping seq (and
        # more) lets the garbage reach the checks after the first.
        st.tuples(
            st.just("garbage"), st.integers(0, 2**32), st.frozensets(st.sampled_from(list(FIELDS)))
        ),
        # Bytes written back unchanged: the intact case must still decode to the original.
        st.tuples(st.just("rewrite"), offsets, st.integers(1, 256)),
    )
    return draw(st.lists(op, min_size=1, max_size=4))


@st.composite
def cases(draw: st.DrawFn) -> tuple[StepPlan, int, list[tuple]]:
    """(plan, number of plans received before it, corruption of its slot)."""
    plan = draw(plans())
    num_before = draw(st.integers(0, NUM_SLOTS))  # puts the message in either slot, seq 1..3
    ops = draw(corruptions(plan.encoded_size()))
    return plan, num_before, ops


def corrupt(ring: ShmRing, slot: int, ops: list[tuple]) -> None:
    base, stride, mm = ring._slot_offset(slot), STRIDE, ring.mm
    for kind, a, b in ops:
        if kind == "xor":
            mm[base + a] ^= b
        elif kind == "write":
            data = b[: stride - a]
            mm[base + a : base + a + len(data)] = data
        elif kind == "rewrite":
            end = base + min(a + b, stride)
            mm[base + a : end] = bytes(mm[base + a : end])
        else:  # garbage
            original = mm[base : base + stride]
            mm[base : base + stride] = random.Random(a).randbytes(stride)
            for name in b:
                offset, size = FIELDS[name]
                mm[base + offset : base + offset + size] = original[offset : offset + size]


def message_bytes(ring: ShmRing, slot: int, length: int, in_slot: bool) -> bytes:
    """The bytes that carry the message (see the module docstring), at the original extent."""
    base = ring._slot_offset(slot)
    payload = ring._payload_offset(slot)
    return ring.mm[base : base + FIELDS_END] + (
        ring.mm[payload : payload + length] if in_slot else b""
    )


def header_field(ring: ShmRing, slot: int, name: str) -> int:
    offset, size = FIELDS[name]
    base = ring._slot_offset(slot) + offset
    return int.from_bytes(ring.mm[base : base + size], "little")


# -- the fuzz test -------------------------------------------------------------------------------


@given(cases())
# A flip in the header padding (past `where`) carries nothing: the plan must still come through.
@example((StepPlan.exit(5), 0, [("xor", 40, 0x01)]))
# One flipped checksum bit must be caught.
@example((StepPlan.exit(5), 1, [("xor", 24, 0x80)]))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_corrupted_slot_yields_the_original_plan_or_a_corrupt_message_error(case) -> None:
    plan, num_before, ops = case
    with (
        PlanBroadcaster(1, slot_bytes=SLOT_BYTES, num_slots=NUM_SLOTS, timeout_s=5.0) as bc,
        PlanReceiver(bc.handle, 1) as rx,
    ):
        bc.wait_for_readers(10)
        for step in range(num_before):
            bc.publish(StepPlan.exit(step))
            assert rx.recv(timeout_s=RECV_TIMEOUT_S).step_id == step
        ring = bc._ring  # white box: write into the slot behind the protocol's back
        assert ring is not None
        seq = num_before + 1
        slot = ring.slot_of(seq)
        bc.publish(plan)
        header = ring.read_header(slot)
        # The test's own idea of the layout must match the ring's.
        assert ring._stride == STRIDE
        assert ring._payload_offset(slot) - ring._slot_offset(slot) == PAYLOAD_OFFSET
        fields = {name: header_field(ring, slot, name) for name in FIELDS}
        assert fields == {
            "seq": seq,
            "step_id": plan.step_id,
            "length": plan.encoded_size(),
            "checksum": header.checksum,
            "where": header.where,
        }
        length, in_slot = plan.encoded_size(), header.where == Where.SLOT
        before = message_bytes(ring, slot, length, in_slot)
        corrupt(ring, slot, ops)
        changed = message_bytes(ring, slot, length, in_slot) != before
        seq_changed = header_field(ring, slot, "seq") != seq
        step_in_slot = header_field(ring, slot, "step_id")

        start = time.monotonic()
        try:
            got = rx.recv(timeout_s=RECV_TIMEOUT_S)
        except CorruptMessageError as err:
            text = str(err)
            # Which check caught it (`--hypothesis-show-statistics` shows that each one is hit).
            why = re.sub(r"\d+", "N", text.partition(": ")[2])[:32]
            event(f"rejected ({'in slot' if in_slot else 'in doorbell'}): {why}")
            assert changed, f"an intact message was rejected: {err}"
            assert err.rank == 1 and text.startswith("rank 1, "), text
            if seq_changed:
                # The slot does not hold this message, so nothing in it (its step included) can
                # be trusted: the error places it after the last good step instead.
                assert err.step_id is None, text
                last = (
                    "the first message"
                    if num_before == 0
                    else f"the message after step {num_before - 1}"
                )
                assert text.startswith(f"rank 1, {last}: "), text
            else:
                # Before the checksum passes, the slot header is all the reader knows of the step.
                assert err.step_id == step_in_slot, text
                assert text.startswith(f"rank 1, step {step_in_slot}: "), text
        else:
            event(f"accepted ({'in slot' if in_slot else 'in doorbell'})")
            assert not changed, (
                f"a corrupted message was accepted as step {got.step_id} ({got.command.name})"
            )
            assert (got.step_id, got.command) == (plan.step_id, plan.command)
            assert got.encode() == plan.encode()
        assert time.monotonic() - start < RECV_TIMEOUT_S
