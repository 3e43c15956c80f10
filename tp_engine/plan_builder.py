"""Flatten one scheduled step into a StepPlan.

The scheduler's `ScheduledStep` (arrays over the running batch's rows, plus the known tokens of
the entries it planned one by one) goes in; an immutable `StepPlan` comes out, built once per
step and sent to every rank. The decodes' part is numpy over the rows; Python only joins the
token lists of prefill chunks and the step's block-table changes.

A decode whose token is still being sampled by the step in flight (asynchronous scheduling) gets
the input id `-1 - row`: every rank replaces it on the device with that step's sampled token of
row `row` (`rank_worker.input_prep`).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from shm_ipc.step_plan import Command, StepPlan
from tp_engine.running_batch import TableChanges
from tp_engine.scheduler import ScheduledStep


def build_step_plan(step: ScheduledStep, step_id: int) -> StepPlan:
    num_new = step.num_scheduled  # [B]
    b, s = step.num_entries, step.num_single
    query_start_loc = np.empty(b + 1, dtype=np.int32)  # [B+1]
    query_start_loc[0] = 0
    # add.accumulate keeps int32 (cumsum would widen to int64 and narrow again into `out`).
    np.add.accumulate(num_new, out=query_start_loc[1:])
    # Decodes first: their known tokens, with placeholder ids where they read the step in flight.
    input_ids = step.single_inputs.astype(np.int32, copy=False)
    if np.count_nonzero(step.reads_placeholder[:s]):
        input_ids = np.where(step.reads_placeholder[:s], -1 - step.placeholder_rows[:s], input_ids)
    if s < b:  # then the one-by-one entries' token lists
        chunks = [
            (-1 - int(step.placeholder_rows[i]),)
            if step.reads_placeholder[i]
            else step.chunk_inputs[i - s]
            for i in range(s, b)
        ]
        num_chunk_tokens = int(query_start_loc[-1] - query_start_loc[s])
        chunk_ids = np.fromiter(chain.from_iterable(chunks), dtype=np.int32, count=num_chunk_tokens)
        input_ids = np.concatenate([input_ids, chunk_ids])
    last_tokens = query_start_loc[1:] - 1  # [B] each entry's last token
    return StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=input_ids,
        query_start_loc=query_start_loc,
        seq_lens=np.add(step.starts, num_new, dtype=np.int32),
        rows=step.rows.astype(np.int32),
        logits_indices=last_tokens if step.num_samples == b else last_tokens[step.samples],
        **table_change_arrays(step.table_changes),
    )


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


# The changes of a step that changed no table (most decode steps): shared, hence read-only.
_NO_CHANGES = {
    "edit_rows": _read_only(np.zeros(0, dtype=np.int32)),
    "edit_starts": _read_only(np.zeros(0, dtype=np.int32)),
    "edit_offsets": _read_only(np.zeros(1, dtype=np.int32)),
    "edit_blocks": _read_only(np.zeros(0, dtype=np.int32)),
}


def table_change_arrays(changes: TableChanges) -> dict[str, np.ndarray]:
    """The StepPlan fields for a list of block-table changes."""
    if not changes.rows:
        return _NO_CHANGES
    offsets = np.empty(len(changes.lengths) + 1, dtype=np.int32)
    offsets[0] = 0
    np.add.accumulate(np.asarray(changes.lengths, dtype=np.int32), out=offsets[1:])
    return {
        "edit_rows": np.asarray(changes.rows, dtype=np.int32),
        "edit_starts": np.asarray(changes.starts, dtype=np.int32),
        "edit_offsets": offsets,
        "edit_blocks": np.asarray(changes.blocks, dtype=np.int32),
    }
