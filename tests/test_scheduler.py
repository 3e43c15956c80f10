"""Scheduler step by step with a fake model: exact batches, blocks, preemption and aborts."""

from __future__ import annotations

import pytest

from tests.control_plane import (
    EOS,
    Stepper,
    expected_output,
    make_scheduler,
    make_seq,
    next_token,
)
from tp_engine.core.scheduled_step import RequestRejectedError
from tp_engine.core.sequence import SequenceStatus
from tp_engine.pooling_params import PoolingParams


def batch(out) -> list[tuple[str, int]]:
    return [(s.seq_id, n) for s, n in zip(out.scheduled, out.num_scheduled_tokens, strict=True)]


def test_empty_step_is_a_normal_result():
    sched = make_scheduler()
    out, finished = Stepper(sched).step()
    assert out.is_empty and finished == [] and not sched.has_unfinished()


def test_chunked_prefill_across_block_boundaries():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    seq = make_seq("a", list(range(1, 15)), max_tokens=2)  # 14 prompt tokens
    sched.add(seq)
    st = Stepper(sched)

    out, _ = st.step()
    assert batch(out) == [("a", 6)] and out.samples == [False]
    assert sched.batch.num_computed[seq.row] == 6 and seq.block_table == [0, 1]
    assert seq.num_output_tokens == 0

    out, _ = st.step()
    assert batch(out) == [("a", 6)] and out.samples == [False]
    assert sched.batch.num_computed[seq.row] == 12 and seq.block_table == [0, 1, 2]

    out, _ = st.step()  # the last 2 prompt tokens: logits sampled
    assert batch(out) == [("a", 2)] and out.samples == [True]
    assert sched.batch.num_computed[seq.row] == 14 and seq.block_table == [0, 1, 2, 3]
    assert seq.num_output_tokens == 1

    out, finished = st.step()  # decode
    assert batch(out) == [("a", 1)] and finished == [seq]
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and seq.finish_reason == "length"
    assert seq.output_token_ids == expected_output(list(range(1, 15)), 2, 64)
    assert sched.block_manager.usage == 0.0


def test_decodes_go_first_then_prefill_chunks_then_admissions():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    st = Stepper(sched)
    sched.add(make_seq("d", [1, 2, 3], max_tokens=10))
    st.step()  # d prefilled, now decoding
    sched.add(make_seq("p", list(range(10, 30)), max_tokens=2))  # 20 tokens: chunked
    out, _ = st.step()
    assert batch(out) == [("d", 1), ("p", 7)]
    sched.add(make_seq("w", [5, 6], max_tokens=2))
    out, _ = st.step()
    assert batch(out) == [("d", 1), ("p", 7)]  # the budget is full: w waits
    out, _ = st.step()
    assert batch(out) == [("d", 1), ("p", 6), ("w", 1)]  # w's 2-token prompt is chunked too


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(
        num_blocks=32, block_size=4, max_num_batched_tokens=64, max_model_len=64,
        enable_chunked_prefill=False,
    )  # fmt: skip
    st = Stepper(sched)
    sched.add(make_seq("a", list(range(1, 41)), max_tokens=3))
    sched.add(make_seq("b", list(range(50, 80)), max_tokens=3))  # 30 tokens: 40 + 30 > 64
    out, _ = st.step()
    assert batch(out) == [("a", 40)]
    out, _ = st.step()
    assert batch(out) == [("a", 1), ("b", 30)]


def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2, num_blocks=32)
    assert sched.max_num_seqs == 2
    for i in range(3):
        sched.add(make_seq(f"r{i}", [1 + i, 2, 3], max_tokens=5))
    out, _ = Stepper(sched).step()
    assert [s.seq_id for s in out.scheduled] == ["r0", "r1"]
    assert [s.seq_id for s in sched.waiting] == ["r2"]


