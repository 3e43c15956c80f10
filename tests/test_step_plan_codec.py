"""The StepPlan wire format: exact round trips, and garbage in → PlanDecodeError out.

The plan carries no checksum (the ring slot header does), so a corrupted byte inside an array is
undetectable here by design. What decode must guarantee is that it never crashes with anything
but PlanDecodeError, and that whatever it accepts is *faithful*: re-encoding the decoded plan
gives back exactly the bytes it was decoded from, and the plan passes its own invariants. A
corruption of the magic, version, command or any length is rejected outright.
"""

from __future__ import annotations

import struct

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm_ipc.step_plan import (
    ARRAY_FIELDS,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Command,
    PlanDecodeError,
    StepPlan,
)

FIELDS = ARRAY_FIELDS
_HEADER = struct.Struct("<4sHHQIIII")
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def int32_arrays(shape: int | tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.int32, shape, elements=st.integers(I32_MIN, I32_MAX))


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    """Well-formed plans: arbitrary int32 contents wherever decode does not constrain them."""
    new_tokens = draw(st.lists(st.integers(0, 12), max_size=6))  # per sequence
    num_seqs, num_tokens = len(new_tokens), sum(new_tokens)
    width = draw(st.integers(0, 5))
    num_logits = draw(st.integers(0, num_tokens)) if num_tokens else 0
    return StepPlan(
        step_id=draw(st.integers(0, 2**64 - 1)),
        command=draw(st.sampled_from(Command)),
        input_ids=draw(int32_arrays(num_tokens)),
        positions=draw(int32_arrays(num_tokens)),
        slot_mapping=draw(int32_arrays(num_tokens)),
        query_start_loc=np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32),
        seq_lens=draw(int32_arrays(num_seqs)),
        block_table=draw(int32_arrays((num_seqs, width))),
        logits_indices=draw(
            hnp.arrays(np.int32, num_logits, elements=st.integers(0, max(num_tokens - 1, 0)))
        ),
    )


def assert_same_plan(a: StepPlan, b: StepPlan) -> None:
    assert (a.step_id, a.command) == (b.step_id, b.command)
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == np.int32, name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)


def decode_or_none(data: bytes) -> StepPlan | None:
    """Decode; PlanDecodeError → None. Any other exception propagates and fails the test."""
    try:
        return StepPlan.decode(data)
    except PlanDecodeError:
        return None


def assert_faithful(data: bytes, plan: StepPlan) -> None:
    """An accepted buffer must be exactly the encoding of the plan it decodes to."""
    plan.validate()
    qsl = plan.query_start_loc
    assert qsl[0] == 0 and np.all(qsl[1:] >= qsl[:-1])
    if plan.logits_indices.size:
        assert plan.logits_indices.min() >= 0 and plan.logits_indices.max() < plan.num_tokens
    assert plan.encode() == data


# -- round trips -------------------------------------------------------------------------------


@given(plans())
@settings(max_examples=100, deadline=None)
def test_roundtrip(plan: StepPlan) -> None:
    plan.validate()
    data = plan.encode()
    assert len(data) == plan.encoded_size()
    decoded = StepPlan.decode(data)
    assert_same_plan(plan, decoded)
    assert decoded.num_tokens == plan.num_tokens and decoded.num_seqs == plan.num_seqs
    assert decoded.encode() == data


@given(plans(), st.integers(0, 64))
@settings(max_examples=50, deadline=None)
def test_encode_into_larger_buffer_and_zero_copy_decode(plan: StepPlan, slack: int) -> None:
    buf = bytearray(plan.encoded_size() + slack)
    written = plan.encode_into(memoryview(buf))
    assert written == plan.encoded_size()
    decoded = StepPlan.decode(memoryview(buf)[:written])
    assert_same_plan(plan, decoded)
    backing = np.frombuffer(buf, dtype=np.uint8)
    for name in FIELDS:
        arr = getattr(decoded, name)
        assert not arr.flags.writeable, name  # views into someone else's bytes: read-only
        if arr.size:
            assert np.shares_memory(arr, backing), name  # a view, not a copy


def test_encode_into_too_small_buffer_raises() -> None:
    plan = StepPlan.exit(3)
    with pytest.raises(ValueError, match="too small"):
        plan.encode_into(memoryview(bytearray(plan.encoded_size() - 1)))


def test_exit_plan_roundtrip() -> None:
    plan = StepPlan.exit(2**64 - 1)
    decoded = StepPlan.decode(plan.encode())
    assert decoded.command is Command.EXIT and decoded.step_id == 2**64 - 1
    assert decoded.num_tokens == 0 and decoded.num_seqs == 0
    assert_same_plan(plan, decoded)


# -- fuzzing: garbage never crashes decode and is never accepted unfaithfully --------------------


@given(st.binary(max_size=256))
@FUZZ
def test_random_bytes_rejected_or_faithful(data: bytes) -> None:
    plan = decode_or_none(data)
    if plan is not None:
        assert_faithful(data, plan)


