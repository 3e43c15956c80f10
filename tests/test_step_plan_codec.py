"""The StepPlan wire format: exact round trips, and garbage in → PlanDecodeError out.

The plan carries no checksum (the ring slot header does), so a corrupted byte inside an array is
undetectable here by design. What decode must guarantee is that it never crashes with anything
but PlanDecodeError, and that whatever it accepts is *faithful*: re-encoding the decoded plan
gives back exactly the bytes it was decoded from, and the plan passes its own invariants. A
corruption of the magic, version, command or any length is rejected outright.
"""

from __future__ import annotations

import dataclasses
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
    SECTIONS,
    VERSION,
    Command,
    PlanDecodeError,
    StepPlan,
)

FIELDS = ARRAY_FIELDS
_HEADER = struct.Struct("<4sHHQIIIIII")
_HEADER_NAMES = ("magic", "version", "command", "step_id", "t", "b", "n_logits", "e", "n", "s")
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def int32_arrays(shape: int | tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.int32, shape, elements=st.integers(I32_MIN, I32_MAX))


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    """Well-formed plans: arbitrary int32 contents wherever decode does not constrain them."""
    new_tokens = draw(st.lists(st.integers(0, 12), max_size=6))  # per sequence
    num_seqs, num_tokens = len(new_tokens), sum(new_tokens)
    num_logits = draw(st.integers(0, num_tokens)) if num_tokens else 0
    edit_sizes = draw(st.lists(st.integers(0, 5), max_size=4))  # block ids per edit
    num_edits = len(edit_sizes)
    return StepPlan(
        step_id=draw(st.integers(0, 2**64 - 1)),
        command=draw(st.sampled_from(Command)),
        input_ids=draw(int32_arrays(num_tokens)),
        query_start_loc=np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.int32),
        seq_lens=draw(int32_arrays(num_seqs)),
        rows=draw(int32_arrays(num_seqs)),
        logits_indices=draw(
            hnp.arrays(np.int32, num_logits, elements=st.integers(0, max(num_tokens - 1, 0)))
        ),
        edit_rows=draw(int32_arrays(num_edits)),
        edit_starts=draw(int32_arrays(num_edits)),
        edit_offsets=np.concatenate([[0], np.cumsum(edit_sizes)]).astype(np.int32),
        edit_blocks=draw(int32_arrays(sum(edit_sizes))),
    ).with_sections(
        adapter_slots=draw(
            st.sampled_from([0, num_seqs]).flatmap(
                lambda n: hnp.arrays(np.int32, n, elements=st.integers(-1, I32_MAX))
            )
        ),
    )


def assert_same_plan(a: StepPlan, b: StepPlan) -> None:
    assert (a.step_id, a.command) == (b.step_id, b.command)
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype == np.int32, name
        assert x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert a.sections.keys() == b.sections.keys()
    for name in SECTIONS:
        x, y = a.section(name), b.section(name)
        assert x.dtype == y.dtype == np.int32, name
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
    qsl, offsets = plan.query_start_loc, plan.edit_offsets
    assert qsl[0] == 0 and np.all(qsl[1:] >= qsl[:-1])
    assert offsets[0] == 0 and np.all(offsets[1:] >= offsets[:-1])
    if plan.logits_indices.size:
        assert plan.logits_indices.min() >= 0 and plan.logits_indices.max() < plan.num_tokens
    assert plan.encode() == data


# -- round trips -------------------------------------------------------------------------------


def test_wire_order_is_the_field_order() -> None:
    # `decode` passes the arrays to the constructor positionally, in wire order.
    names = [f.name for f in dataclasses.fields(StepPlan)]
    assert names == ["step_id", "command", *ARRAY_FIELDS, "sections"]


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
    st.tuples(*[st.integers(0, 9)] * 6),
    st.binary(max_size=600),
)
@FUZZ
def test_valid_magic_random_header_and_body(
    command: int, step_id: int, counts: tuple[int, ...], body: bytes
) -> None:
    # Random bytes almost never start with the magic; this reaches the checks behind it.
    data = _HEADER.pack(MAGIC, VERSION, command, step_id, *counts) + body
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


@given(plans(), st.sampled_from(range(16, 40)), st.integers(1, 255))
@FUZZ
def test_corrupted_length_field_rejected(plan: StepPlan, pos: int, mask: int) -> None:
    encoded = bytearray(plan.encode())
    encoded[pos] ^= mask
    with pytest.raises(PlanDecodeError):
        StepPlan.decode(bytes(encoded))


def _header_with(plan: StepPlan, **fields: int | bytes) -> bytes:
    encoded = plan.encode()
    values = dict(zip(_HEADER_NAMES, _HEADER.unpack_from(encoded), strict=True))
    values.update(fields)
    return _HEADER.pack(*values.values()) + encoded[HEADER_SIZE:]


