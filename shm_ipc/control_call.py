"""The ControlCall: rank 0 asks every rank to do something other than a forward pass.

Ownership: rank 0 (`tp_engine.executor.control.EngineControl`) builds one per call and publishes it on
the plan channel, so it is ordered with the StepPlans around it: every rank sees the plans
published before it, then the call, then the plans after it, exactly as rank 0 sent them. What
an op number means and what its arguments are is `rank_worker.control.protocol`'s business; this module
knows numbers and a msgpack map, not models.

It travels like a plan: one ring slot (or the doorbell when it is bigger than a slot), the same
checksum and acknowledgements. The doorbell's kind (`DoorbellKind.CONTROL`, see `channel.py`)
tells the receiver which decoder to use, and the payload's magic checks it again.

Wire format (little-endian, explicit; nothing unpickled):

    offset  size  field
    0       4     magic  b"CTRL"
    4       2     version (uint16)
    6       2     op (uint16; a `rank_worker.control.protocol.ControlOp` number)
    8       8     step_id (uint64; from the same counter as the plans' step ids)
    16      4     args_length L (uint32)
    20      4     (reserved, 0)
    24      L     args: one msgpack map with str keys (msgpack's own types only: no ext types,
                  so nothing but plain data can come out of it), by `shm_ipc.wire`'s codec

`decode` checks the magic, the version, that the length matches L exactly and that the args
are a map with str keys. The header stays a fixed layout, as the StepPlan's does: the doorbell
and the ring read calls and plans alike.

The replies travel between the ranks, not to rank 0 alone: both phases all-gather every rank's
`RankVerdict` (prepare: ok or why not) and then its `RankCommit` (the commit's result) over the
TP group (`rank_worker.control`), as typed records of `shm_ipc.wire`'s codec.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shm_ipc import wire

MAGIC = b"CTRL"
VERSION = 1
_HEADER = struct.Struct("<4sHHQII")
HEADER_SIZE = _HEADER.size  # 24 bytes
_MAX_OP = 0xFFFF


class ControlDecodeError(ValueError):
    """Bytes that are not a well-formed ControlCall."""


_ARGS = wire.decoder(dict[str, Any])


def _pack_args(args: Mapping[str, Any]) -> bytes:
    if not isinstance(args, Mapping) or not all(isinstance(k, str) for k in args):
        raise ValueError(f"ControlCall.args must be a map with str keys, got {args!r:.200}")
    try:
        # A tuple arrives as a list: msgpack has one array type.
        return wire.encode(dict(args))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"ControlCall.args do not encode as msgpack: {exc}") from None


class RankVerdict(wire.Record, frozen=True):
    """One rank's answer to a call's prepare phase, all-gathered before anyone writes."""

    ok: bool
    message: str  # why not, naming the rank and the op; "" when ok
    epoch: int  # calls this rank had committed when it answered


class RankCommit(wire.Record, frozen=True):
    """One rank's commit, all-gathered after the writes."""

    ok: bool  # whether the commit succeeded
    message: str  # why not; "" when ok
    result: Any  # the commit's value (msgpack data); None unless this rank committed
    epoch: int  # calls this rank has committed, this one included when ok


_VERDICT = wire.decoder(RankVerdict)
_COMMIT = wire.decoder(RankCommit)


def pack_reply(reply: RankVerdict | RankCommit) -> bytes:
    """A rank's verdict or commit for the gather; ValueError when its result does not encode
    (that rank's commit then fails)."""
    try:
        return wire.encode(reply)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"the control call's result does not encode as msgpack: {exc}") from None


def unpack_verdict(data: bytes) -> RankVerdict:
    return wire.decode(_VERDICT, data, ControlDecodeError, "not a rank's verdict")


def unpack_commit(data: bytes) -> RankCommit:
    return wire.decode(_COMMIT, data, ControlDecodeError, "not a rank's commit")


@dataclass(frozen=True)
class ControlCall:
    """One control call to every rank (see the module docstring)."""

    # From rank 0's step counter: errors and timeouts name it, and the plans around it have
    # the ids just before and after it.
    step_id: int
    # What to do, as a number (`rank_worker.control.protocol.ControlOp`); shm_ipc never interprets it.
    op: int
    # The op's arguments; small metadata only (names, shapes). Bulk data never rides here: it
    # goes over the process group or is read by each rank.
    args: Mapping[str, Any] = field(default_factory=dict)
    # The msgpack encoding of `args`, made once at construction (which so refuses args that do
    # not encode, on rank 0, before anything is published).
    packed_args: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "packed_args", _pack_args(self.args))

    def validate(self) -> None:
        """Check the header fields fit their wire types; raises ValueError naming the field."""
        if not 0 <= self.op <= _MAX_OP:
            raise ValueError(f"ControlCall.op must be in 0..{_MAX_OP}, got {self.op}")
        if not 0 <= self.step_id < 1 << 64:
            raise ValueError(f"ControlCall.step_id must fit a uint64, got {self.step_id}")
        if len(self.packed_args) >= 1 << 32:
            raise ValueError(f"ControlCall.args take {len(self.packed_args)} bytes, over 4 GiB")

    # -- wire format ------------------------------------------------------------------------

    def encoded_size(self) -> int:
        return HEADER_SIZE + len(self.packed_args)

    def encode_into(self, buf: memoryview) -> int:
        """Write the call into `buf` (at least `encoded_size()` bytes); returns bytes written."""
        size = self.encoded_size()
        if len(buf) < size:
            raise ValueError(f"buffer of {len(buf)} bytes is too small for a {size}-byte call")
        _HEADER.pack_into(buf, 0, MAGIC, VERSION, self.op, self.step_id, len(self.packed_args), 0)
        buf[HEADER_SIZE:size] = self.packed_args
        return size

    def encode(self) -> bytes:
        buf = bytearray(self.encoded_size())
        self.encode_into(memoryview(buf))
        return bytes(buf)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> ControlCall:
        view = memoryview(data).cast("B")
        if len(view) < HEADER_SIZE:
            raise ControlDecodeError(
                f"{len(view)} bytes is shorter than the {HEADER_SIZE}-byte header"
            )
        magic, version, op, step_id, length, reserved = _HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise ControlDecodeError(f"bad magic {magic!r}")
        if version != VERSION:
            raise ControlDecodeError(f"control call version {version}, this build reads {VERSION}")
        if reserved:
            raise ControlDecodeError(f"reserved header field is {reserved}, not 0")
        if len(view) != HEADER_SIZE + length:
            raise ControlDecodeError(
                f"control call of {len(view)} bytes, header says {HEADER_SIZE + length}"
            )
        args = wire.decode(
            _ARGS, view[HEADER_SIZE:], ControlDecodeError, "args are not a map with str keys"
        )
        return cls(step_id, op, args)
