"""Rank 0: one step's `SamplingMetadata` from the running batch's rows that sample in it.

The common parameters (temperature, top-k, top-p, min-p) are arrays of the `RunningBatch`, so
they are gathered for the step's rows with numpy. Every other change of the logits is a logits
processor (`tp_engine.sampling.processors`) with its own per-row state: the builder follows the
batch's rows (it is the batch's row listener) and forwards their comings and goings to the
processors, and each step asks each processor for the edit of its rows. Rows that need their
`Sequence` for the rest (a seed, logprobs: `RunningBatch.needs_python`) are visited in Python.
Nothing loops over tokens or the vocabulary. A feature no row uses costs nothing: its part of
the metadata stays None (or its processor makes no edit).

Seeded requests get their own `torch.Generator`, created at their first sample and kept on the
Sequence; the others share this builder's generator, seeded with `EngineConfig.seed`.

Rows whose sequence stopped running since the step was scheduled (`live` False; their samples
are discarded) are sampled greedily and never visited.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from tp_engine.running_batch import RunningBatch
from tp_engine.sampling import SamplingMetadata
from tp_engine.sampling.processors import LogitsProcessor, Tensors, builtin_processors
from tp_engine.sampling_params import GREEDY_EPSILON
from tp_engine.sequence import Sequence

_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingBatch:
    metadata: SamplingMetadata
    # The sequences of `metadata.logprob_rows`, in that order, and the seeded sequences.
    logprob_seqs: list[Sequence] = field(default_factory=list)
    seeded: list[Sequence] = field(default_factory=list)


class SamplingBatchBuilder:
    def __init__(
        self, vocab_size: int, eos_token_ids: Iterable[int], device: torch.device, seed: int
    ) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tensors = Tensors(vocab_size, self.device)
        self.processors: list[LogitsProcessor] = builtin_processors(self.tensors, eos_token_ids)
        # The batch whose rows the processors follow (the scheduler's; a new one after the
        # engine reconfigures).
        self._batch: RunningBatch | None = None
        # Shared by every row without a seed. Which draws such a row gets depends on the batch,
        # as it does in vLLM; a run of the same requests in the same order repeats itself.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    # -- the batch's rows (RunningBatch's row listener) ------------------------------------------

    def follow(self, batch: RunningBatch) -> None:
        """Follow `batch`'s rows from now on (the processors forget any earlier batch)."""
        if batch is self._batch:
            return
        if self._batch is not None:
            self._batch.row_listeners.remove(self)
        self._batch = batch
        batch.row_listeners.append(self)
        for processor in self.processors:
            processor.reset(batch.max_rows)
        for row in batch.order.tolist():
            self.add_row(row, batch.seqs[row])  # type: ignore[arg-type]

    def add_row(self, row: int, seq: Sequence) -> None:
        for processor in self.processors:
            processor.add_row(row, seq)

    def remove_row(self, row: int) -> None:
        for processor in self.processors:
            processor.remove_row(row)

    # -- one step ---------------------------------------------------------------------------------

    def build(
        self, batch: RunningBatch, rows: np.ndarray, live: np.ndarray | None = None
    ) -> SamplingBatch:
        """The metadata for sampling `rows` (batch rows, in sampled-row order)."""
        self.follow(batch)
        rows = np.asarray(rows, dtype=np.intp)
        if live is None:
            live = np.ones(rows.size, dtype=bool)
        fields: dict = {"num_rows": int(rows.size)}
        temperature = np.where(live, batch.temperature[rows], 0.0).astype(np.float32)  # [B]
        random = temperature > GREEDY_EPSILON
        if random.any():
            fields["temperature"] = self.tensors.put(torch.from_numpy(temperature))
            fields.update(self._truncation(batch, rows, random))
        edits = (processor.edit(rows, live) for processor in self.processors)
        fields["logits_edits"] = tuple(edit for edit in edits if edit is not None)

        python_rows = np.flatnonzero(live & batch.needs_python[rows]).tolist()
        seqs = {i: batch.seqs[int(rows[i])] for i in python_rows}
        params = {i: seq.sampling_params for i, seq in seqs.items()}  # type: ignore[union-attr]
        seeded = [i for i in python_rows if params[i].seed is not None]
        fields["generators"] = {i: self._generator_of(seqs[i]) for i in seeded}  # type: ignore[arg-type]
        logprob_rows = [i for i in python_rows if params[i].logprobs is not None]
        if logprob_rows:
            fields["logprob_rows"] = self._ints(logprob_rows)
            fields["max_num_logprobs"] = min(
                self.vocab_size, max(params[i].logprobs or 0 for i in logprob_rows)
            )
        return SamplingBatch(
            SamplingMetadata(**fields),
            [seqs[i] for i in logprob_rows],  # type: ignore[misc]
            [seqs[i] for i in seeded],  # type: ignore[misc]
        )

    # -- parts -----------------------------------------------------------------------------------

    def _truncation(self, batch: RunningBatch, rows: np.ndarray, random: np.ndarray) -> dict:
        vocab = self.vocab_size
        out: dict = {}
        top_k = np.minimum(batch.top_k[rows], vocab)  # [B] vocab where off
        top_p = batch.top_p[rows]
        sort_rows = np.flatnonzero(random & ((top_k < vocab) | (top_p < 1.0)))
        if sort_rows.size:
            out["top_k_top_p_rows"] = self._ints(sort_rows)
            out["top_k"] = self._ints(top_k[sort_rows])
            out["max_top_k"] = int(top_k[sort_rows].max())
            if bool((top_p[sort_rows] < 1.0).any()):
                out["top_p"] = self._floats(top_p[sort_rows])
        min_p = batch.min_p[rows]
        min_p_rows = np.flatnonzero(random & (min_p > 0.0))
        if min_p_rows.size:
            out["min_p_rows"] = self._ints(min_p_rows)
            out["min_p"] = self._floats(min_p[min_p_rows])
        return out

    def _generator_of(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seed = seq.sampling_params.seed
            assert seed is not None
            # Any integer is a valid seed: wrapped into the generator's 64 bits.
            seq.generator = torch.Generator(device=self.device).manual_seed(seed & _SEED_MASK)
        return seq.generator

    # -- tensors ---------------------------------------------------------------------------------

    def _ints(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return self.tensors.ints(values)

    def _floats(self, values: list[float] | np.ndarray) -> torch.Tensor:
        return self.tensors.floats(values)
