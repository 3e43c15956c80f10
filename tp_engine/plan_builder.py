"""Flatten one scheduled batch into a StepPlan.

Rank-0 request state (`Sequence`, mutable Python) goes in; an immutable `StepPlan` of flat int32
arrays comes out, built once per step and sent to every rank. Python touches each sequence once
(to slice its new tokens and copy its block list); every per-token array is computed by numpy.
Must be called after `Scheduler.schedule()` and before `Scheduler.update()`, while
`num_computed_tokens` still says where each sequence's new tokens start.
"""

from __future__ import annotations

import numpy as np

from shm_ipc.step_plan import Command, StepPlan
from tp_engine.scheduler import SchedulerOutput


def build_step_plan(out: SchedulerOutput, block_size: int, step_id: int) -> StepPlan:
    seqs = out.scheduled
    num_seqs = len(seqs)
    num_new = np.asarray(out.num_scheduled_tokens, dtype=np.int32)  # [B]
    start = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int32, count=num_seqs)

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

    input_ids = np.empty(num_tokens, dtype=np.int32)  # [T]
    for i, seq in enumerate(seqs):
        lo, hi = query_start_loc[i], query_start_loc[i + 1]
        if hi - lo == 1:
            input_ids[lo] = seq.token_ids[start[i]]
        else:
            input_ids[lo:hi] = seq.token_ids[start[i] : start[i] + (hi - lo)]

    width = max((len(s.block_table) for s in seqs), default=0)
    block_table = np.zeros((num_seqs, width), dtype=np.int32)  # [B, W]
    for i, seq in enumerate(seqs):
        block_table[i, : len(seq.block_table)] = seq.block_table

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