def _sample_plan(logits_indices: list[int] | None = None, **arrays: np.ndarray) -> StepPlan:
    # Two sequences: a 3-token prefill chunk (rows 1, whose table is sent) and a 1-token decode.
    fields = dict(
        input_ids=np.array([5, 6, 7, 8], np.int32),
        query_start_loc=np.array([0, 3, 4], np.int32),
        seq_lens=np.array([3, 10], np.int32),
        rows=np.array([1, 0], np.int32),
        logits_indices=np.array(logits_indices or [2, 3], np.int32),
        edit_rows=np.array([1], np.int32),
        edit_starts=np.array([0], np.int32),
        edit_offsets=np.array([0, 1], np.int32),
        edit_blocks=np.array([6], np.int32),
    )
    fields.update(arrays)
    return StepPlan(step_id=17, command=Command.RUN, **fields)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"magic": b"XTPL"}, "magic"),
        ({"version": VERSION + 1}, "version"),
        ({"command": 0}, "command"),
        ({"command": 4}, "command"),
        ({"command": 2**16 - 1}, "command"),
        ({"t": 5}, "bytes"),
        ({"t": 2**32 - 1}, "bytes"),
        ({"b": 3}, "bytes"),
        ({"n_logits": 3}, "bytes"),
        ({"e": 2}, "bytes"),
        ({"n": 3}, "bytes"),
        ({"s": 1}, "bytes"),  # a section table the plan does not have
        ({"s": 99}, "sections"),  # more sections than this build knows
    ],
)
def test_bad_header_field_rejected(fields: dict, match: str) -> None:
    with pytest.raises(PlanDecodeError, match=match):
        StepPlan.decode(_header_with(_sample_plan(), **fields))


def test_adapter_slots_roundtrip_and_below_base_rejected() -> None:
    plan = _sample_plan().with_sections(adapter_slots=np.array([2, -1], np.int32))
    assert_same_plan(plan, StepPlan.decode(plan.encode()))
    # Base plans carry nothing: the section (a table entry and B values) only when present.
    assert _sample_plan().encoded_size() + 4 * (2 + 2) == plan.encoded_size()
    assert plan.with_sections(adapter_slots=np.empty(0, np.int32)).sections == {}
    with pytest.raises(PlanDecodeError, match="below -1"):
        StepPlan.decode(
            _sample_plan().with_sections(adapter_slots=np.array([0, -2], np.int32)).encode()
        )
    with pytest.raises(ValueError, match="adapter_slots"):
        _sample_plan().with_sections(adapter_slots=np.array([0], np.int32)).validate()


def _with_section_table(plan: StepPlan, table: list[int], payload: list[int]) -> bytes:
    """`plan`'s bytes with a hand-made section table and payload in place of its own."""
    counts = len(table) // 2
    core = _header_with(plan, s=counts)[: plan.encoded_size()]
    return core + np.array(table + payload, np.int32).tobytes()


@pytest.mark.parametrize(
    ("table", "payload", "match"),
    [
        ([99, 2], [0, 1], "unknown section id 99"),
        ([1, 1], [0], "adapter_slots of 1 values"),  # one slot per sequence, and B is 2
        ([1, 0], [], "adapter_slots of 0 values"),  # an empty section is never sent
        ([1, 2], [0], "past the end"),
        ([1, 2], [0, 1, 7], "body bytes"),  # trailing bytes after the last section
    ],
)
def test_bad_section_table_rejected(table: list[int], payload: list[int], match: str) -> None:
    with pytest.raises(PlanDecodeError, match=match):
        StepPlan.decode(_with_section_table(_sample_plan(), table, payload))


def test_unknown_section_name_refused() -> None:
    with pytest.raises(KeyError, match="no StepPlan section"):
        _sample_plan().with_sections(draft_rows=np.array([1], np.int32))
    with pytest.raises(KeyError, match="no StepPlan section"):
        _sample_plan().section("draft_rows")


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
    b = len(qsl) - 1
    plan = _sample_plan(
        query_start_loc=np.array(qsl, np.int32),
        seq_lens=np.zeros(b, np.int32),
        rows=np.zeros(b, np.int32),
    )
    with pytest.raises(PlanDecodeError, match="query_start_loc"):
        StepPlan.decode(plan.encode())


@pytest.mark.parametrize("offsets", [[1, 1], [0, 2], [0, I32_MAX]])
def test_bad_edit_offsets_rejected(offsets: list[int]) -> None:
    plan = _sample_plan(edit_offsets=np.array(offsets, np.int32))
    with pytest.raises(PlanDecodeError, match="edit_offsets"):
        StepPlan.decode(plan.encode())


@pytest.mark.parametrize("bad_index", [-1, 4, I32_MAX, I32_MIN])
def test_logits_index_out_of_range_rejected(bad_index: int) -> None:
    plan = _sample_plan(logits_indices=[2, bad_index])
    with pytest.raises(PlanDecodeError, match="logits_indices"):
        StepPlan.decode(plan.encode())
