"""Penalties: a logit change that can move the argmax, so it applies to greedy rows too. It
works on the raw logits, before temperature, as in vLLM (`processors.Penalties` makes its
tensors).

- repetition penalty r (CTRL, Keskar et al. 2019, as in vLLM and transformers): every token seen
  in the prompt or the output so far has its logit divided by r if positive, multiplied by r if
  not;
- frequency penalty f: `logit -= f * count` (count of the token in the output so far);
- presence penalty p: `logit -= p * (count > 0)`.
"""

from __future__ import annotations

import torch

from tp_engine.sampling.tensors import PenaltyTensors


def token_counts(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[P, L]` ids padded with `vocab_size` -> `[P, V]` int32 occurrence counts."""
    counts = torch.zeros(
        (padded_ids.shape[0], vocab_size + 1), dtype=torch.int32, device=padded_ids.device
    )  # [P, V+1]; the extra column swallows the padding
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """Penalise `logits [B, V]` in place on the rows of `pen`."""
    vocab_size = logits.shape[-1]
    rows = logits[pen.rows]  # [P, V] a copy; written back below
    output_counts = token_counts(pen.output_ids, vocab_size)  # [P, V]
    if pen.prompt_ids is not None:
        seen = (token_counts(pen.prompt_ids, vocab_size) > 0) | (output_counts > 0)  # [P, V]
        r = pen.repetition.unsqueeze(1)  # [P, 1]
        penalised = torch.where(rows > 0, rows / r, rows * r)
        rows = torch.where(seen, penalised, rows)
    rows -= pen.frequency.unsqueeze(1) * output_counts
    rows -= pen.presence.unsqueeze(1) * (output_counts > 0)
    logits[pen.rows] = rows
