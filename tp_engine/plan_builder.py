"""Flatten one scheduled batch into a StepPlan.

Rank-0 request state (`Sequence`, mutable Python) goes in; an immutable `StepPlan` of flat int32
arrays comes out, built once per step and sent to every rank. Python touches each sequence once
(to take its new tokens and its block list; both are copied by numpy through one iterator, never
element by element); every per-token array is computed by numpy. Must be called after
`Scheduler.schedule()`, whose output says where each sequence's new tokens start.

A decode whose token is still being sampled by the step in flight (asynchronous scheduling) gets
the input id `-1 - row`: every rank replaces it on the device with that step's sampled token of
row `row` (`rank_worker.input_prep`).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from shm_ipc.step_plan import Command, StepPlan
from tp_engine.scheduler import SchedulerOutput


def build_step_plan(out: SchedulerOutput, block_size: int, step_id: int) -> StepPlan:
    seqs = out.scheduled
    num_seqs = len(seqs)
    num_new = np.asarray(out.num_scheduled_tokens, dtype=np.int32)  # [B]
    start = np.asarray(out.starts, dtype=np.int32)  # [B]

    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)  # [B+1]
    np.cumsum(num_new, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])

    # Which sequence each token belongs to, then its position: offset within its own chunk
    # plus where the chunk starts in the sequence.
    seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int32), num_new)  # [T]
    positions = (
        np.arange(num_tokens, dtype=np.int32)
        - query_start_loc[:-1][seq_of_token]
        + start[seq_of_token]
    )  # [T]

    new_tokens = [
        seq.token_ids[s : s + n] if row < 0 else (-1 - row,)
        for seq, s, n, row in zip(
            seqs, out.starts, out.num_scheduled_tokens, out.input_rows, strict=True
        )
    ]
    input_ids = np.fromiter(chain.from_iterable(new_tokens), dtype=np.int32, count=num_tokens)

    tables = [seq.block_table for seq in seqs]
    table_lens = np.fromiter(map(len, tables), dtype=np.int32, count=num_seqs)  # [B]
    width = int(table_lens.max()) if num_seqs else 0
    block_table = np.zeros((num_seqs, width), dtype=np.int32)  # [B, W]
    # Row-major boolean assignment: each row's leading entries, in sequence order.
    block_table[np.arange(width) < table_lens[:, None]] = np.fromiter(
        chain.from_iterable(tables), dtype=np.int32, count=int(table_lens.sum())
    )
    slot_mapping = (
        block_table[seq_of_token, positions // block_size] * block_size + positions % block_size
    ).astype(np.int32)  # [T]
    seq_lens = start + num_new  # [B]
    logits_indices = (query_start_loc[1:] - 1)[np.asarray(out.samples, dtype=bool)]  # [B']

    return StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=input_ids,
        positions=positions.astype(np.int32, copy=False),
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens.astype(np.int32, copy=False),
        block_table=block_table,
        logits_indices=logits_indices.astype(np.int32, copy=False),
    )
