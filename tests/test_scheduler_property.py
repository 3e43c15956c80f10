"""Random add / step / abort / reset sequences on tiny pools, every invariant after every operation.

The fake model's next token depends only on the tokens so far, so every request that finishes
must have exactly the output it would have had alone, however often it was chunked, preempted,
recomputed from the prefix cache or batched with others, with synchronous or asynchronous
scheduling (steps pipelined one deep, decodes reading placeholders).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.control_plane import Stepper, expected_output, make_scheduler, make_seq
from tp_engine.core.scheduled_step import RequestRejectedError
from tp_engine.core.sequence import SequenceStatus

MAX_MODEL_LEN = 24
# A small alphabet makes shared prefixes (and so prefix-cache hits) common.
prompts = st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=12)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        capacity=st.integers(min_value=8, max_value=32),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.integers(min_value=2, max_value=20),
        max_num_seqs=st.integers(min_value=1, max_value=6),
        chunked=st.booleans(),
        caching=st.booleans(),
        async_scheduling=st.booleans(),
    )
    def setup(self, capacity, block_size, budget, max_num_seqs, chunked, caching, async_scheduling):
        num_blocks = capacity // block_size  # a pool of 8 to 32 token slots
        if not chunked:
            budget = max(budget, MAX_MODEL_LEN)
        self.sched = make_scheduler(
            num_blocks=num_blocks,
            block_size=block_size,
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            enable_chunked_prefill=chunked,
            enable_prefix_caching=caching,
        )
        self.stepper = Stepper(self.sched, async_scheduling=async_scheduling)
        self.next_id = 0
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.finished = []
        self.num_preemptions = 0

    # max_tokens 0: a prompt-only request (computes its prompt, samples nothing).
    @rule(requests=st.lists(st.tuples(prompts, st.integers(0, 12)), min_size=1, max_size=3))
    def add(self, requests):
        for prompt, max_tokens in requests:
            self._add(prompt, max_tokens)

    def _add(self, prompt, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.sched.add(make_seq(rid, prompt, max_tokens=max_tokens))
        except RequestRejectedError:
            bm = self.sched.block_manager
            too_long = len(prompt) + max_tokens > MAX_MODEL_LEN
            needed = max(len(prompt) + max_tokens - 1, len(prompt))
            too_big = bm.blocks_needed(needed) > bm.num_blocks
            assert too_long or too_big
            return
        self.requests[rid] = (prompt, max_tokens)

    @rule(num_steps=st.integers(min_value=1, max_value=4))
    def step(self, num_steps):
        for _ in range(num_steps):
            had_in_flight = self.stepper.in_flight is not None
            out, finished = self.stepper.step()
            self.num_preemptions += len(out.preempted)
            if self.sched.has_unfinished() and not out.preempted and not had_in_flight:
                # (A step in flight may hold the blocks or the last tokens of what is left.)
                assert not out.is_empty, "nothing scheduled although requests are unfinished"
            self.finished += finished

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = [s.seq_id for s in list(self.sched.waiting) + self.sched.running]
        rid = data.draw(st.sampled_from(live))
        seq = self.sched.abort(rid)
        assert seq is not None and seq.status == SequenceStatus.FINISHED_ABORTED
        assert seq.block_table == []
        del self.requests[rid]

    @rule()
    def reset_prefix_cache(self):
        self.sched.block_manager.reset_prefix_cache()

    @invariant()
    def integrity(self):
        self.stepper.check()

    def teardown(self):
        # Drain: everything left finishes in bounded steps, with the same output as alone.
        self.finished += self.stepper.run_to_completion(max_steps=2_000)
        for seq in self.finished:
            if seq.seq_id in self.requests:
                prompt, max_tokens = self.requests[seq.seq_id]
                assert seq.output_token_ids == expected_output(prompt, max_tokens, MAX_MODEL_LEN)
        bm = self.sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0
        assert all(block.ref_cnt == 0 for block in bm.blocks)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
