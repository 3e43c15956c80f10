"""What the sampler needs for one step, as tensors built once per step on rank 0.

Rank 0's engine turns its sequences' `SamplingParams` into one `SamplingMetadata` per step
(`tp_engine.sampling.batch`); the sampler sees only tensors and generators, never a request.
Every optional part is None when no row of the batch uses it, so a batch that does not ask for
a feature pays nothing for it; parts that only some rows use carry the indices of those rows
and tensors for them alone (e.g. only rows with top-k/top-p are sorted).

B = rows of gathered logits that are sampled this step, V = vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

# vLLM's default cap on logprobs per token; the engine refuses requests above it.
MAX_NUM_LOGPROBS = 20


@dataclass(frozen=True)
class PenaltyTensors:
    """Repetition, presence and frequency penalties for the rows that have any.

    Token ids are padded with V (one past the vocabulary): the padding lands in an extra count
    column that is dropped, so building the counts is a single scatter_add with no Python loop
    over tokens.
    """

    # [P] int64: rows of the batch these tensors describe.
    rows: torch.Tensor
    # [P, Lo] int64: each row's output tokens so far, padded with V.
    output_ids: torch.Tensor
    # [P, Lp] int64: each row's prompt tokens, padded with V; None when no row has a
    # repetition penalty (the only penalty that looks at the prompt, as in vLLM).
    prompt_ids: torch.Tensor | None
    # [P] fp32 each: the penalties (0, 0 and 1 are "off").
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass(frozen=True)
class GrammarMask:
    """The tokens that rows with a structured-output constraint may take this step."""

    # [B, ceil(V / 32)] int32, xgrammar's layout: bit t % 32 of word t // 32 set = allowed.
    # Only the rows in `rows` are filled; the others are never read.
    bitmask: torch.Tensor
    # The rows of the batch with a constraint (on the host: the kernel takes a list).
    rows: tuple[int, ...]


class LogitsEdit(Protocol):
    """One logits processor's change of one step's logits (`tp_engine.sampling.edits`)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Change `logits [B, V]` (float32) in place, on this edit's rows only."""


@dataclass(frozen=True)
class SamplingMetadata:
    """One step's sampling controls for a batch of B rows."""

    num_rows: int
    # [B] fp32; rows at or below GREEDY_EPSILON are greedy. None when every row is greedy, which
    # is the argmax-only fast path.
    temperature: torch.Tensor | None = None
    # Rows (non-greedy) with top-k or top-p on; only these are sorted. [S] int64 indices.
    top_k_top_p_rows: torch.Tensor | None = None
    # [S] int64: top-k of those rows, V where off; and its largest value, known on the host so
    # that the top-k-only path never reads it back from the device.
    top_k: torch.Tensor | None = None
    max_top_k: int | None = None
    # [S] fp32: top-p of those rows, 1.0 where off; None when no row has top-p (the top-k-only
    # path uses one `topk` instead of a full sort).
    top_p: torch.Tensor | None = None
    # Rows (non-greedy) with min-p on, [M] int64, and their min_p values, [M] fp32.
    min_p_rows: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # The logits processors' edits of this step, in the order they apply (each touches only
    # its own rows; empty when no row asks for any: `tp_engine.sampling.processors`).
    logits_edits: tuple[LogitsEdit, ...] = ()
    # row -> that request's own generator (requests with a seed). Other rows draw from the
    # generator passed to the sampler, so a seeded row's draws never depend on its neighbours.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Rows that want logprobs of their sampled token, [L] int64, and the most top-k entries any
    # of them wants (each row slices its own k out of it).
    logprob_rows: torch.Tensor | None = None
    max_num_logprobs: int = 0

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None


@dataclass(frozen=True)
class LogprobsTensors:
    """Log-probabilities of one chosen token per row plus each row's top-k, on the device.

    Column 0 is the chosen token (the sampled one, or the actual next prompt token for prompt
    logprobs); columns 1..K are the K most likely tokens, most likely first. This is vLLM's
    layout, so a chosen token that is also in the top-k appears twice.
    """

    # [L, K+1] int64
    token_ids: torch.Tensor
    # [L, K+1] fp32
    logprobs: torch.Tensor
    # [L] int64: rank of the chosen token (1 = most likely).
    ranks: torch.Tensor


@dataclass(frozen=True)
class SamplerOutput:
    # [B] int64: the sampled token of every row.
    token_ids: torch.Tensor
    # For `SamplingMetadata.logprob_rows`, in that order; None when no row asked.
    logprobs: LogprobsTensors | None = None
