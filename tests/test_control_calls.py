"""Control calls to every rank (`shm_ipc.ControlCall`, `rank_worker.control.protocol`, `tp_engine.executor.control`).

First the wire format and the channel in-process (fast), then the offline `LLM` at TP = 1, 2
and 4 over gloo (slow; one process group per TP size serves every scenario):

- WEIGHT_CHECKSUMS returns every rank's checksums, equal to those of that rank's shard built
  here in the test process from the checkpoint, and different between ranks where shards are;
- CHECK_NAMES refused on one chosen rank returns ok=False naming that rank, every rank's epoch
  is unchanged (nobody committed), and generation gives the same greedy tokens as before;
- a call in the middle of an asynchronously scheduled generation (a step in flight) is ordered
  with the plans: the tokens equal an uninterrupted run's.

A failed commit is `test_control_commit_failure.py` (it needs an engine of its own).
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from rank_worker.control.protocol import ControlOp, ControlOutcome, parameter_checksum
from rank_worker.tp import TPInfo, all_gather_bytes
from shm_ipc import (
    Command,
    ControlCall,
    ControlDecodeError,
    CorruptMessageError,
    PlanBroadcaster,
    PlanReceiver,
    StepPlan,
)
from shm_ipc.control_call import HEADER_SIZE
from tests.tp_cases import MAX_MODEL_LEN, build_checkpoints
from tp_engine import LLM, SamplingParams

CKPT = "tied_kv2_oddvocab"  # 2 KV heads: at TP = 4 pairs of ranks hold the same K/V shard


# -- wire format and channel ---------------------------------------------------------------------


def test_control_call_roundtrips_and_rejects_garbage() -> None:
    call = ControlCall(7, 2, {"names": ["a.b", "c"], "ranks": [2], "x": {"y": 1.5, "z": None}})
    data = call.encode()
    assert data[:4] == b"CTRL" and len(data) == call.encoded_size()
    got = ControlCall.decode(data)
    assert (got.step_id, got.op, got.args) == (7, 2, call.args)
    assert ControlCall.decode(ControlCall(1, 1).encode()).args == {}

    bad = bytearray(data)
    bad[0:4] = b"STPL"
    with pytest.raises(ControlDecodeError, match="bad magic"):
        ControlCall.decode(bytes(bad))
    with pytest.raises(ControlDecodeError, match="header says"):
        ControlCall.decode(data + b"\x00")
    with pytest.raises(ControlDecodeError, match="shorter"):
        ControlCall.decode(data[:10])
    not_a_map = data[:16] + len(msgpack.packb([1])).to_bytes(4, "little") + bytes(4)
    with pytest.raises(ControlDecodeError, match="not a map"):
        ControlCall.decode(not_a_map + msgpack.packb([1]))
    int_keys = msgpack.packb({1: 2})
    header = data[:16] + len(int_keys).to_bytes(4, "little") + bytes(4)
    with pytest.raises(ControlDecodeError):
        ControlCall.decode(header + int_keys)
    assert len(header) == HEADER_SIZE
    with pytest.raises(ValueError, match="do not encode"):
        ControlCall(1, 1, {"tensor": object()})
    with pytest.raises(ValueError, match="str keys"):
        ControlCall(1, 1, {3: "x"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="op"):
        ControlCall(1, 1 << 16).validate()


def _plan(step_id: int, num_tokens: int) -> StepPlan:
    ids = np.arange(num_tokens, dtype=np.int32)
    return StepPlan(
        step_id, Command.RUN, ids, np.array([0, num_tokens], np.int32),
        np.array([num_tokens], np.int32), np.zeros(1, np.int32), np.array([num_tokens - 1], np.int32),
        np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(1, np.int32), np.zeros(0, np.int32),
    )  # fmt: skip


def test_plans_and_calls_arrive_in_publish_order_in_slot_and_in_doorbell() -> None:
    big = {"names": [f"model.layers.{i}.weight" for i in range(400)]}  # over a 4 KiB slot
    sent: list[StepPlan | ControlCall] = []
    with (
        PlanBroadcaster(1, slot_bytes=4096, num_slots=2) as bc,
        PlanReceiver(bc.handle, 1) as rx,
    ):
        bc.wait_for_readers(10)
        for step in range(12):
            if step % 3 == 1:
                msg: StepPlan | ControlCall = ControlCall(step, 1, big if step % 2 else {})
            else:
                msg = _plan(step, 5 if step % 2 else 2000)
            bc.publish(msg)
            sent.append(msg)
            got = rx.recv()
            assert type(got) is type(msg) and got.step_id == step
            if isinstance(msg, ControlCall):
                assert isinstance(got, ControlCall) and got.args == msg.args
            else:
                assert isinstance(got, StepPlan)
                assert np.array_equal(got.input_ids, msg.input_ids)
        assert any(m.encoded_size() > 4096 for m in sent if isinstance(m, ControlCall))


def test_corrupt_control_call_is_detected_naming_rank_and_step() -> None:
    with PlanBroadcaster(1, slot_bytes=4096) as bc, PlanReceiver(bc.handle, 1) as rx:
        bc.wait_for_readers(10)
        call = ControlCall(5, 1, {"a": 1})
        bc.publish(call)
        with bc._ring.payload_view(0, call.encoded_size()) as buf:  # white box
            buf[-1] ^= 0xFF
        with pytest.raises(CorruptMessageError, match=r"rank 1, step 5: checksum"):
            rx.recv()


def test_all_gather_bytes_on_one_rank() -> None:
    assert all_gather_bytes(b"abc", TPInfo(0, 1)) == [b"abc"]


# -- every rank, through the offline LLM ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[CKPT]


def make_llm(checkpoint: Path, tp: int) -> LLM:
    return LLM(
        str(checkpoint),
        tensor_parallel_size=tp,
        block_size=4,
        num_kv_blocks=128,
        max_num_seqs=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
    )


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def llm(request, checkpoint):
    engine = make_llm(checkpoint, request.param)
    yield engine
    engine.shutdown()


PROMPTS = [[5, 9, 11, 300], [17] * 9, list(range(40, 61))]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def reference_checksums(checkpoint: Path, rank: int, size: int) -> dict[str, int]:
    """Rank `rank`'s shard of the checkpoint, built in this process without any group."""
    from rank_worker.models.architectures import build_model
    from rank_worker.models.loader import load_weights
    from rank_worker.runner.model_runner import load_hf_config

    model = build_model(load_hf_config(checkpoint), TPInfo(rank, size), torch.float32, "cpu")
    load_weights(model, checkpoint)
    return {name: parameter_checksum(p) for name, p in model.named_parameters()}


