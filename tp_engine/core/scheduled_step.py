"""What the scheduler hands the step pipeline, and what it is handed: the values of one step.

`ScheduledStep` is one step's batch as planned (arrays in batch order; `plan_builder` turns it
into a StepPlan); `UpdateResult` is what applying it did. `DraftProposer`, `DraftSlots`,
`Drafts` and `LateDrafts` are speculative decoding's exchange between the scheduler and the step
pipeline (`tp_engine.core.drafting`). Owner: rank 0's core; immutable once made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tp_engine.core.running_batch import RunningBatch, TableChanges
from tp_engine.core.sequence import Sequence

__all__ = [
    "DraftProposer",
    "DraftSlots",
    "Drafts",
    "EntryLists",
    "LateDrafts",
    "RequestRejectedError",
    "ScheduledStep",
    "UpdateResult",
]


class DraftProposer(Protocol):
    """Guesses the next tokens of decoding sequences (speculative decoding)."""

    num_speculative_tokens: int
    # False: `propose` runs before the verify entries' blocks are allocated and may give a row
    # fewer drafts than asked (n-gram lookup). True: it runs once they are allocated and gives
    # exactly the drafts asked (a draft model, which writes its own K/V at those positions).
    drafts_after_allocation: bool

    def follow(self, batch: RunningBatch) -> None:
        """Follow the rows of `batch` (a proposer's per-row state is its own)."""

    def eligible(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` may be drafted at all."""
        ...

    def propose(self, rows: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for batch `rows` (at most `max_drafts[i]` for row i): the draft tokens of
        every row, row after row, and how many each row has."""
        ...


class RequestRejectedError(ValueError):
    """A request that can never be served as asked; the message says why."""


@dataclass(frozen=True, eq=False)
class ScheduledStep:
    """One step's batch as the scheduler planned it. Arrays are parallel, in batch order: the
    `num_single` single-token entries of the vectorised path first (running decodes, admission
    order), then the entries planned one by one (prefill chunks, admissions)."""

    # [B] intp: each entry's RunningBatch row, and [B] int64 the serial of the sequence that
    # held it when scheduled (`update` ignores rows that changed hands since).
    rows: np.ndarray
    serials: np.ndarray
    # [B] int32: new tokens computed this step, and the position of the first of them.
    num_scheduled: np.ndarray
    starts: np.ndarray
    # [B] bool: this step computes the entry's last uncomputed token, so its logits are sampled.
    samples: np.ndarray
    # [B] bool: the entry's input is the sample of the step in flight (asynchronous
    # scheduling), at [B] int32 `placeholder_rows` among that step's sampled rows.
    reads_placeholder: np.ndarray
    placeholder_rows: np.ndarray
    # [num_single] int32: the known input token of each single-token entry (where it is not a
    # placeholder); then the known input tokens of every other entry, one list each.
    single_inputs: np.ndarray
    chunk_inputs: list[list[int]]
    # Sequences this step sent back to the waiting queue.
    preempted: list[Sequence]
    # Entries that decode (one token after their prompt), for throughput figures.
    num_decodes: int
    # What changed in the block tables since the last step (for the workers' mirrors).
    table_changes: TableChanges
    # `RunningBatch.num_removals` when the step was scheduled: while it is unchanged, no row
    # has changed hands and `update` need not compare serials (None: compare them).
    num_removals: int | None = None
    # Speculative decoding: [B] int32 the drafted tokens each entry verifies (0 for all but
    # verify entries, whose inputs are [last token, drafts...]), and the drafts, entry after
    # entry. A verify entry is sampled at every one of its positions. None: no drafts.
    num_drafts: np.ndarray | None = None
    draft_tokens: np.ndarray | None = None
    # Verify entries whose drafts a proposer makes once their blocks are allocated (a draft
    # model): the step pipeline asks it and fills them in (`Scheduler.fill_drafts`); until
    # then their drafts are zeros and the step's table changes wait in the batch. None: none.
    late_drafts: LateDrafts | None = None
    # This step computes a sequence whose blocks the step's own copies up write (it had
    # nothing else to run): its forward pass waits for them instead of overlapping them.
    reads_copies_up: bool = False

    @property
    def num_entries(self) -> int:
        return int(self.rows.size)

    @property
    def num_single(self) -> int:
        return int(self.single_inputs.size)

    @property
    def num_samples(self) -> int:
        """Entries that sample (each emits at least one token when applied)."""
        return int(np.count_nonzero(self.samples))

    @property
    def sampled_drafts(self) -> np.ndarray | None:
        """[S] the drafts of each sampled entry (None: no drafts in this step)."""
        if self.num_drafts is None:
            return None
        return self.num_drafts[self.samples]

    @property
    def num_sampled_rows(self) -> int:
        """Logits rows sampled: one per sampled entry, plus one per draft it verifies."""
        extra = 0 if self.num_drafts is None else int(self.num_drafts.sum())
        return self.num_samples + extra

    @property
    def num_batched_tokens(self) -> int:
        return int(self.num_scheduled.sum())

    @property
    def is_empty(self) -> bool:
        return self.rows.size == 0


@dataclass(frozen=True)
class DraftSlots:
    """The decodes that may verify drafts this step and the most each may have (what keeps a
    verify entry within the length limit), admission order: what a proposer is offered."""

    rows: np.ndarray  # [R] intp
    max_drafts: np.ndarray  # [R] int32, each > 0


@dataclass(frozen=True)
class Drafts:
    """What the step pipeline hands `Scheduler.schedule`: rows (a subsequence of a
    `DraftSlots`'s), the drafts each gets, and their tokens row after row; tokens None: a
    proposer that drafts after allocation makes them later (`LateDrafts`)."""

    rows: np.ndarray  # [R] intp
    counts: np.ndarray  # [R] int32
    tokens: np.ndarray | None  # [sum(counts)] int32


@dataclass(frozen=True)
class LateDrafts:
    """Verify entries planned with room for drafts not made yet: their rows and how many
    each takes (what the proposer is asked), each one's index among the step's
    `chunk_inputs` and the offset of its drafts in `draft_tokens`."""

    rows: np.ndarray  # [L] intp
    counts: np.ndarray  # [L] int32
    entries: list[int]
    offsets: list[int]


@dataclass(frozen=True)
class UpdateResult:
    """What applying a step did."""

    # Sequences that received a token, in sampled-row order (finished ones included).
    sampled: list[Sequence]
    # Sequences that finished in this update (sampled ones and prompt-only ones).
    finished: list[Sequence]
    # [S] int32: tokens appended for each of the step's sampled entries, in sampled order: 0
    # where its sequence stopped running before the step was applied, fewer than it emitted
    # where a token of a speculative run stopped it (what the counters of output count).
    num_appended: np.ndarray


@dataclass
class EntryLists:
    """The one-by-one entries of a step being planned (converted to arrays at the end)."""

    rows: list[int] = field(default_factory=list)
    serials: list[int] = field(default_factory=list)
    num_scheduled: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    reads_placeholder: list[bool] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)
    inputs: list[list[int]] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    draft_tokens: list[np.ndarray] = field(default_factory=list)
    num_decodes: int = 0
    # Verify entries whose drafts come later: (row, drafts, entry index, offset in drafts).
    late: list[tuple[int, int, int, int]] = field(default_factory=list)

    def add(
        self, b: RunningBatch, seq: Sequence, num_tokens: int, drafts: np.ndarray | None = None
    ) -> None:
        """Plan `num_tokens` of running `seq` in this step (the one-by-one path); a verify entry
        (`drafts`) computes its last token and then its drafts. Advances the row's in-flight
        counter in `b`, the running batch."""
        row = seq.row
        assert row is not None
        start = b.scheduled_end(row)
        num_drafts = 0 if drafts is None else int(drafts.size)
        num_known = num_tokens - num_drafts
        samples = num_known == b.num_uncomputed(row) and not seq.is_prompt_only
        placeholder = start >= seq.num_tokens  # the sample of the step in flight
        self.rows.append(row)
        self.serials.append(seq.serial)
        self.num_scheduled.append(num_tokens)
        self.starts.append(start)
        self.samples.append(samples)
        self.reads_placeholder.append(placeholder)
        self.placeholder_rows.append(int(b.sample_row[row]) if placeholder else 0)
        inputs = [] if placeholder else seq.token_ids[start : start + num_known]
        self.num_drafts.append(num_drafts)
        if num_drafts:
            assert samples and num_known == 1 and not placeholder, seq
            inputs += drafts.tolist()  # type: ignore[union-attr]
            self.draft_tokens.append(drafts)  # type: ignore[arg-type]
        self.inputs.append(inputs)
        if placeholder:
            assert num_tokens == 1, seq
        if num_known == 1 and start >= seq.num_prompt_tokens:
            self.num_decodes += num_tokens
        b.num_inflight[row] += num_tokens
