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

from tp_engine.core.sampling.tensors import PenaltyTensors


def apply_penalties(logits: torch.Tensor, pen: PenaltyTensors) -> None:
    """Penalise `logits [B, V]` in place on the rows of `pen`."""
    rows = logits[pen.rows]  # [P, V] a copy; written back below
    output_counts = pen.output_counts  # [P, V]
    if pen.prompt_seen is not None:
        seen = pen.prompt_seen | (output_counts > 0)  # [P, V]
        r = pen.repetition.unsqueeze(1)  # [P, 1]
        penalised = torch.where(rows > 0, rows / r, rows * r)
        rows = torch.where(seen, penalised, rows)
    rows -= pen.frequency.unsqueeze(1) * output_counts
    rows -= pen.presence.unsqueeze(1) * (output_counts > 0)
    logits[pen.rows] = rows
