"""StepPlan building against a slow, obviously-correct reference on random batches, and the
table edits it carries against a replaying worker."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.input_prep import positions_of
from shm_ipc.step_plan import Command, StepPlan
from tp_engine.core.plan_builder import build_step_plan
from tp_engine.core.running_batch import TableChanges
from tp_engine.core.scheduled_step import ScheduledStep

NUM_ROWS = 16
MAX_BLOCKS = 24


@st.composite
def batches(draw) -> tuple[ScheduledStep, dict[str, list], int]:
    """A random step over random sequences: single-token entries first (some reading a
    placeholder), then chunks; each entry's block list is sent as an edit of its row. Returns
    the step, the per-token reference and the block size."""
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    rows = draw(st.permutations(range(NUM_ROWS)))[: draw(st.integers(0, 8))]
    free_ids = list(range(1000))
    draw(st.randoms()).shuffle(free_ids)  # block ids in any order, as after churn
    single, chunked = [], []
    changes = TableChanges()
    for row in rows:
        is_single = draw(st.booleans())
        num_tokens = draw(st.integers(1, min(70, MAX_BLOCKS * block_size - 1)))
        tokens = draw(st.lists(st.integers(0, 50_000), min_size=num_tokens, max_size=num_tokens))
        start = num_tokens - 1 if is_single else draw(st.integers(0, num_tokens - 1))
        num_new = 1 if is_single else draw(st.integers(1, num_tokens - start))
        placeholder = is_single and draw(st.booleans())
        if placeholder:
            start = num_tokens  # the token at `start` is the in-flight sample
        num_blocks = min(MAX_BLOCKS, -(-(start + num_new) // block_size) + draw(st.integers(0, 2)))
        blocks = [free_ids.pop() for _ in range(num_blocks)]
        changes.add(row, 0, blocks)
        entry = dict(
            row=row, tokens=tokens, start=start, num_new=num_new, blocks=blocks,
            placeholder=placeholder, sample_row=draw(st.integers(0, 20)),
            samples=draw(st.booleans()),
        )  # fmt: skip
        (single if is_single else chunked).append(entry)
    entries = single + chunked

    def col(name: str, dtype: type) -> np.ndarray:
        return np.array([e[name] for e in entries], dtype=dtype)

    step = ScheduledStep(
        rows=col("row", np.int32),
        serials=np.arange(1, len(entries) + 1, dtype=np.int64),
        num_scheduled=col("num_new", np.int32),
        starts=col("start", np.int32),
        samples=col("samples", bool),
        reads_placeholder=col("placeholder", bool),
        placeholder_rows=np.array(
            [e["sample_row"] if e["placeholder"] else 0 for e in entries], dtype=np.int32
        ),
        single_inputs=np.array(
            [0 if e["placeholder"] else e["tokens"][e["start"]] for e in single], dtype=np.int32
        ),
        chunk_inputs=[e["tokens"][e["start"] : e["start"] + e["num_new"]] for e in chunked],
        preempted=[],
        num_decodes=0,
        table_changes=changes,
    )
    ref: dict[str, list] = {k: [] for k in ("ids", "pos", "slots", "lens", "logits")}
    offset = 0
    for e in entries:
        for p in range(e["start"], e["start"] + e["num_new"]):
            ref["ids"].append(-1 - e["sample_row"] if e["placeholder"] else e["tokens"][p])
            ref["pos"].append(p)
            ref["slots"].append(e["blocks"][p // block_size] * block_size + p % block_size)
        offset += e["num_new"]
        ref["lens"].append(e["start"] + e["num_new"])
        if e["samples"]:
            ref["logits"].append(offset - 1)
    return step, ref, block_size


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(min_value=0, max_value=2**40))
def test_plan_matches_the_per_token_reference(batch, step_id):
    step, ref, block_size = batch
    plan = build_step_plan(step, step_id)
    assert plan.step_id == step_id and plan.command == Command.RUN
    assert plan.num_seqs == step.num_entries and plan.num_tokens == step.num_batched_tokens
    # What the ranks receive is the same plan; each derives positions and slots from it.
    for received in (plan, StepPlan.decode(plan.encode())):
        received.validate()
        tables = BlockTables(NUM_ROWS, MAX_BLOCKS, block_size, "cpu")
        tables.apply(received)
        positions = positions_of(received)
        token_rows = np.repeat(received.rows, np.diff(received.query_start_loc))
        np.testing.assert_array_equal(received.input_ids, ref["ids"])
        np.testing.assert_array_equal(positions, ref["pos"])
        np.testing.assert_array_equal(tables.slots(token_rows, positions), ref["slots"])
        np.testing.assert_array_equal(received.seq_lens, ref["lens"])
        np.testing.assert_array_equal(received.logits_indices, ref["logits"])
        np.testing.assert_array_equal(received.rows, step.rows)


def test_edits_replay_in_order():
    # Row 3 gets a sequence, grows, is given up and goes to another sequence, all between two
    # plans; row 5 only grows. The mirror ends as rank 0 did.
    changes = TableChanges()
    changes.add(3, 0, [7, 8])
    changes.add(5, 2, [40])
    changes.add(3, 2, [9])
    changes.add(3, 0, [])
    changes.add(3, 0, [1])
    tables = BlockTables(8, 4, 4, "cpu")
    tables.host[5, :2] = [30, 31]
    tables.lengths[5] = 2
    step = ScheduledStep(
        rows=np.zeros(0, np.int32), serials=np.zeros(0, np.int64),
        num_scheduled=np.zeros(0, np.int32), starts=np.zeros(0, np.int32),
        samples=np.zeros(0, bool), reads_placeholder=np.zeros(0, bool),
        placeholder_rows=np.zeros(0, np.int32), single_inputs=np.zeros(0, np.int32),
        chunk_inputs=[], preempted=[], num_decodes=0, table_changes=changes,
    )  # fmt: skip
    cells = tables.apply(build_step_plan(step, 0))
    assert tables.lengths[3] == 1 and tables.host[3, 0] == 1
    assert tables.lengths[5] == 3 and tables.host[5, :3].tolist() == [30, 31, 40]
    # Each cell once, its last value: what the device table receives.
    assert sorted(map(tuple, cells.T.tolist())) == [(3, 0, 1), (3, 1, 8), (3, 2, 9), (5, 2, 40)]


def test_a_decode_plan_does_not_grow_with_context_length():
    """A decode step of 256 sequences, their tables sent earlier: the plan's size depends on the
    batch alone (a new block id every block_size steps), not on how long the contexts are."""
    sizes = []
    for context in (1024, 8192, 32768):
        step = ScheduledStep(
            rows=np.arange(256, dtype=np.int32), serials=np.arange(1, 257, dtype=np.int64),
            num_scheduled=np.ones(256, np.int32), starts=np.full(256, context, np.int32),
            samples=np.ones(256, bool), reads_placeholder=np.zeros(256, bool),
            placeholder_rows=np.zeros(256, np.int32), single_inputs=np.arange(256, dtype=np.int32),
            chunk_inputs=[], preempted=[], num_decodes=256, table_changes=TableChanges(),
        )  # fmt: skip
        sizes.append(build_step_plan(step, 7).encoded_size())
    assert sizes[0] == sizes[1] == sizes[2] <= 64 * 1024
