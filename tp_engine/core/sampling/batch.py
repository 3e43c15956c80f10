"""Rank 0: one step's `SamplingMetadata` from the running batch's rows that sample in it.

The common parameters (temperature, top-k, top-p, min-p) are arrays of the `RunningBatch`, so
they are gathered for the step's rows with numpy and the rows grouped by the path each takes
(`tp_engine.core.sampling.groups`). Every other change of the logits is a logits processor
(`tp_engine.core.sampling.processors`) with its own per-row state: the builder follows the batch's
rows (it is the batch's row listener) and forwards their comings and goings to the processors,
and each step asks each processor which rows it changes and for its edit of them. Rows that
want logprobs (`RunningBatch.needs_python`) are visited in Python. Nothing loops over tokens or
the vocabulary. A feature no row uses costs nothing: its part of the metadata stays None.

Random draws are counter-based (`kernels.gumbel_sample`): each row has a seed, its request's
`seed` or else one drawn once per sequence from this builder's generator (seeded with
`EngineConfig.seed`, so a run of the same requests in the same order repeats itself), kept on
the Sequence (`noise_seed`), and a counter, the output position of the token being sampled,
read off the batch's counters. Nothing is advanced by a draw, so nothing is undone when a
draw is discarded: the row draws the same again when it samples that position again.

Rows whose sequence stopped running since the step was scheduled (`live` False; their samples
are discarded) are sampled greedily and never visited.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from tp_engine.core.running_batch import RowFollower, RunningBatch
from tp_engine.core.sampling import SamplingMetadata
from tp_engine.core.sampling.groups import plan_groups, seed_bits
from tp_engine.core.sampling.processors import (
    DraftsAhead,
    LogitsProcessor,
    Tensors,
    builtin_processors,
)
from tp_engine.core.sequence import Sequence


@dataclass(frozen=True)
class SamplingBatch:
    metadata: SamplingMetadata
    # The sequences of `metadata.logprob_rows`, in that order.
    logprob_seqs: list[Sequence] = field(default_factory=list)


class SamplingBatchBuilder(RowFollower):
    def __init__(
        self, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device, seed: int
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tensors = Tensors(vocab_size, self.device)
        self.processors: list[LogitsProcessor] = builtin_processors(self.tensors, eos_token_ids)
        # Draws the noise seed of each sequence without a seed of its own, at its first row.
        self.rng = np.random.default_rng(seed)
        # Batch row -> the noise seed of the sequence in it (int64 holding 64 bits).
        self.seeds = np.zeros(0, dtype=np.int64)

    # -- the batch's rows (RunningBatch's row listener) ------------------------------------------

    def reset_rows(self, max_rows: int) -> None:
        for processor in self.processors:
            processor.reset(max_rows)
        self.seeds = np.zeros(max_rows, dtype=np.int64)

    def add_row(self, row: int, seq: Sequence) -> None:
        if seq.noise_seed is None:
            seed = seq.sampling_params.seed
            seq.noise_seed = (
                seed_bits(seed)
                if seed is not None
                else int(self.rng.integers(-(1 << 63), 1 << 63, dtype=np.int64))
            )
        self.seeds[row] = seq.noise_seed
        for processor in self.processors:
            processor.add_row(row, seq)

    def remove_row(self, row: int) -> None:
        for processor in self.processors:
            processor.remove_row(row)

    # -- one step ---------------------------------------------------------------------------------

    def may_draft(self, rows: np.ndarray) -> np.ndarray:
        """[R] bool: which of batch `rows` may have drafted tokens verified (speculative
        decoding). Not those with a processor whose edit depends on the output so far and that
        cannot follow drafts (penalties, bad words, min_tokens not reached yet, a thinking
        budget before the thinking ends, a grammar outside its constrained phase): the edit of
        a verified position would depend on the drafts before it. A grammar's matcher follows
        them (`GrammarMasks`)."""
        ok = np.ones(rows.size, dtype=bool)
        for processor in self.processors:
            ok &= ~processor.blocks_drafts(rows)
        return ok

    def build(
        self,
        batch: RunningBatch,
        rows: np.ndarray,
        live: np.ndarray | None = None,
        positions_ahead: np.ndarray | None = None,
        drafts: list[np.ndarray | None] | None = None,
    ) -> SamplingBatch:
        """The metadata for sampling `rows` (batch rows, in sampled-row order). A row sampled
        at several positions (a speculative verify entry) appears once per position, with
        `positions_ahead` 0, 1, ...: how far past the row's next output position it samples,
        and `drafts[i]` its entry's drafts (what a grammar's matcher follows ahead)."""
        self.follow(batch)
        rows = np.asarray(rows, dtype=np.intp)
        if live is None:
            live = np.ones(rows.size, dtype=bool)
        num_rows = int(rows.size)
        fields: dict = {"num_rows": num_rows}
        candidates = [(p, p.asking(rows, live)) for p in self.processors]
        asking = [(p, positions) for p, positions in candidates if positions is not None]
        edited_index = np.full(num_rows, -1, dtype=np.int64)
        if asking:
            edited = np.unique(np.concatenate([positions for _, positions in asking]))
            edited_index[edited] = np.arange(edited.size)
            ahead = None
            if positions_ahead is not None and drafts is not None:
                ahead = DraftsAhead(positions_ahead, drafts)
            edits = (
                p.edit(rows, positions, edited_index, edited.size, ahead) for p, positions in asking
            )
            fields["logits_edits"] = tuple(edit for edit in edits if edit is not None)
            if fields["logits_edits"]:
                fields["edited_rows"] = self._ints(edited)
            else:
                edited_index[:] = -1
        fields["groups"] = plan_groups(
            self.tensors.put_array,
            self.vocab_size,
            temperature=np.where(live, batch.temperature[rows], 0.0),
            seeds=self.seeds[rows],
            # The output position being sampled: tokens known plus samples in flight, this
            # step's included, less the prompt (a recomputed row samples its position again).
            counters=self._counters(batch, rows, positions_ahead),
            top_k=batch.top_k[rows],
            top_p=batch.top_p[rows],
            min_p=batch.min_p[rows],
            edited_index=edited_index,
        )

        python_rows = np.flatnonzero(live & batch.needs_python[rows]).tolist()
        seqs = {i: batch.seqs[int(rows[i])] for i in python_rows}
        params = {i: seq.sampling_params for i, seq in seqs.items()}  # type: ignore[union-attr]
        logprob_rows = [i for i in python_rows if params[i].logprobs is not None]
        if logprob_rows:
            fields["logprob_rows"] = self._ints(logprob_rows)
            fields["max_num_logprobs"] = min(
                self.vocab_size, max(params[i].logprobs or 0 for i in logprob_rows)
            )
        return SamplingBatch(SamplingMetadata(**fields), [seqs[i] for i in logprob_rows])  # type: ignore[misc]

    @staticmethod
    def _counters(
        batch: RunningBatch, rows: np.ndarray, positions_ahead: np.ndarray | None
    ) -> np.ndarray:
        """The output position being sampled: tokens known plus samples in flight, this step's
        included, less the prompt (a recomputed row samples its position again)."""
        counters = (
            batch.num_tokens[rows] + batch.num_placeholders[rows] - 1 - batch.prompt_len[rows]
        ).astype(np.int64)
        if positions_ahead is not None:
            counters += positions_ahead
        return counters

    # -- tensors ---------------------------------------------------------------------------------

    def _ints(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return self.tensors.ints(values)

    def _floats(self, values: list[float] | np.ndarray) -> torch.Tensor:
        return self.tensors.floats(values)
