"""Rank 0's running sequences as arrays: one stable row per running sequence.

The scheduler's hot path, a decode step of every running sequence, touches every running
sequence every step. Done as Python over `Sequence` objects that costs microseconds per
sequence; done here it is a few numpy operations over the rows plus Python for the rare events
only (admission, a new block every `block_size` tokens, preemption, finishing). This is the
persistent batch of vLLM v1 and SGLang's request-to-token pool, for this engine.

    row r (0 <= r < max_num_seqs), while sequence s runs in it:
      serial[r]                 s.serial (0: the row is free); tells a reused row apart
      block_table[r, :num_blocks[r]]   s.block_table (the BlockManager's list, mirrored)
      num_tokens[r]             len(s.token_ids): prompt + output tokens known
      num_computed[r]           tokens whose K/V is in the cache
      num_inflight[r]           tokens scheduled in steps not applied yet
      num_placeholders[r]       samples of those steps (tokens not known yet)
      sample_row[r]             s's row among the samples of the last step that sampled it
      last_token[r]             s.token_ids[-1], the input of its next decode
      prompt_len[r], length_end[r], stops_on_eos[r], prompt_only[r],
      has_stop_ids[r], wants_prompt_logprobs[r]: what the stop checks and the scheduler read
      temperature[r], top_k[r], top_p[r], min_p[r], needs_python[r]: what sampling reads

The batch alone owns a running sequence's counters (num_computed, num_inflight,
num_placeholders): `add` moves them in from the `Sequence`, `remove` moves them back, and in
between the Sequence refuses to answer for them (`Sequence.row` is set). Code that plans or
applies a step reads them here, by row (`scheduled_end`, `num_uncomputed`). `live` is the one
test of whether a row still holds the sequence a step was scheduled for (rows are reused).

Per-row state kept elsewhere (the sampling builder's logits processors, a feature's own rows:
LoRA's adapter slots, a proposer's token arrays) follows the rows through `row_listeners`, told
of every row taken and given back; nothing but the core writes these arrays.

Rows are handed out lowest first and given back when their sequence stops running; `order`
lists the occupied rows in admission order (the scheduler preempts from its end). Every change
to the block table is also logged (`TableChanges`) for the next StepPlan, so that the workers,
which mirror these tables, receive changes and never whole tables (`shm_ipc.step_plan`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tp_engine.sampling_params import GREEDY_EPSILON

if TYPE_CHECKING:
    from tp_engine.core.sequence import Sequence

# top_k of a row without top-k: larger than any vocabulary.
TOP_K_OFF = np.iinfo(np.int64).max


class RowListener(Protocol):
    """Told when a sequence takes a row (`add_row`) and when it gives it back (`remove_row`)."""

    def add_row(self, row: int, seq: Sequence) -> None: ...

    def remove_row(self, row: int) -> None: ...


class RowFollower:
    """A row listener of one running batch at a time (the engine builds a new batch when it is
    reconfigured): `follow` leaves the previous batch, resets the per-row state
    (`reset_rows`) and replays the new batch's running rows through `add_row`."""

    _batch: RunningBatch | None = None

    def follow(self, batch: RunningBatch) -> None:
        if batch is self._batch:
            return
        if self._batch is not None:
            self._batch.row_listeners.remove(self)
        self._batch = batch
        batch.row_listeners.append(self)
        self.reset_rows(batch.max_rows)
        for row in batch.order.tolist():
            self.add_row(row, batch.seqs[row])  # type: ignore[arg-type]

    def reset_rows(self, max_rows: int) -> None:
        """Forget every row's state (a batch of `max_rows` rows follows)."""

    def add_row(self, row: int, seq: Sequence) -> None:
        raise NotImplementedError

    def remove_row(self, row: int) -> None:
        raise NotImplementedError


@dataclass
class TableChanges:
    """Block-table edits since the last plan, in the order they happened (flat lists, ready
    for the plan's arrays).

    Edit e `(rows[e], starts[e], the next lengths[e] ids of blocks)` sets
    `block_table[row, start:start + length]` and the row's length to `start + length`: start 0
    rewrites the row (a new sequence in it), and an empty edit at start 0 gives the row up.
    """

    rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)

    def add(self, row: int, start: int, blocks: list[int]) -> None:
        self.rows.append(row)
        self.starts.append(start)
        self.lengths.append(len(blocks))
        self.blocks += blocks

    def add_single_blocks(self, rows: list[int], starts: list[int], blocks: list[int]) -> None:
        """One block appended to each of `rows` (at `starts`)."""
        self.rows += rows
        self.starts += starts
        self.lengths += [1] * len(rows)
        self.blocks += blocks


