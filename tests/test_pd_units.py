"""Prefill/decode disaggregation's parts without servers: a decode's held requests and their
blocks (`core.remote_prompts`), a prefill's kept blocks (`BlockAllocation.kept`), the request
fields a router adds (`api.disagg_fields`), the bootstrap server's routes, the wire."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from shm_ipc import wire
from shm_ipc.pd_wire import KVRequest, KVStatus, PDWireError, PeerRank, Region, decode_pd
from tests.control_plane import EOS, Stepper, expected_output, make_scheduler, make_seq
from tp_engine.core.remote_prompts import RemotePrompts
from tp_engine.core.sequence import SequenceStatus, TokenLogprobs
from tp_engine.server.api.disagg_fields import bootstrap_of
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.messages import Bootstrap
from tp_engine.server.rank0.disagg.bootstrap import BootstrapServer


def batch(out) -> list[tuple[str, int]]:
    return [(s.seq_id, n) for s, n in zip(out.scheduled, out.num_scheduled_tokens, strict=True)]


# -- a decode's requests ---------------------------------------------------------------------------


def test_an_arrived_prompt_computes_only_its_first_token_and_decodes_as_if_computed():
    sched = make_scheduler(num_blocks=16, block_size=4)
    remote = RemotePrompts(lambda: sched, [EOS])
    prompt = list(range(1, 11))  # 10 tokens: 3 blocks
    expected = expected_output(prompt, 4, 64)
    seq = make_seq("a", prompt, max_tokens=4)
    remote.hold(seq)
    assert remote.reserved("a") is None  # held, no blocks yet
    assert remote.reserve() == [seq] and len(seq.block_table) == 3
    assert remote.reserved("a") is seq
    assert sched.block_manager.num_free_blocks == 13
    assert not sched.has_unfinished()  # held outside the scheduler: no step is owed to it
    assert remote.arrive("a", expected[0], None) is seq
    assert seq.status == SequenceStatus.WAITING and seq.num_cached_tokens == 10
    assert sched.block_manager.external_hits == 10
    st = Stepper(sched)
    out, _ = st.step()
    # One token: the prefill's first, at position 10; nothing of the prompt.
    assert batch(out) == [("a", 1)] and out.samples == [True]
    assert list(out.starts) == [10]
    while sched.has_unfinished():
        st.step()
    assert seq.output_token_ids == expected
    assert sched.block_manager.usage == 0.0


def test_held_requests_wait_for_blocks_in_arrival_order():
    sched = make_scheduler(num_blocks=4, block_size=4)
    remote = RemotePrompts(lambda: sched, [EOS])
    big, small = make_seq("big", list(range(1, 14))), make_seq("small", [1, 2])
    sched.block_manager.take_blocks(1)  # someone else holds one: 3 left, "big" needs 4
    remote.hold(big)
    remote.hold(small)
    assert remote.reserve() == []  # "small" fits but waits behind "big"
    assert len(remote) == 2


def test_a_first_token_that_ends_the_request_frees_its_blocks_at_once():
    sched = make_scheduler(num_blocks=8, block_size=4)
    remote = RemotePrompts(lambda: sched, [EOS])
    for seq_id, token, max_tokens, status in (
        ("eos", EOS, 5, SequenceStatus.FINISHED_STOPPED),
        ("one", 7, 1, SequenceStatus.FINISHED_LENGTH_CAPPED),
    ):
        seq = make_seq(seq_id, [1, 2, 3, 4, 5], max_tokens=max_tokens)
        remote.hold(seq)
        remote.reserve()
        assert remote.arrive(seq_id, token, None) is seq
        assert seq.status == status and seq.output_token_ids == [token]
    assert sched.block_manager.usage == 0.0 and not sched.has_unfinished()


def test_dropped_and_aborted_requests_give_their_blocks_back():
    sched = make_scheduler(num_blocks=8, block_size=4)
    remote = RemotePrompts(lambda: sched, [EOS])
    waiting, reserved = make_seq("w", [1] * 20), make_seq("r", [1, 2, 3])
    remote.hold(reserved)
    remote.reserve()
    remote.hold(waiting)  # 20 tokens: 5 blocks, 7 free: reserved next
    assert remote.drop("r", SequenceStatus.FINISHED_ABORTED) is reserved
    assert remote.drop("w", SequenceStatus.FINISHED_ABORTED) is waiting
    assert remote.drop("r", SequenceStatus.FINISHED_ABORTED) is None
    assert sched.block_manager.usage == 0.0 and len(remote) == 0
    # An arrived one aborted while it waits for admission.
    seq = make_seq("q", [1, 2, 3])
    remote.hold(seq)
    remote.reserve()
    remote.arrive("q", 9, TokenLogprobs([9], [-0.5], 1))
    assert sched.abort("q") is seq
    assert sched.block_manager.usage == 0.0


def test_a_preempted_arrived_request_recomputes_its_prompt():
    sched = make_scheduler(num_blocks=16, block_size=4)
    remote = RemotePrompts(lambda: sched, [EOS])
    prompt = list(range(1, 11))
    expected = expected_output(prompt, 3, 64)
    seq = make_seq("a", prompt, max_tokens=3)
    remote.hold(seq)
    remote.reserve()
    remote.arrive("a", expected[0], None)
    st = Stepper(sched)
    st.step()
    sched.allocation.preempt(seq)
    assert not seq.prompt_arrived and seq.block_table == []
    out, _ = st.step()
    assert batch(out) == [("a", 12)]  # the prompt and the two tokens so far, computed here
    while sched.has_unfinished():
        st.step()
    assert seq.output_token_ids == expected


# -- a prefill's kept blocks -----------------------------------------------------------------------


def test_a_prefills_finished_request_keeps_its_blocks_until_released():
    sched = make_scheduler(num_blocks=8, block_size=4)
    seq = make_seq("p", [1, 2, 3, 4, 5, 6], max_tokens=1)
    seq.keeps_blocks = True
    sched.add(seq)
    _, finished = Stepper(sched).step()
    assert finished == [seq] and seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED
    kept = sched.allocation.kept["p"]
    assert kept is seq and len(seq.block_table) == 2
    assert sched.block_manager.usage == 2 / 8
    sched.allocation.release_kept("p")
    assert sched.block_manager.usage == 0.0 and "p" not in sched.allocation.kept
    # An aborted one keeps nothing.
    other = make_seq("q", [1, 2, 3], max_tokens=3)
    other.keeps_blocks = True
    sched.add(other)
    Stepper(sched).step()
    sched.abort("q")
    assert "q" not in sched.allocation.kept and sched.block_manager.usage == 0.0


# -- the router's fields ---------------------------------------------------------------------------


class _Req:
    def __init__(self, **fields):
        self.bootstrap_host = fields.pop("bootstrap_host", None)
        self.bootstrap_port = fields.pop("bootstrap_port", None)
        self.bootstrap_room = fields.pop("bootstrap_room", None)
        self.model_extra = fields


def test_bootstrap_fields_one_per_prompt_and_headers_win():
    assert bootstrap_of(_Req(), {}, 2) is None
    one = bootstrap_of(_Req(bootstrap_host="h", bootstrap_port=None, bootstrap_room=5), {}, 1)
    assert one == [Bootstrap("h", None, 5)]
    lists = _Req(bootstrap_host=["a", "b"], bootstrap_port=[1, None], bootstrap_room=[7, 8])
    assert bootstrap_of(lists, {}, 2) == [Bootstrap("a", 1, 7), Bootstrap("b", None, 8)]
    headers = {"x-override-bootstrap-host": "x", "x-override-bootstrap-port": "99",
               "x-override-bootstrap-room": "3"}  # fmt: skip
    assert bootstrap_of(_Req(bootstrap_host="h", bootstrap_room=5), headers, 1) == [
        Bootstrap("x", 99, 3)
    ]
    with pytest.raises(APIError, match="bootstrap_room has 1 values for 2 prompts"):
        bootstrap_of(_Req(bootstrap_host="h", bootstrap_room=[1]), {}, 2)
    with pytest.raises(APIError, match="bootstrap_port must be a non-negative integer"):
        bootstrap_of(_Req(bootstrap_host="h", bootstrap_port=-1, bootstrap_room=1), {}, 1)


# -- the bootstrap server and the wire -------------------------------------------------------------


def _get(port: int, path: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_bootstrap_server_answers_503_until_ready_then_sglangs_routes():
    server = BootstrapServer("127.0.0.1", 0)
    try:
        info_path = (
            "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        )
        assert _get(server.port, info_path)[0] == 503
        server.ready({"attn_tp_size": 2, "page_size": 16}, [{"session": "a"}, {"session": "b"}])
        assert _get(server.port, info_path) == (200, {"attn_tp_size": 2, "page_size": 16})
        assert _get(server.port, "/route?target_tp_rank=1") == (200, {"session": "b"})
        assert _get(server.port, "/route?target_tp_rank=2")[0] == 404
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health") as reply:
            assert reply.status == 200
    finally:
        server.close()


def test_pd_messages_round_trip_and_refuse_strangers():
    region = Region(1 << 40, 28, 4096, 2048, 512, 4)
    ask = KVRequest(7, 33, [4, 5, 9], [PeerRank("127.0.0.1:1234", region)], "tcp://h:1")
    assert decode_pd(wire.encode(ask), "peer") == ask
    status = KVStatus(7, None, 42, ([42, 3], [-0.1, -2.0], 1))
    assert decode_pd(wire.encode(status), "peer") == status
    with pytest.raises(PDWireError, match="peer"):
        decode_pd(wire.encode({"kind": "Nope"}), "peer")
