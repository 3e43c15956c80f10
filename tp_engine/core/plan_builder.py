"""Flatten one scheduled step into a StepPlan.

The scheduler's `ScheduledStep` (arrays over the running batch's rows, plus the known tokens of
the entries it planned one by one) goes in; an immutable `StepPlan` comes out, built once per
step and sent to every rank. The decodes' part is numpy over the rows; Python only joins the
token lists of prefill chunks and the step's block-table changes.

Every logits row of a step has a role, named by `LogitsLayout`: the sampled rows first (one per
sampling entry, or one per verified position of a speculative verify entry), then the rows of
prompt logprobs, then the pooled rows (a pooling request's last prompt token, in the step that
computes it). The sampler, logprob recording, pooling and the memory warm-up read that layout.
A pooling model's head makes the rows (`rank_worker.models.heads`): "logits" are then its outputs.

A decode whose token is still being sampled by the step in flight (asynchronous scheduling) gets
the input id `-1 - row`: every rank replaces it on the device with that step's sampled token of
row `row` (`rank_worker.inputs.input_prep`).

A step with LoRA requests carries each sequence's adapter slot (`adapter_slots`, -1 for the
base model), read from the running batch's column that the adapter registry keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain
from typing import TypedDict

import numpy as np

from shm_ipc.step_plan import Command, StepPlan
from tp_engine.core.running_batch import RunningBatch, TableChanges
from tp_engine.core.scheduled_step import ScheduledStep
from tp_engine.core.sequence import Sequence


@dataclass(frozen=True)
class PromptLogprobRows:
    """Extra logits rows of one sequence in one step, for its prompt logprobs."""

    seq: Sequence
    # Rows in the plan's flattened tokens: positions `start .. start + count - 1` of the
    # sequence, whose logits score prompt tokens `start + 1 .. start + count`.
    rows: np.ndarray
    targets: list[int]


def prompt_logprob_rows(
    step: ScheduledStep, batch: RunningBatch, plan: StepPlan
) -> list[PromptLogprobRows]:
    """The logits rows each scheduled sequence needs for prompt logprobs it lacks.

    A chunk computing positions `start .. start + n - 1` yields logits for prompt tokens
    `start + 1 .. start + n`; only tokens not yet recorded are taken (a recompute after
    preemption does not record them twice). Only the rows of sequences that asked for prompt
    logprobs are visited.
    """
    found = []
    for i in np.flatnonzero(batch.wants_prompt_logprobs[step.rows]).tolist():
        seq = batch.seqs[int(step.rows[i])]
        if seq is None or not seq.needs_prompt_logits:
            continue
        start = int(step.starts[i])
        lo = max(start, len(seq.prompt_logprobs) - 1)  # first position whose logits are missing
        hi = min(start + int(step.num_scheduled[i]), seq.num_prompt_tokens - 1)
        if lo >= hi:
            continue
        rows = np.arange(lo, hi, dtype=np.int64) - start + int(plan.query_start_loc[i])
        found.append(PromptLogprobRows(seq, rows, seq.token_ids[lo + 1 : hi + 1]))
    return found


@dataclass(frozen=True)
class PooledRow:
    """The row of a pooling sequence's last prompt token in one step's flattened tokens."""

    seq: Sequence
    row: int


def pooled_rows(step: ScheduledStep, batch: RunningBatch, plan: StepPlan) -> list[PooledRow]:
    """The pooling sequences whose prompt this step completes, each with the row of its last
    token. Pooling requests are prompt-only (they never sample), so only those rows are looked
    at; an earlier chunk of a prompt pools nothing."""
    if not batch.num_prompt_only:
        return []
    found = []
    for i in np.flatnonzero(batch.prompt_only[step.rows]).tolist():
        seq = batch.seqs[int(step.rows[i])]
        if seq is None or seq.pooling_params is None:
            continue
        if int(step.starts[i]) + int(step.num_scheduled[i]) >= seq.num_prompt_tokens:
            found.append(PooledRow(seq, int(plan.query_start_loc[i + 1]) - 1))
    return found


@dataclass(frozen=True, eq=False)
class LogitsLayout:
    """What each row of a step's gathered logits `[R, V]` is, in order:

    - `num_sampled_rows` sampled rows: the step's sampled entries in batch order, entry i
      owning `1 + num_drafts[i]` consecutive rows (its verified positions; 1 without drafts);
    - then the prompt-logprob rows of `prompt_rows`, in that order;
    - then one row per entry of `pooled_rows`, in that order.
    """

    num_sampled_rows: int
    # [S] drafts of each sampled entry; None: no drafts (one row per sampled entry).
    num_drafts: np.ndarray | None
    prompt_rows: list[PromptLogprobRows]
    pooled_rows: list[PooledRow] = dataclasses.field(default_factory=list)

    @property
    def num_prompt_rows(self) -> int:
        return sum(p.rows.size for p in self.prompt_rows)

    @property
    def num_rows(self) -> int:
        return self.num_sampled_rows + self.num_prompt_rows + len(self.pooled_rows)

    @property
    def sampled(self) -> slice:
        return slice(0, self.num_sampled_rows)

    @property
    def prompt(self) -> slice:
        return slice(self.num_sampled_rows, self.num_sampled_rows + self.num_prompt_rows)

    @property
    def pooled(self) -> slice:
        return slice(self.num_sampled_rows + self.num_prompt_rows, self.num_rows)


def plan_step(
    step: ScheduledStep,
    step_id: int,
    batch: RunningBatch,
    sections: Iterable[Callable[[np.ndarray], dict[str, np.ndarray] | None]] = (),
) -> tuple[StepPlan, LogitsLayout]:
    """The plan of `step` and the layout of its logits rows (prompt-logprob and pooled rows
    included); `sections`: the features' sections from their own per-row state
    (`CoreHooks.plan_sections`: LoRA's adapter slots), given the step's rows."""
    plan = build_step_plan(step, step_id)
    for section in sections:
        values = section(step.rows)
        if values:
            plan = plan.with_sections(**values)
    prompt_rows = prompt_logprob_rows(step, batch, plan)
    pooled = pooled_rows(step, batch, plan)
    if prompt_rows or pooled:
        extra = [p.rows for p in prompt_rows] + [np.array([p.row for p in pooled], np.int64)]
        plan = dataclasses.replace(
            plan,
            logits_indices=np.concatenate([plan.logits_indices, *extra]).astype(np.int32),
        )
    layout = LogitsLayout(step.num_sampled_rows, step.sampled_drafts, prompt_rows, pooled)
    return plan, layout


def build_step_plan(step: ScheduledStep, step_id: int) -> StepPlan:
    """The plan of `step`: its logits rows are the sampled rows of `LogitsLayout` (append the
    prompt-logprob rows with `with_prompt_rows`)."""
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
    logits_indices = last_tokens if step.num_samples == b else last_tokens[step.samples]
    if step.num_drafts is not None:
        # A verify entry is sampled at each of its positions: its last 1 + drafts tokens.
        drafts = step.sampled_drafts
        assert drafts is not None
        counts = drafts + 1
        firsts = np.repeat(logits_indices - drafts, counts)
        within = np.arange(firsts.size) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_indices = (firsts + within).astype(np.int32)
    return StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=input_ids,
        query_start_loc=query_start_loc,
        seq_lens=np.add(step.starts, num_new, dtype=np.int32),
        rows=step.rows.astype(np.int32),
        logits_indices=logits_indices,
        **table_change_arrays(step.table_changes),
    )


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False
    return arr


# The changes of a step that changed no table (most decode steps): shared, hence read-only.
class TableChangeArrays(TypedDict):
    """A StepPlan's block-table edit fields (`shm_ipc.step_plan`), int32."""

    edit_rows: np.ndarray
    edit_starts: np.ndarray
    edit_offsets: np.ndarray
    edit_blocks: np.ndarray


_NO_CHANGES: TableChangeArrays = {
    "edit_rows": _read_only(np.zeros(0, dtype=np.int32)),
    "edit_starts": _read_only(np.zeros(0, dtype=np.int32)),
    "edit_offsets": _read_only(np.zeros(1, dtype=np.int32)),
    "edit_blocks": _read_only(np.zeros(0, dtype=np.int32)),
}


def table_change_arrays(changes: TableChanges) -> TableChangeArrays:
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
