"""Rank 0's sampler entry points (the pipeline lives in `rank_worker.sampling`).

`sample` is the temperature-only form (greedy where T = 0), kept for callers that need no
other control; `sample_for_profiling` runs the most memory-hungry path of the pipeline (a sort
over the vocabulary and logprobs for every row), so that a memory measurement that runs it
leaves room for the worst step the sampler can see.
"""

from __future__ import annotations

import torch

from rank_worker.sampling import GREEDY_EPSILON, SamplingMetadata, sample_batch

__all__ = ["GREEDY_EPSILON", "sample", "sample_for_profiling"]

# vLLM's default cap on logprobs per token; the engine refuses requests above it.
MAX_NUM_LOGPROBS = 20


def sample(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`logits [B, V]` fp32, `temperatures [B]` -> token ids `[B]` int64."""
    if logits.ndim != 2 or temperatures.shape != logits.shape[:1]:
        raise ValueError(
            f"sample: logits {tuple(logits.shape)} and temperatures {tuple(temperatures.shape)} "
            "must be [B, V] and [B]"
        )
    temperatures = temperatures.to(device=logits.device, dtype=torch.float32)
    all_greedy = bool((temperatures <= GREEDY_EPSILON).all())
    md = SamplingMetadata(
        num_rows=logits.shape[0], temperature=None if all_greedy else temperatures
    )
    return sample_batch(logits, md, generator).token_ids


def sample_for_profiling(logits: torch.Tensor) -> torch.Tensor:
    """Sample every row through top-k + top-p (a full sort) with logprobs."""
    num_rows, vocab_size = logits.shape
    rows = torch.arange(num_rows, device=logits.device)
    md = SamplingMetadata(
        num_rows=num_rows,
        temperature=torch.ones(num_rows, device=logits.device),
        top_k_top_p_rows=rows,
        top_k=torch.full((num_rows,), vocab_size, dtype=torch.int64, device=logits.device),
        top_p=torch.full((num_rows,), 0.9, device=logits.device),
        logprob_rows=rows,
        max_num_logprobs=min(MAX_NUM_LOGPROBS, vocab_size),
    )
    return sample_batch(logits, md).token_ids
