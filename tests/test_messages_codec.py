"""The codec of the messages between the API process and rank 0 (`tp_engine.server.messages`,
`shm_ipc.wire`'s codec): every message type round-trips whatever its values (hypothesis builds
them from the types the messages declare), and a frame that is not a message is refused by
name."""

from __future__ import annotations

import typing

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.wire_strategies import record
from tp_engine.server import messages
from tp_engine.server.messages import (
    AddRequest,
    Hello,
    LoRARequest,
    MessageError,
    Ready,
    decode,
    encode,
)

MESSAGE_TYPES = typing.get_args(messages.Message)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_message_type_round_trips(cls, data):
    msg = data.draw(record(cls))
    frame = encode(msg)
    assert decode(frame) == msg
    # Decoded by name: the frame is a map whose "kind" is the class's name.
    assert msgpack.unpackb(frame)["kind"] == cls.__name__


def test_every_message_type_is_in_the_union():
    kinds = {c.__name__ for c in MESSAGE_TYPES}
    assert kinds == {
        "Hello", "Ready", "AddRequest", "AbortRequest", "EngineOutputs", "Drain", "Dead", "Exit",
        "Control", "ControlReply",
    }  # fmt: skip


def test_an_unknown_kind_is_refused_by_name():
    with pytest.raises(MessageError, match=r"Invalid value 'Launch' - at `\$\.kind`"):
        decode(msgpack.packb({"kind": "Launch", "port": 1}))
    # A record that is no message (Delta travels inside EngineOutputs only) is no kind either.
    with pytest.raises(MessageError, match=r"Invalid value 'Delta'"):
        decode(msgpack.packb({"kind": "Delta"}))


@pytest.mark.parametrize(
    ("frame", "words"),
    [
        (msgpack.packb({"port": 1}), "missing required field `kind`"),
        (msgpack.packb({"kind": "Ready"}), "missing required field `port`"),
        (msgpack.packb({"kind": "Ready", "port": "80"}), "Expected `int`, got `str` - at `$.port`"),
        (msgpack.packb({"kind": "Ready", "port": 1, "host": "x"}), "unknown field `host`"),
        (msgpack.packb([2, 8000]), "Expected `object`, got `array`"),
        (
            msgpack.packb(
                {
                    "kind": "AddRequest",
                    "request_id": "r",
                    "prompt_token_ids": [1],
                    "sampling_params": {},
                    "lora_request": ["a", 1, "/p", None],
                }
            ),
            "Expected `object | null`, got `array` - at `$.lora_request`",
        ),
        (
            msgpack.packb(
                {
                    "kind": "AddRequest",
                    "request_id": "r",
                    "prompt_token_ids": [1],
                    "sampling_params": {},
                    "lora_request": {"lora_name": "a", "lora_int_id": 0, "lora_path": "/p"},
                }
            ),
            "id must be > 0",
        ),
        (b"\xc1", "not a message of this protocol"),
    ],
)
def test_a_malformed_frame_is_refused_naming_what_is_wrong(frame, words):
    with pytest.raises(MessageError) as info:
        decode(frame)
    assert words in str(info.value)


def test_records_cross_by_name_not_position():
    """An adapter, a Hello's adapters and logprobs are maps of named fields on the wire."""
    lora = LoRARequest("a", 3, "/p/a", "base")
    add = msgpack.unpackb(encode(AddRequest("r", [1], {}, lora_request=lora)))
    assert add["lora_request"] == {
        "lora_name": "a", "lora_int_id": 3, "lora_path": "/p/a", "base_model_name": "base",
    }  # fmt: skip
    hello = msgpack.unpackb(encode(Hello("/m", ["m"], 8, 8, {}, None, 1, lora_modules=[lora])))
    assert hello["lora_modules"] == [add["lora_request"]]
    assert msgpack.unpackb(encode(Ready(8000))) == {"kind": "Ready", "port": 8000}
