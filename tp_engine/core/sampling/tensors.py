"""What the sampler needs for one step, as tensors built once per step on rank 0.

Rank 0's engine turns its sequences' `SamplingParams` into one `SamplingMetadata` per step
(`tp_engine.core.sampling.batch`); the sampler sees only tensors, never a request. The rows are
split into groups that each take their cheapest path (`SampleGroup`); a part that only some
rows use carries the indices of those rows and tensors for them alone, and is None or empty
when no row uses it, so a batch that does not ask for a feature pays nothing for it.

B = rows of gathered logits that are sampled this step, V = vocabulary size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch

# vLLM's default cap on logprobs per token; the engine refuses requests above it.
MAX_NUM_LOGPROBS = 20


@dataclass(frozen=True)
class PenaltyTensors:
    """Repetition, presence and frequency penalties for the rows that have any, from token
    counts kept on the device across steps (`processors.TokenCounts`)."""

    # [P] int64: rows of the batch these tensors describe.
    rows: torch.Tensor
    # [P, V] int32: how often each token occurs in each row's output so far.
    output_counts: torch.Tensor
    # [P, V] bool: the tokens of each row's prompt; None when no row has a repetition penalty
    # (the only penalty that looks at the prompt, as in vLLM).
    prompt_seen: torch.Tensor | None
    # [P] fp32 each: the penalties (0, 0 and 1 are "off").
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass(frozen=True)
class GrammarMask:
    """The tokens that rows with a structured-output constraint may take this step."""

    # [E, ceil(V / 32)] int32, xgrammar's layout: bit t % 32 of word t // 32 set = allowed;
    # a row per row of the edited copy. Only the rows in `rows` are filled; the others are
    # never read.
    bitmask: torch.Tensor
    # The rows of the edited copy with a constraint (on the host: the kernel takes a list).
    rows: tuple[int, ...]


class LogitsEdit(Protocol):
    """One logits processor's change of one step's logits (`tp_engine.core.sampling.edits`)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Change `logits [E, V]` (float32: the edited rows' copy) in place, on this edit's rows
        only."""


class SamplePath(enum.Enum):
    """How a group of rows is sampled, cheapest first (`tp_engine.core.sampling.groups` chooses)."""

    # Greedy rows only: `argmax`, one read.
    ARGMAX = "argmax"
    # Greedy, temperature and min-p rows: `kernels.gumbel_sample`, one read (two for min-p).
    ONE_PASS = "one_pass"
    # Rows with a top-k bound (with or without top-p and min-p): the top-(max_k + 1) slice
    # (`tp_engine.core.sampling.top_k_slice`).
    TOP_K = "top_k"
    # Rows with top-p and no top-k: a sort of the whole row (exact), then one pass.
    FULL_SORT = "full_sort"


@dataclass(frozen=True)
class SampleGroup:
    """Rows of one step sampled together along one path, from one source: the raw logits, or
    the float32 copy of the edited rows (`SamplingMetadata.edited_rows`). G = its rows."""

    path: SamplePath
    # Whether its rows are rows of the edited copy (else of the raw logits).
    edited: bool
    # [G] int64: the rows of the batch the tokens are for.
    out_rows: torch.Tensor
    # [G] int64: the rows of the source these are; `whole`: exactly the source's rows, in
    # order (torch ops then read the source as it is, without gathering the rows).
    src_rows: torch.Tensor
    whole: bool
    # [G] fp32: 1 / temperature, 0 for greedy rows (scaling by a reciprocal computed once is
    # what the kernel and every other path do, so they agree to the bit).
    inv_temp: torch.Tensor
    # [G] fp32: log(min_p), -inf where min-p is off.
    log_min_p: torch.Tensor
    # [G] int64: each row's seed (64 bits) and counter (the output position being sampled):
    # the key of its noise (`kernels.gumbel_sample`).
    seeds: torch.Tensor
    counters: torch.Tensor
    # TOP_K and FULL_SORT only: [G] int64 top-k (V where off) and [G] fp32 top-p (1 where
    # off); TOP_K: the largest top-k of the group, known on the host (the slice's width).
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    max_top_k: int | None = None
    # Whether any row of the group has min-p / top-p on (paths skip what no row uses).
    any_min_p: bool = False
    any_top_p: bool = False


@dataclass(frozen=True)
class SamplingMetadata:
    """One step's sampling controls for a batch of B rows."""

    num_rows: int
    # Every row in exactly one group (`tp_engine.core.sampling.groups.plan_groups`).
    groups: tuple[SampleGroup, ...] = ()
    # [E] int64: the rows some logits processor changes this step, in increasing order; they
    # alone are copied (float32 [E, V]) and edited. None when no row asks for a change.
    edited_rows: torch.Tensor | None = None
    # The logits processors' edits of this step, in the order they apply, on the edited copy
    # (their rows are rows of it: `tp_engine.core.sampling.processors`).
    logits_edits: tuple[LogitsEdit, ...] = ()
    # Rows that want logprobs of their sampled token, [L] int64, and the most top-k entries any
    # of them wants (each row slices its own k out of it).
    logprob_rows: torch.Tensor | None = None
    max_num_logprobs: int = 0

    @property
    def all_greedy(self) -> bool:
        return all(g.path is SamplePath.ARGMAX for g in self.groups)


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
