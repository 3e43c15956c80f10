"""Rank 0: one step's `SamplingMetadata` from the running batch's rows that sample in it.

The common parameters (temperature, top-k, top-p, min-p) are arrays of the `RunningBatch`, so
they are gathered for the step's rows with numpy; only rows that need their `Sequence`
(penalties over their tokens, min_tokens bans, a seed, logprobs, a thinking budget, a
structured-output constraint: `RunningBatch.needs_python`) are visited in Python. Nothing loops
over tokens or the vocabulary. A feature no row uses costs nothing: its part of the metadata
stays None.

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
from tp_engine.sampling import GrammarMask, PenaltyTensors, SamplingMetadata
from tp_engine.sampling_params import GREEDY_EPSILON
from tp_engine.sequence import Sequence
from tp_engine.structured_outputs import fill_bitmasks
from tp_engine.thinking import forced_think_end
from tp_engine.transfers import to_device_async

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
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = torch.device(device)
        # Shared by every row without a seed. Which draws such a row gets depends on the batch,
        # as it does in vLLM; a run of the same requests in the same order repeats itself.
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def build(
        self, batch: RunningBatch, rows: np.ndarray, live: np.ndarray | None = None
    ) -> SamplingBatch:
        """The metadata for sampling `rows` (batch rows, in sampled-row order)."""
        if live is None:
            live = np.ones(rows.size, dtype=bool)
        fields: dict = {"num_rows": int(rows.size)}
        temperature = np.where(live, batch.temperature[rows], 0.0).astype(np.float32)  # [B]
        random = temperature > GREEDY_EPSILON
        if random.any():
            fields["temperature"] = self._to_device(torch.from_numpy(temperature))
            fields.update(self._truncation(batch, rows, random))

        python_rows = np.flatnonzero(live & batch.needs_python[rows]).tolist()
        seqs = {i: batch.seqs[int(rows[i])] for i in python_rows}
        params = {i: seq.sampling_params for i, seq in seqs.items()}  # type: ignore[union-attr]
        fields["penalties"] = self._penalties(seqs)  # type: ignore[arg-type]
        fields["banned"] = self._bans(seqs)  # type: ignore[arg-type]
        fields["forced"] = self._forced(seqs)  # type: ignore[arg-type]
        fields["grammar"] = self._grammar(seqs, int(rows.size))  # type: ignore[arg-type]
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

    def _penalties(self, seqs: dict[int, Sequence]) -> PenaltyTensors | None:
        rows = [
            i
            for i, seq in seqs.items()
            if (p := seq.sampling_params).presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or p.repetition_penalty != 1.0
        ]
        if not rows:
            return None
        chosen = [seqs[i] for i in rows]
        params = [seq.sampling_params for seq in chosen]
        output_ids = self._padded([seq.token_ids[seq.num_prompt_tokens :] for seq in chosen])
        prompt_ids = None
        if any(p.repetition_penalty != 1.0 for p in params):
            prompt_ids = self._padded([seq.token_ids[: seq.num_prompt_tokens] for seq in chosen])
        return PenaltyTensors(
            rows=self._ints(rows),
            output_ids=output_ids,
            prompt_ids=prompt_ids,
            presence=self._floats([p.presence_penalty for p in params]),
            frequency=self._floats([p.frequency_penalty for p in params]),
            repetition=self._floats([p.repetition_penalty for p in params]),
        )

    def _bans(self, seqs: dict[int, Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """EOS (unless ignore_eos) and stop token ids of rows below min_tokens, as vLLM's
        min-tokens processor: the sample about to be drawn would be output token
        `num_output_tokens + 1`, which may stop the sequence only past min_tokens."""
        rows: list[int] = []
        token_ids: list[int] = []
        for i, seq in seqs.items():
            p = seq.sampling_params
            if seq.num_output_tokens >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned.update(self.eos_token_ids)
            banned = [t for t in banned if t < self.vocab_size]
            rows += [i] * len(banned)
            token_ids += banned
        if not rows:
            return None
        return self._ints(rows), self._ints(token_ids)

    def _forced(self, seqs: dict[int, Sequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows whose thinking budget is spent: their next token is `</think>`."""
        forced = {
            i: token
            for i, seq in seqs.items()
            if (token := forced_think_end(seq.output_token_ids, seq.sampling_params)) is not None
        }
        if not forced:
            return None
        return self._ints(list(forced)), self._ints(list(forced.values()))

    def _grammar(self, seqs: dict[int, Sequence], num_rows: int) -> GrammarMask | None:
        """The token bitmask of the rows whose structured-output constraint masks their next
        token, filled by their matchers (which have followed every token applied so far)."""
        rows = [i for i, seq in seqs.items() if seq.grammar is not None and seq.grammar.masks_next]
        if not rows:
            return None
        bitmask = torch.empty((num_rows, (self.vocab_size + 31) // 32), dtype=torch.int32)
        fill_bitmasks([seqs[i].grammar for i in rows], bitmask, rows)  # type: ignore[misc]
        return GrammarMask(self._to_device(bitmask), tuple(rows))

    def _generator_of(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seed = seq.sampling_params.seed
            assert seed is not None
            # Any integer is a valid seed: wrapped into the generator's 64 bits.
            seq.generator = torch.Generator(device=self.device).manual_seed(seed & _SEED_MASK)
        return seq.generator

    # -- tensors ---------------------------------------------------------------------------------

    def _padded(self, id_lists: list[list[int]]) -> torch.Tensor:
        """Token id lists -> `[P, L]` int64 padded with V (see PenaltyTensors), on the device."""
        width = max((len(ids) for ids in id_lists), default=0)
        arr = np.full((len(id_lists), max(width, 1)), self.vocab_size, dtype=np.int64)
        for row, ids in enumerate(id_lists):
            arr[row, : len(ids)] = ids
        return self._to_device(torch.from_numpy(arr))

    def _ints(self, values: list[int] | np.ndarray) -> torch.Tensor:
        return self._to_device(torch.as_tensor(np.asarray(values, dtype=np.int64)))

    def _floats(self, values: list[float] | np.ndarray) -> torch.Tensor:
        return self._to_device(torch.as_tensor(np.asarray(values, dtype=np.float32)))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        # Never a pageable copy: it would wait for the forward pass rank 0 overlaps with.
        return to_device_async(host, self.device)
