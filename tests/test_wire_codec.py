"""The one codec (`shm_ipc.wire`) on the hops below the server: rank 0's control calls and the
ranks' replies (`shm_ipc.control_call`), the workers' back channel (`shm_ipc.error_channel`) and
the channel handle rank 0 gives them (`shm_ipc.handle`). Every record round-trips whatever its
values, and what is not the hop's message is refused naming why."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm_ipc import wire
from shm_ipc.control_call import (
    ControlCall,
    ControlDecodeError,
    RankCommit,
    RankVerdict,
    pack_reply,
    unpack_commit,
    unpack_verdict,
)
from shm_ipc.error_channel import ReaderHello, WorkerErrorReport, decode_back_message
from shm_ipc.handle import ChannelHandle
from tests.wire_strategies import PLAIN, record

HOPS = [
    (RankVerdict, pack_reply, unpack_verdict),
    (RankCommit, pack_reply, unpack_commit),
    (ReaderHello, wire.encode, decode_back_message),
    (WorkerErrorReport, wire.encode, decode_back_message),
    (ChannelHandle, ChannelHandle.to_bytes, ChannelHandle.from_bytes),
]


@pytest.mark.parametrize(("cls", "pack", "unpack"), HOPS, ids=lambda h: getattr(h, "__name__", ""))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_record_of_the_other_hops_round_trips(cls, pack, unpack, data):
    msg = data.draw(record(cls))
    assert unpack(pack(msg)) == msg


@settings(max_examples=60, deadline=None)
@given(step_id=st.integers(0, 2**64 - 1), op=st.integers(0, 0xFFFF),
       args=st.dictionaries(st.text(max_size=6), PLAIN, max_size=4))  # fmt: skip
def test_a_control_call_round_trips(step_id, op, args):
    got = ControlCall.decode(ControlCall(step_id, op, args).encode())
    assert (got.step_id, got.op, got.args) == (step_id, op, args)


def test_the_other_hops_refuse_what_is_not_theirs():
    hello = msgpack.packb({"kind": "ReaderHello", "rank": 1, "pid": 2})
    assert decode_back_message(hello) == ReaderHello(1, 2)
    # The back channel's old untyped shape, and a kind of another hop, are refused by name.
    with pytest.raises(ValueError, match=r"Invalid value 'hello' - at `\$\.kind`"):
        decode_back_message(msgpack.packb({"kind": "hello", "rank": 1, "pid": 2}))
    with pytest.raises(ValueError, match="Invalid value 'Ready'"):
        decode_back_message(msgpack.packb({"kind": "Ready", "port": 1}))
    with pytest.raises(ControlDecodeError, match="missing required field `epoch`"):
        unpack_verdict(msgpack.packb({"ok": True, "message": ""}))
    with pytest.raises(ControlDecodeError, match="Expected `object`, got `array`"):
        unpack_commit(msgpack.packb([True, "", None, 1]))
    with pytest.raises(ValueError, match="does not encode"):
        pack_reply(RankCommit(True, "", object(), 1))
    ext = msgpack.packb({"x": msgpack.ExtType(5, b"data")})
    header = ControlCall(1, 1, {"x": 1}).encode()[:16] + len(ext).to_bytes(4, "little") + bytes(4)
    with pytest.raises(ControlDecodeError, match="extension type 5 is not plain data"):
        ControlCall.decode(header + ext)


def test_a_workers_bootstrap_crosses_as_one_typed_record():
    from rank_worker.dist.bootstrap import Bootstrap
    from rank_worker.runner_config import RunnerConfig

    handle = ChannelHandle("tpe-1-ab", "/r/plan.sock", "/r/back.sock", "/r", 7, 4096, 3, 1)
    config = RunnerConfig(max_model_len=64, block_size=16, hf_overrides={"rope_theta": 1e6})
    boot = Bootstrap("/m", config, handle)
    assert Bootstrap.from_bytes(boot.to_bytes()) == boot
    fields = msgpack.unpackb(boot.to_bytes())
    assert fields["runner_config"]["block_size"] == 16 and fields["channel"]["owner_pid"] == 7
    fields["runner_config"]["no_such_flag"] = 1
    with pytest.raises(ValueError, match="no_such_flag"):
        Bootstrap.from_bytes(msgpack.packb(fields))