@given(
    st.integers(0, 2**16 - 1),
    st.integers(0, 2**64 - 1),
    st.tuples(*[st.integers(0, 9)] * 4),
    st.binary(max_size=600),
)
@FUZZ
def test_valid_magic_random_header_and_body(
    command: int, step_id: int, counts: tuple[int, int, int, int], body: bytes
) -> None:
    # Random bytes almost never start with the magic; this reaches the checks behind it.
    t, b, w, n_logits = counts
    data = _HEADER.pack(MAGIC, VERSION, command, step_id, t, b, w, n_logits) + body
    plan = decode_or_none(data)
    if plan is not None:
        assert_faithful(data, plan)


@given(plans(), st.data())
@FUZZ
def test_truncated_or_extended_is_rejected(plan: StepPlan, data: st.DataObject) -> None:
    encoded = plan.encode()
    cut = data.draw(st.integers(0, len(encoded) - 1), label="cut")
    with pytest.raises(PlanDecodeError):
        StepPlan.decode(encoded[:cut])
    extra = data.draw(st.binary(min_size=1, max_size=16), label="extra")
    with pytest.raises(PlanDecodeError):
        StepPlan.decode(encoded + extra)


@given(plans(), st.data())
@FUZZ
def test_flipped_bytes_rejected_or_faithful(plan: StepPlan, data: st.DataObject) -> None:
    encoded = bytearray(plan.encode())
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        pos = data.draw(st.integers(0, len(encoded) - 1), label="pos")
        encoded[pos] ^= data.draw(st.integers(1, 255), label="mask")
    corrupted = bytes(encoded)
    decoded = decode_or_none(corrupted)
    if decoded is not None:
        assert_faithful(corrupted, decoded)
    if corrupted[:6] != plan.encode()[:6]:  # magic or version touched
        assert decoded is None


@given(plans(), st.sampled_from(range(16, 32)), st.integers(1, 255))
@FUZZ
def test_corrupted_length_field_rejected_or_consistent(plan: StepPlan, pos: int, mask: int) -> None:
    encoded = bytearray(plan.encode())
    encoded[pos] ^= mask
    decoded = decode_or_none(bytes(encoded))
    if decoded is not None:
        # Only possible when the byte count cannot tell: the block-table width of a plan with no
        # sequences (0 * W == 0 * W'). Even then the plan is faithful to its bytes.
        assert plan.num_seqs == 0 and 24 <= pos < 28
        assert_faithful(bytes(encoded), decoded)


def _header_with(plan: StepPlan, **fields: int | bytes) -> bytes:
    encoded = plan.encode()
    values = dict(
        zip(
            ("magic", "version", "command", "step_id", "t", "b", "w", "n_logits"),
            _HEADER.unpack_from(encoded),
            strict=True,
        )
    )
    values.update(fields)
    return _HEADER.pack(*values.values()) + encoded[HEADER_SIZE:]


def _sample_plan() -> StepPlan:
    # Two sequences: a 3-token prefill chunk and a 1-token decode.
    return StepPlan(
        step_id=17,
        command=Command.RUN,
        input_ids=np.array([5, 6, 7, 8], np.int32),
        positions=np.array([0, 1, 2, 9], np.int32),
        slot_mapping=np.array([0, 1, 2, 41], np.int32),
        query_start_loc=np.array([0, 3, 4], np.int32),
        seq_lens=np.array([3, 10], np.int32),
        block_table=np.array([[0, 0], [4, 5]], np.int32),
        logits_indices=np.array([2, 3], np.int32),
    )


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"magic": b"XTPL"}, "magic"),
        ({"version": VERSION + 1}, "version"),
        ({"command": 0}, "command"),
        ({"command": 3}, "command"),
        ({"command": 2**16 - 1}, "command"),
        ({"t": 5}, "bytes"),
        ({"t": 2**32 - 1}, "bytes"),
        ({"b": 3}, "bytes"),
        ({"w": 3}, "bytes"),
        ({"n_logits": 3}, "bytes"),
    ],
)
def test_bad_header_field_rejected(fields: dict, match: str) -> None:
    with pytest.raises(PlanDecodeError, match=match):
        StepPlan.decode(_header_with(_sample_plan(), **fields))


@pytest.mark.parametrize(
    "qsl",
    [
        [1, 3, 4],  # does not start at 0
        [0, 3, 3],  # does not end at num_tokens
        [0, 5, 4],  # decreasing
        # Regression: an int32 np.diff wraps around, so this once passed as non-decreasing.
        [0, I32_MAX, I32_MIN, 4],
    ],
)
def test_bad_query_start_loc_rejected(qsl: list[int]) -> None:
    good = _sample_plan()
    b = len(qsl) - 1
    plan = StepPlan(
        step_id=1,
        command=Command.RUN,
        input_ids=good.input_ids,
        positions=good.positions,
        slot_mapping=good.slot_mapping,
        query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.zeros(b, np.int32),
        block_table=np.zeros((b, 1), np.int32),
        logits_indices=good.logits_indices,
    )
    with pytest.raises(PlanDecodeError, match="query_start_loc"):
        StepPlan.decode(plan.encode())


@pytest.mark.parametrize("bad_index", [-1, 4, I32_MAX, I32_MIN])
def test_logits_index_out_of_range_rejected(bad_index: int) -> None:
    good = _sample_plan()
    encoded = bytearray(good.encode())
    struct.pack_into("<i", encoded, len(encoded) - 4, bad_index)  # last logits index
    with pytest.raises(PlanDecodeError, match="logits_indices"):
        StepPlan.decode(bytes(encoded))