def test_preemption_recomputes_and_rehits_the_prefix_cache():
    # 6 blocks of 4: two sequences of 8 prompt tokens each take 2 blocks + decode blocks.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    prompts = {"a": list(range(1, 9)), "b": list(range(20, 28))}
    for rid, prompt in prompts.items():
        sched.add(make_seq(rid, prompt, max_tokens=12))
    st = Stepper(sched)
    preempted = []
    finished = []
    for _ in range(60):
        if not sched.has_unfinished():
            break
        out, done = st.step()
        preempted += [s.seq_id for s in out.preempted]
        finished += done
    assert not sched.has_unfinished()
    # Both want 5 blocks at the end (8 + 12 - 1 = 19 slots), 10 > 6: b, the most recently
    # admitted, is preempted, and on readmission its prompt comes back from the prefix cache.
    assert preempted and set(preempted) == {"b"}
    b = next(s for s in finished if s.seq_id == "b")
    assert b.num_preemptions >= 1 and b.num_cached_tokens > 0
    assert sched.block_manager.prefix_cache_hits >= b.num_cached_tokens
    for seq in finished:
        assert seq.output_token_ids == expected_output(prompts[seq.seq_id], 12, 64)
    assert sched.block_manager.usage == 0.0


def test_preempted_sequence_goes_to_the_front_of_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    st = Stepper(sched)
    sched.add(make_seq("a", list(range(1, 8)), max_tokens=8))  # 7 tokens: 2 blocks
    sched.add(make_seq("b", list(range(10, 17)), max_tokens=8))  # 7 tokens: 2 blocks
    st.step()
    assert sched.block_manager.num_free_blocks == 0
    sched.add(make_seq("c", [40, 41], max_tokens=2))
    out, _ = st.step()  # a and b decode token 7: fits in their second block
    assert batch(out) == [("a", 1), ("b", 1)]
    out, _ = st.step()  # token 8 needs a third block each: b is preempted, a proceeds
    assert batch(out) == [("a", 1)] and [s.seq_id for s in out.preempted] == ["b"]
    assert [s.seq_id for s in sched.waiting] == ["b", "c"]
    b = sched.get("b")
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=32)
    st = Stepper(sched)
    sched.add(make_seq("a", [1, 2], max_tokens=4))  # block 0
    sched.add(make_seq("b", list(range(10, 17)), max_tokens=4))  # blocks 1, 2
    st.step()
    out, _ = st.step()
    assert batch(out) == [("a", 1), ("b", 1)] and out.preempted == []
    out, _ = st.step()
    # a still fits in block 0; b's token 8 needs a fourth block. Every other running sequence
    # is already in this step, so b, the newest, steps aside itself.
    assert batch(out) == [("a", 1)]
    assert [s.seq_id for s in out.preempted] == ["b"]
    done = st.run_to_completion()
    assert {s.seq_id for s in done} == {"a", "b"}


@pytest.mark.parametrize("state", ["waiting", "running", "mid_prefill"])
def test_abort_in_every_state_frees_blocks(state):
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    st = Stepper(sched)
    sched.add(make_seq("other", [1, 2, 3], max_tokens=6))
    prompt = list(range(10, 30)) if state == "mid_prefill" else [7, 8, 9]
    sched.add(make_seq("x", prompt, max_tokens=6))
    if state != "waiting":
        st.step()
        x = sched.get("x")
        assert x.status == SequenceStatus.RUNNING and x.block_table
        assert sched.batch.is_prefill(x.row) == (state == "mid_prefill")
    seq = sched.abort("x")
    assert seq is not None and seq.status == SequenceStatus.FINISHED_ABORTED
    assert seq.finish_reason == "abort" and seq.block_table == []
    st.check()
    assert sched.abort("x") is None  # unknown now
    st.run_to_completion()
    assert sched.block_manager.usage == 0.0


def test_abort_between_schedule_and_update_discards_the_step():
    sched = make_scheduler()
    sched.add(make_seq("a", [1, 2, 3]))
    sched.add(make_seq("b", [4, 5, 6]))
    out = sched.schedule()
    a = sched.abort("a")
    result = sched.update(out, [11, 12])
    assert result.finished == [] and [s.seq_id for s in result.sampled] == ["b"]
    assert sched.get("b").output_token_ids == [12] and a.output_token_ids == []
    sched.check_integrity()