class RunningBatch:
    """The persistent arrays of rank 0's running sequences (see the module docstring)."""

    def __init__(self, max_rows: int, max_blocks_per_row: int, max_model_len: int) -> None:
        r, w = max_rows, max_blocks_per_row
        self.max_rows = max_rows
        self.max_model_len = max_model_len
        self.seqs: list[Sequence | None] = [None] * r
        self.serial = np.zeros(r, dtype=np.int64)
        self.block_table = np.zeros((r, w), dtype=np.int32)
        self.num_blocks = np.zeros(r, dtype=np.int32)
        self.num_tokens = np.zeros(r, dtype=np.int32)
        self.num_computed = np.zeros(r, dtype=np.int32)
        self.num_inflight = np.zeros(r, dtype=np.int32)
        self.num_placeholders = np.zeros(r, dtype=np.int32)
        self.sample_row = np.zeros(r, dtype=np.int32)
        self.last_token = np.zeros(r, dtype=np.int32)
        self.prompt_len = np.zeros(r, dtype=np.int32)
        # num_tokens at which the sequence ends by length (max_tokens, or max_model_len).
        self.length_end = np.zeros(r, dtype=np.int32)
        self.stops_on_eos = np.zeros(r, dtype=bool)
        self.prompt_only = np.zeros(r, dtype=bool)
        self.has_stop_ids = np.zeros(r, dtype=bool)
        self.wants_prompt_logprobs = np.zeros(r, dtype=bool)
        self.temperature = np.zeros(r, dtype=np.float32)
        self.top_k = np.zeros(r, dtype=np.int64)  # TOP_K_OFF where off
        self.top_p = np.ones(r, dtype=np.float32)
        self.min_p = np.zeros(r, dtype=np.float32)
        # Rows whose sampling needs their Sequence (logprobs): the sampling builder
        # visits these in Python. (Changes of the logits are its processors', which keep their
        # own rows: `row_listeners`.)
        self.needs_python = np.zeros(r, dtype=bool)
        self.row_listeners: list[RowListener] = []
        # Occupied rows in admission order. Row indices are intp throughout the batch: numpy
        # gathers and scatters with intp indices directly, with int32 ones it first converts
        # them (three times slower at a few hundred rows; the decode path does dozens a step).
        self.order = np.zeros(0, dtype=np.intp)
        # Running rows with each rare flag set: the decode path skips what no row needs
        # without looking at the flags.
        self.num_prompt_only = 0
        self.num_with_stop_ids = 0
        self.num_wanting_prompt_logprobs = 0
        # Rows given back so far. While it stays the same, every row holds the sequence it
        # held: a step scheduled at that count finds all its rows live when it is applied.
        self.num_removals = 0
        self._free = list(range(r))  # a heap: lowest row first
        self.changes = TableChanges()

    # -- rows ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.order.size)

    def add(self, seq: Sequence) -> int:
        """Give `seq` a row (it is being admitted): its counters move into the row."""
        if not self._free:
            raise RuntimeError(f"no free row in a batch of {self.max_rows}")
        if seq.row is not None:
            raise ValueError(f"{seq} runs in a batch row already")
        row = heapq.heappop(self._free)
        p = seq.sampling_params
        self.seqs[row] = seq
        self.serial[row] = seq.serial
        self.num_blocks[row] = 0
        self.num_tokens[row] = seq.num_tokens
        # Before `seq.row` is set: from then on the row owns them.
        self.num_computed[row] = seq.num_computed_tokens
        self.num_inflight[row] = seq.num_inflight_tokens
        self.num_placeholders[row] = seq.num_placeholders
        self.last_token[row] = seq.token_ids[-1]
        self.prompt_len[row] = seq.num_prompt_tokens
        max_len = self.max_model_len
        if p.max_tokens is not None:
            max_len = min(max_len, seq.num_prompt_tokens + p.max_tokens)
        self.length_end[row] = max_len
        self.stops_on_eos[row] = not p.ignore_eos
        self.prompt_only[row] = seq.is_prompt_only
        self.has_stop_ids[row] = bool(p.stop_token_ids)
        self.wants_prompt_logprobs[row] = p.prompt_logprobs is not None
        self.temperature[row] = p.temperature
        self.top_k[row] = p.top_k if p.top_k > 0 else TOP_K_OFF
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.needs_python[row] = p.logprobs is not None
        self._count_flags(row, 1)
        self.order = np.append(self.order, row)
        seq.row = row
        for listener in self.row_listeners:
            listener.add_row(row, seq)
        return row

    def remove(self, seq: Sequence) -> None:
        """Take `seq`'s row back (it finished, was preempted or aborted); its counters return to
        the Sequence, and the row's table change is logged."""
        row = seq.row
        assert row is not None and self.seqs[row] is seq
        seq.row = None
        seq.num_computed_tokens = int(self.num_computed[row])
        seq.num_inflight_tokens = int(self.num_inflight[row])
        seq.num_placeholders = int(self.num_placeholders[row])
        for listener in self.row_listeners:
            listener.remove_row(row)
        self._count_flags(row, -1)
        self.num_removals += 1
        self.seqs[row] = None
        self.serial[row] = 0
        self.num_blocks[row] = 0
        self.order = self.order[self.order != row]
        heapq.heappush(self._free, row)
        self.changes.add(row, 0, [])

    def _count_flags(self, row: int, sign: int) -> None:
        self.num_prompt_only += sign * bool(self.prompt_only[row])
        self.num_with_stop_ids += sign * bool(self.has_stop_ids[row])
        self.num_wanting_prompt_logprobs += sign * bool(self.wants_prompt_logprobs[row])

    # -- block tables ----------------------------------------------------------------------------

    def sync_blocks(self, seq: Sequence) -> None:
        """Mirror the blocks the BlockManager appended to `seq.block_table` since the last sync
        into its row, logging the edit."""
        row = seq.row
        assert row is not None
        have = int(self.num_blocks[row])
        table = seq.block_table
        if len(table) < have:
            raise AssertionError(f"{seq}: its block table shrank while it ran")
        if len(table) == have:
            return
        new = table[have:]
        self.block_table[row, have : len(table)] = new
        self.num_blocks[row] = len(table)
        self.changes.add(row, have, list(new))

    def append_blocks(self, rows: np.ndarray, block_ids: list[int]) -> None:
        """One new block for each of `rows` (intp; the BlockManager handed them out): into the
        sequences' block lists and their rows, logged."""
        starts = self.num_blocks[rows]
        self.block_table[rows, starts] = block_ids
        self.num_blocks[rows] = starts + 1
        rows_list = rows.tolist()
        seqs = self.seqs
        for row, block_id in zip(rows_list, block_ids, strict=True):
            seqs[row].block_table.append(block_id)
        self.changes.add_single_blocks(rows_list, starts.tolist(), block_ids)

    def truncate_blocks(self, row: int, keep: int) -> None:
        """The row's sequence gave back its blocks past the first `keep`: its table is that
        long now (logged as an empty edit at `keep`)."""
        self.num_blocks[row] = keep
        self.changes.add(row, keep, [])

    def take_changes(self) -> TableChanges:
        """The changes since the last call (for the next plan)."""
        changes, self.changes = self.changes, TableChanges()
        return changes

    # -- derived per-row quantities ----------------------------------------------------------------

    def is_greedy(self, rows: np.ndarray) -> np.ndarray:
        return self.temperature[rows] <= GREEDY_EPSILON

    def live(self, rows: np.ndarray, serials: np.ndarray) -> np.ndarray:
        """Which of `rows` still hold the sequences whose serials were `serials` (when a step
        was scheduled); the others were aborted, preempted or finished since."""
        return self.serial[rows] == serials

    def scheduled_end(self, row: int) -> int:
        """Where the row's next scheduled token starts: computed plus in-flight tokens."""
        return int(self.num_computed[row]) + int(self.num_inflight[row])

    def num_uncomputed(self, row: int) -> int:
        """Tokens still to schedule before the row's next sample: the prompt's rest, or 1 in
        decode (counting in-flight steps: their tokens as scheduled, their samples as tokens)."""
        return int(self.num_tokens[row]) + int(self.num_placeholders[row]) - self.scheduled_end(row)

    def is_prefill(self, row: int) -> bool:
        """True while more than one token waits to be computed (prompt or recompute)."""
        return self.num_uncomputed(row) > 1
