"""StepPlan building against a slow, obviously-correct reference on random batches."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shm_ipc.step_plan import Command, StepPlan
from tests.control_plane import check_plan
from tp_engine.plan_builder import build_step_plan
from tp_engine.scheduler import SchedulerOutput
from tp_engine.sequence import Sequence


@st.composite
def batches(draw) -> tuple[SchedulerOutput, int]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    out = SchedulerOutput()
    free_ids = list(range(1000))
    draw(st.randoms()).shuffle(free_ids)  # block ids in any order, as after churn
    for i in range(draw(st.integers(min_value=0, max_value=8))):
        num_tokens = draw(st.integers(min_value=1, max_value=70))
        seq = Sequence(
            f"s{i}",
            draw(st.lists(st.integers(0, 50_000), min_size=num_tokens, max_size=num_tokens)),
        )
        seq.num_computed_tokens = draw(st.integers(min_value=0, max_value=num_tokens - 1))
        num_new = draw(st.integers(min_value=1, max_value=num_tokens - seq.num_computed_tokens))
        # Sometimes more blocks than this step needs (a sequence's table is never shorter).
        num_blocks = -(-(seq.num_computed_tokens + num_new) // block_size) + draw(st.integers(0, 2))
        seq.block_table = [free_ids.pop() for _ in range(num_blocks)]
        out._add(seq, num_new)
    return out, block_size


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(min_value=0, max_value=2**40))
def test_plan_matches_the_per_token_reference(batch, step_id):
    out, block_size = batch
    plan = build_step_plan(out, block_size, step_id)
    assert plan.step_id == step_id and plan.command == Command.RUN
    assert plan.num_seqs == len(out.scheduled) and plan.num_tokens == out.num_batched_tokens
    check_plan(plan, out, block_size)
    # What the ranks receive is the same plan.
    decoded = StepPlan.decode(plan.encode())
    check_plan(decoded, out, block_size)


def test_decode_only_batch():
    seqs = []
    out = SchedulerOutput()
    for i, (n, table) in enumerate([(5, [7, 3]), (1, [9]), (8, [2, 4])]):
        seq = Sequence(f"d{i}", list(range(100 * i, 100 * i + n)))
        seq.num_computed_tokens = n - 1
        seq.block_table = table
        seqs.append(seq)
        out._add(seq, 1)
    plan = build_step_plan(out, block_size=4, step_id=3)
    np.testing.assert_array_equal(plan.input_ids, [4, 100, 207])
    np.testing.assert_array_equal(plan.positions, [4, 0, 7])
    # token 4 of d0 -> block_table[1] = 3, offset 0; token 7 of d2 -> block 4, offset 3
    np.testing.assert_array_equal(plan.slot_mapping, [12, 36, 19])
    np.testing.assert_array_equal(plan.query_start_loc, [0, 1, 2, 3])
    np.testing.assert_array_equal(plan.seq_lens, [5, 1, 8])
    np.testing.assert_array_equal(plan.block_table, [[7, 3], [9, 0], [2, 4]])
    np.testing.assert_array_equal(plan.logits_indices, [0, 1, 2])