def test_finish_on_eos_stop_token_and_min_tokens():
    sched = make_scheduler()
    tokens = iter([5, 9, EOS, 5, EOS])

    st = Stepper(sched, sample=lambda seq: next(tokens))
    sched.add(make_seq("a", [1, 2], max_tokens=10, stop_token_ids=[9]))
    st.step()
    _, finished = st.step()
    assert finished and finished[0].stop_reason == 9 and finished[0].finish_reason == "stop"
    assert finished[0].output_token_ids == [5, 9]

    sched.add(make_seq("b", [1, 2], max_tokens=10, min_tokens=2))
    _, finished = st.step()  # EOS as the first token: suppressed by min_tokens... not finished
    assert finished == []
    st.step()  # 5
    _, finished = st.step()  # EOS again with 3 tokens >= min_tokens
    assert finished and finished[0].output_token_ids == [EOS, 5, EOS]
    assert finished[0].status == SequenceStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    sched = make_scheduler()
    sched.add(make_seq("a", [1, 2], max_tokens=3, ignore_eos=True))
    done = Stepper(sched, sample=lambda seq: EOS).run_to_completion()
    assert done[0].output_token_ids == [EOS] * 3 and done[0].finish_reason == "length"


def test_finish_at_max_model_len_when_max_tokens_is_unset():
    sched = make_scheduler(max_model_len=10)
    sched.add(make_seq("a", [1, 2, 3, 4], max_tokens=None))
    done = Stepper(sched).run_to_completion()
    assert done[0].num_tokens == 10 and done[0].finish_reason == "length"


def test_requests_that_can_never_fit_are_refused_with_a_reason():
    sched = make_scheduler(max_model_len=16, num_blocks=3, block_size=4)
    with pytest.raises(
        RequestRejectedError, match=r"maximum context length is 16.*10 in the prompt and 8"
    ):
        sched.add(make_seq("long", list(range(1, 11)), max_tokens=8))
    with pytest.raises(RequestRejectedError, match="leaving no room"):
        sched.add(make_seq("full", list(range(1, 17)), max_tokens=None))
    # 10 + 4 - 1 = 13 slots = 4 blocks > 3
    with pytest.raises(RequestRejectedError, match=r"4 KV blocks .* has 3 blocks"):
        sched.add(make_seq("big", list(range(1, 11)), max_tokens=4))
    sched.add(make_seq("ok", list(range(1, 11)), max_tokens=3))  # 12 slots: exactly 3 blocks
    with pytest.raises(RequestRejectedError, match="already in use"):
        sched.add(make_seq("ok", [1]))
    assert [s.seq_id for s in sched.waiting] == ["ok"]
    done = Stepper(sched).run_to_completion()
    assert done[0].output_token_ids == expected_output(list(range(1, 11)), 3, 16)


def test_n_sequences_with_a_shared_prompt_share_its_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 10))
    st = Stepper(sched)
    sched.add(make_seq("a", prompt, max_tokens=4))
    st.step()
    sched.add(make_seq("b", prompt, max_tokens=4))
    st.step()
    a, b = sched.get("a"), sched.get("b")
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert sched.block_manager.blocks[a.block_table[0]].ref_cnt == 2
    st.run_to_completion()


def test_fake_model_outputs_do_not_depend_on_scheduling():
    prompts = {f"r{i}": [1 + (i * 7 + j) % 13 for j in range(3 + 5 * i)] for i in range(6)}
    results = []
    for kwargs in (
        dict(num_blocks=64, max_num_batched_tokens=64),
        dict(num_blocks=9, max_num_batched_tokens=5),
        dict(num_blocks=9, max_num_batched_tokens=32, enable_prefix_caching=False),
        dict(num_blocks=12, max_num_batched_tokens=64, enable_chunked_prefill=False),
    ):
        sched = make_scheduler(block_size=4, max_model_len=64, max_num_seqs=4, **kwargs)
        for rid, prompt in prompts.items():
            sched.add(make_seq(rid, prompt, max_tokens=9))
        done = Stepper(sched, sample=next_token).run_to_completion()
        results.append({s.seq_id: s.output_token_ids for s in done})
    expected = {rid: expected_output(p, 9, 64) for rid, p in prompts.items()}
    assert all(r == expected for r in results)


# -- asynchronous scheduling: step t+1 is scheduled before step t is applied ---------------------


