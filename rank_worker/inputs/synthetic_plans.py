"""Plans no scheduler made: the warm-ups' and the tests' synthetic RUN plans."""

from __future__ import annotations

import numpy as np

from shm_ipc.step_plan import Command, StepPlan


def synthetic_plan(
    seqs: list[tuple[int, int, list[int]]], logits_indices: np.ndarray | None = None
) -> StepPlan:
    """A RUN plan that no scheduler made (warm-ups): sequences given as (first position, new
    tokens, block ids), in rows 0.. of tables of their own (every row written from column 0),
    token ids 0. `logits_indices` defaults to each sequence's last token."""
    q_lens = np.array([n for _, n, _ in seqs], dtype=np.int32)
    starts = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(q_lens, out=starts[1:])
    blocks = [b for _, _, b in seqs]
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum([len(b) for b in blocks], out=offsets[1:])
    if logits_indices is None:
        logits_indices = (starts[1:] - 1).astype(np.int32)
    return StepPlan(
        step_id=0,
        command=Command.RUN,
        input_ids=np.zeros(int(starts[-1]), dtype=np.int32),
        query_start_loc=starts,
        seq_lens=np.array([p + n for p, n, _ in seqs], dtype=np.int32),
        rows=np.arange(len(seqs), dtype=np.int32),
        logits_indices=logits_indices,
        edit_rows=np.arange(len(seqs), dtype=np.int32),
        edit_starts=np.zeros(len(seqs), dtype=np.int32),
        edit_offsets=offsets,
        edit_blocks=np.array([x for b in blocks for x in b], dtype=np.int32),
    )