def epochs(llm: LLM) -> list[int]:
    """Every rank's count of committed calls, read with a (committed) checksum call."""
    result = llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS)
    assert result.ok, result.message
    return [reply.epoch for reply in result.replies]


@pytest.mark.slow
def test_weight_checksums_come_from_every_rank_and_match_its_shard(llm, checkpoint):
    tp = llm.engine.tp.size
    result = llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS)
    assert result.ok and result.outcome is ControlOutcome.COMMITTED and result.message == ""
    assert [reply.rank for reply in result.replies] == list(range(tp))
    for rank, got in enumerate(result.results):
        assert got == reference_checksums(checkpoint, rank, tp), f"rank {rank}"
    if tp > 1:
        first, second = result.results[0], result.results[1]
        differ = {n for n in first if first[n] != second[n]}
        # Column-parallel shards differ between ranks; norms are replicated.
        assert any("qkv_proj" in n for n in differ)
        assert not any(n.endswith("norm.weight") for n in differ)
    # The call sat between steps: it took one step id of the counter.
    step_id = llm.engine.step_id
    assert llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS).step_id == step_id
    assert llm.engine.step_id == step_id + 1


@pytest.mark.slow
def test_a_refusal_on_one_rank_changes_nothing_and_the_engine_serves_on(llm):
    tp = llm.engine.tp.size
    target = 2 if tp == 4 else tp - 1
    before = generate_tokens(llm)
    epochs_before = epochs(llm)
    checksums_before = llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS).results

    result = llm.engine.control.call(
        ControlOp.CHECK_NAMES, {"names": ["model.norm.weight", "no.such.weight"], "ranks": [target]}
    )
    assert not result.ok and result.outcome is ControlOutcome.REFUSED
    assert result.message == (
        f"rank {target} refused CHECK_NAMES: unknown parameter names ['no.such.weight']"
    )
    assert [reply.ok for reply in result.replies] == [r != target for r in range(tp)]
    assert result.results == [None] * tp

    # A refusal by every rank names every rank; an unknown argument is refused too.
    everyone = llm.engine.control.call(ControlOp.CHECK_NAMES, {"names": [], "bogus": 1})
    assert not everyone.ok
    assert [f"rank {r} refused CHECK_NAMES: unknown arguments ['bogus']" in everyone.message
            for r in range(tp)] == [True] * tp  # fmt: skip

    # Nobody committed either refused call (only the checksum calls did: the one that read
    # `checksums_before` and this one), nothing changed, and the engine serves the same tokens.
    assert epochs(llm) == [e + 2 for e in epochs_before]
    assert llm.engine.control.call(ControlOp.WEIGHT_CHECKSUMS).results == checksums_before
    assert generate_tokens(llm) == before

    accepted = llm.engine.control.call(
        ControlOp.CHECK_NAMES, {"names": ["model.norm.weight"], "ranks": [target]}
    )
    assert accepted.ok
    assert accepted.results == [1 if r == target else 0 for r in range(tp)]


@pytest.mark.slow
def test_a_call_between_async_steps_is_ordered_with_the_plans(llm):
    engine = llm.engine
    expected = generate_tokens(llm)
    engine.reconfigure(async_scheduling=True)
    try:
        params = greedy()
        ids = [engine.add_request(f"ord-{i}", p, params)[0] for i, p in enumerate(PROMPTS)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        calls = []
        steps = 0
        while engine.has_unfinished():
            for out in engine.step().outputs:
                tokens[out.seq_id] += out.new_token_ids
            steps += 1
            if steps in (2, 5):
                assert (
                    engine.core.pipeline.in_flight is not None
                )  # a step is in flight: quiesce applies it
                calls.append(engine.control.call(ControlOp.WEIGHT_CHECKSUMS))
                assert engine.core.pipeline.in_flight is None
        for _ in range(2):  # the last step in flight, if any
            for out in engine.step().outputs:
                tokens[out.seq_id] += out.new_token_ids
        assert [tokens[i] for i in ids] == expected
        assert all(c.ok for c in calls) and calls[0].results == calls[1].results
        assert calls[0].step_id < calls[1].step_id < engine.step_id
    finally:
        engine.reconfigure()
    assert generate_tokens(llm) == expected