def test_async_decode_reads_the_in_flight_sample_as_a_placeholder():
    sched = make_scheduler(num_blocks=16, block_size=4)
    a = make_seq("a", [5, 6, 7], max_tokens=3)
    b = make_seq("b", [8, 9], max_tokens=3)
    sched.add(a)
    sched.add(b)
    st = Stepper(sched, async_scheduling=True)

    first, _ = st.step()  # both prefills launched; nothing applied yet
    assert first.samples == [True, True] and a.num_output_tokens == 0
    rb = sched.batch  # a is running: its counters are its row's
    assert (rb.num_inflight[a.row], rb.num_placeholders[a.row]) == (3, 1)

    second, finished = st.step()  # decodes of the tokens still being sampled; step 1 applied
    assert batch(second) == [("a", 1), ("b", 1)] and finished == []
    assert second.input_rows == [0, 1] and second.starts == [3, 2]
    assert a.num_output_tokens == 1 and rb.num_computed[a.row] == 3
    assert (rb.num_inflight[a.row], rb.num_placeholders[a.row]) == (1, 1)

    done = st.run_to_completion()
    assert sorted(s.seq_id for s in done) == ["a", "b"]
    assert a.output_token_ids == expected_output([5, 6, 7], 3, 64)
    assert b.output_token_ids == expected_output([8, 9], 3, 64)
    assert sched.block_manager.usage == 0.0


def test_async_a_token_known_to_be_the_last_is_not_decoded_again():
    sched = make_scheduler(num_blocks=16, block_size=4)
    a = make_seq("a", [5, 6, 7], max_tokens=1)
    sched.add(a)
    st = Stepper(sched, async_scheduling=True)
    st.step()
    out, finished = st.step()  # a's one token is in flight: nothing to schedule
    assert out.is_empty and finished == [a] and a.finish_reason == "length"
    assert a.output_token_ids == expected_output([5, 6, 7], 1, 64)


def test_async_eos_discards_the_row_scheduled_behind_it():
    sched = make_scheduler(num_blocks=16, block_size=4)
    a = make_seq("a", [5, 6, 7], max_tokens=8)
    keep = make_seq("keep", [1, 2], max_tokens=4)
    sched.add(a)
    sched.add(keep)
    # "a" samples EOS as its second token; "keep" runs the fake model.
    st = Stepper(
        sched,
        sample=lambda s: EOS if s is a and s.num_output_tokens == 1 else next_token(s),
        async_scheduling=True,
    )
    st.step()  # prefills
    st.step()  # decode 1 of both; prefill tokens applied
    out, finished = st.step()  # decode 2 launched; decode 1 (EOS for a) applied
    assert [s.seq_id for s in out.scheduled] == ["a", "keep"]
    assert finished == [a] and a.output_token_ids[-1] == EOS and a.block_table == []
    _, finished = st.step()  # a's extra row is discarded
    assert a.num_output_tokens == 2 and a.finish_reason == "stop"
    st.run_to_completion()
    assert keep.output_token_ids == expected_output([1, 2], 4, 64)
    assert sched.block_manager.usage == 0.0


def test_async_preempting_a_sequence_in_flight_discards_its_sample():
    # 4 blocks of 2: "old" and "new" grow until one must go; "new" is preempted while its
    # decode is in flight, loses that sample and recomputes to the same output.
    sched = make_scheduler(num_blocks=4, block_size=2, max_model_len=8)
    old = make_seq("old", [1, 2, 3], max_tokens=4)
    new = make_seq("new", [4, 5, 6], max_tokens=4)
    sched.add(old)
    sched.add(new)
    st = Stepper(sched, async_scheduling=True)
    preempted_in_flight = False
    for _ in range(40):
        if not st.has_work():
            break
        in_flight = st.in_flight[0].scheduled if st.in_flight else []
        out, _ = st.step()
        for victim in out.preempted:
            assert victim.num_placeholders == victim.num_inflight_tokens == 0
            preempted_in_flight |= any(s is victim for s in in_flight)
    assert preempted_in_flight and new.num_preemptions >= 1
    assert old.output_token_ids == expected_output([1, 2, 3], 4, 8)
    assert new.output_token_ids == expected_output([4, 5, 6], 4, 8)
    assert sched.block_manager.usage == 0.0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_and_sync_scheduling_give_the_same_outputs(async_scheduling):
    sched = make_scheduler(num_blocks=12, block_size=2, max_num_batched_tokens=5, max_num_seqs=3)
    prompts = [[1 + (i * 7 + j) % 5 for j in range(3 + i % 4)] for i in range(8)]
    seqs = [make_seq(f"r{i}", p, max_tokens=5) for i, p in enumerate(prompts)]
    for seq in seqs:
        sched.add(seq)
    Stepper(sched, async_scheduling=async_scheduling).run_to_completion()
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == expected_output(prompt, 5, 64)


