"""Logits edits: one step's change of the logits by one logits processor, as tensors.

Each edit names the rows of the batch it touches and carries tensors for those rows alone, so
a row that asks for nothing is never read or written and costs nothing; an edit is one or two
batched tensor operations whatever the number of its rows (no Python loop over rows on the
device path). `apply` writes into float32 logits `[B, V]` in place. The sampler applies a step's
edits in the order the processors made them (`tp_engine.core.sampling.processors`).

N below is the number of (row, token) pairs of an edit, R the number of its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tp_engine.core.sampling.grammar_mask import apply_token_bitmask
from tp_engine.core.sampling.penalties import apply_penalties
from tp_engine.core.sampling.tensors import GrammarMask, LogitsEdit, PenaltyTensors

_NEG_INF = float("-inf")

__all__ = [
    "AddBias",
    "AllowOnly",
    "BanTokens",
    "ForceTokens",
    "LogitsEdit",
    "MaskByGrammar",
    "Penalize",
]


@dataclass(frozen=True)
class BanTokens:
    """`logits[rows[i], token_ids[i]] = -inf`: min_tokens' stop ids, bad words."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.token_ids), torch.tensor(_NEG_INF, device=logits.device))


@dataclass(frozen=True)
class AllowOnly:
    """Rows `rows` keep only the tokens paired with them; every other token is -inf
    (allowed_token_ids). Pair i allows token `token_ids[i]` in row `rows[row_of[i]]`."""

    rows: torch.Tensor  # [R] int64
    row_of: torch.Tensor  # [N] int64, into `rows`
    token_ids: torch.Tensor  # [N] int64

    def apply(self, logits: torch.Tensor) -> None:
        # [R, V] bool for the asking rows only.
        banned = torch.ones(
            (self.rows.shape[0], logits.shape[1]), dtype=torch.bool, device=logits.device
        )
        banned[self.row_of, self.token_ids] = False
        logits[self.rows] = logits[self.rows].masked_fill(banned, _NEG_INF)


@dataclass(frozen=True)
class AddBias:
    """`logits[rows[i], token_ids[i]] += bias[i]` (logit_bias; a row's ids are distinct)."""

    rows: torch.Tensor  # [N] int64
    token_ids: torch.Tensor  # [N] int64
    bias: torch.Tensor  # [N] fp32

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.token_ids), self.bias, accumulate=True)


@dataclass(frozen=True)
class Penalize:
    """Repetition, frequency and presence penalties (`tp_engine.core.sampling.penalties`)."""

    tensors: PenaltyTensors

    def apply(self, logits: torch.Tensor) -> None:
        apply_penalties(logits, self.tensors)


@dataclass(frozen=True)
class MaskByGrammar:
    """Structured outputs: each constrained row keeps the tokens its bitmask allows."""

    mask: GrammarMask

    def apply(self, logits: torch.Tensor) -> None:
        apply_token_bitmask(logits, self.mask)


@dataclass(frozen=True)
class ForceTokens:
    """Row `rows[i]` can only take `token_ids[i]` (a spent thinking budget forces `</think>`),
    whatever the edits before said: its row becomes 0 there and -inf elsewhere, so greedy and
    random sampling (any temperature, top-k, top-p, min-p) both pick it. Applied last."""

    rows: torch.Tensor  # [F] int64
    token_ids: torch.Tensor  # [F] int64

    def apply(self, logits: torch.Tensor) -> None:
        logits[self.rows] = _NEG_INF
        logits.index_put_((self.rows, self.token_ids), torch.tensor(0.0, device=logits.device))
