"""The one codec of the messages on every process hop: msgspec's msgpack, never pickle.

Each hop's messages are `msgspec.Struct`s with named fields. A hop that carries several types
tags each by its class name under "kind" (`Message`), and its receiver decodes with one
`Decoder` of the hop's union (`decoder`), which knows every field's type: an unknown kind, a
missing or unknown field, or a value of another type is refused with an error naming it
(`decode`), so a peer of another version fails loudly instead of misreading. msgpack's
extension types are refused too: nothing but plain data and the declared types comes out.

    hop                                  messages                        module
    API process <-> rank 0 (ZeroMQ)      Hello, AddRequest, ...          tp_engine.server.messages
    rank 0 -> ranks (plan ring)          ControlCall's args              shm_ipc.control_call
    ranks <-> ranks (TP all-gather)      RankVerdict, RankCommit         shm_ipc.control_call
    workers -> rank 0 (back channel)     ReaderHello, WorkerErrorReport  shm_ipc.error_channel
    rank 0 -> workers (start-up)         Bootstrap, ChannelHandle        rank_worker.dist.bootstrap,
                                                                         shm_ipc.handle

`ENCODER` is shared: msgspec reuses its buffers between calls, and each message is encoded once
where it is made. The StepPlan keeps its own flat numpy layout (`step_plan`): it is the hot path.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

ENCODER = msgspec.msgpack.Encoder()


class Message(msgspec.Struct, frozen=True, tag=True, tag_field="kind", forbid_unknown_fields=True):
    """A message of a hop that carries several types: tagged by its class name."""


class Record(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A typed record inside a message, or the one type of a hop (no tag)."""


def _no_ext(code: int, data: memoryview) -> Any:
    raise ValueError(f"msgpack extension type {code} is not plain data")


def decoder(type_: Any) -> msgspec.msgpack.Decoder:
    """The decoder of one hop's messages (`type_`: a Struct, or a union of tagged ones)."""
    return msgspec.msgpack.Decoder(type_, ext_hook=_no_ext)


def decode(dec: msgspec.msgpack.Decoder, data: Any, error: type[Exception], what: str) -> Any:
    """`dec.decode(data)`; anything that is not the hop's message raises `error` saying `what`
    and why (msgspec names the field and the kind)."""
    try:
        return dec.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        # ValidationError is a DecodeError; a dataclass's own check (`LoRARequest`'s) raises
        # ValueError or TypeError from inside the decode.
        raise error(f"{what}: {exc}") from None


def encode(msg: Any) -> bytes:
    return ENCODER.encode(msg)