def test_async_a_sequence_about_to_end_leaves_its_place_to_a_waiting_one():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=1)
    a = make_seq("a", [5, 6, 7], max_tokens=1)
    b = make_seq("b", [8, 9], max_tokens=2)
    sched.add(a)
    sched.add(b)
    st = Stepper(sched, async_scheduling=True)
    first, _ = st.step()
    assert batch(first) == [("a", 3)]
    second, finished = st.step()  # a's only token is in flight: b starts right away
    assert batch(second) == [("b", 2)] and finished == [a]
    st.run_to_completion()
    assert b.output_token_ids == expected_output([8, 9], 2, 64)


def test_prompt_logprobs_take_at_most_max_num_seqs_logits_rows_per_step():
    # Each prompt token computed for prompt logprobs costs a [vocab] logits row: a step takes
    # at most max_num_seqs (4) of them, so long prompts asking for them go in small chunks.
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=32)
    a = make_seq("a", list(range(1, 11)), max_tokens=2, prompt_logprobs=1)
    plain = make_seq("plain", list(range(20, 30)), max_tokens=2)
    b = make_seq("b", list(range(40, 43)), max_tokens=2, prompt_logprobs=0)
    for seq in (a, plain, b):
        sched.add(seq)
    st = Stepper(sched)
    out, _ = st.step()
    assert batch(out) == [("a", 4), ("plain", 10)]  # b would need rows this step lacks
    out, _ = st.step()
    assert batch(out) == [("plain", 1), ("a", 4)]
    out, _ = st.step()
    assert batch(out) == [("a", 2), ("b", 2)]  # plain is done; b gets the 2 rows left
    done = st.run_to_completion()
    assert {s.seq_id for s in done} == {"a", "b"} and plain.finish_reason == "length"
    assert a.output_token_ids == expected_output(list(range(1, 11)), 2, 64)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prompt_only_sequence_computes_its_prompt_and_samples_nothing(async_scheduling):
    """max_tokens 0 (echo with max_tokens 0, scoring a prompt): every prompt token is computed,
    no logits row is sampled, and the sequence ends "length" with no output token."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    seq = make_seq("a", list(range(1, 15)), max_tokens=0)  # 14 prompt tokens: chunks 6, 6, 2
    sched.add(seq)
    st = Stepper(sched, async_scheduling=async_scheduling)
    steps = []
    while st.has_work():
        out, finished = st.step()
        steps.append((batch(out), out.samples, [s.seq_id for s in finished]))
    last = [([("a", 2)], [False], [] if async_scheduling else ["a"])]
    # Asynchronous: the last chunk is applied by the next (empty) step, which schedules nothing.
    tail = [([], [], ["a"])] if async_scheduling else []
    assert steps == [([("a", 6)], [False], []), ([("a", 6)], [False], []), *last, *tail]
    assert seq.status == SequenceStatus.FINISHED_LENGTH_CAPPED and seq.output_token_ids == []
    assert seq.num_computed_tokens == 14 and sched.block_manager.usage == 0.0


def test_a_pooling_sequence_ends_stopped():
    """A pooling request is prompt-only too, but its prompt is all it asked for: it ends
    "stop", as vLLM's pooling requests do (the server's Delta and /metrics label), not
    "length" as a max_tokens=0 generation."""
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=6)
    seq = make_seq("a", list(range(1, 15)), max_tokens=0)
    seq.pooling_params = PoolingParams("embed")
    sched.add(seq)
    (done,) = Stepper(sched, async_scheduling=True).run_to_completion()
    assert done is seq and seq.finish_reason == "stop" and seq.output_token_ids == []
    assert sched.block_manager.usage == 0.0


def test_a_prompt_only_sequence_needs_blocks_for_its_whole_prompt():
    # 17 tokens = 5 blocks of 4; a sampling request would need KV for 16 + max_tokens - 1.
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(RequestRejectedError, match="5 KV blocks"):
        sched.add(make_seq("a", list(range(1, 18)), max_tokens=0))
    sched.add(make_seq("b", list(range(1, 17)), max_tokens=0))
    assert Stepper(sched).run_to_completion()[0].output_token_ids == []
