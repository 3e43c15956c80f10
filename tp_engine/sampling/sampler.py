"""The sampling pipeline: gathered logits `[B, V]` + `SamplingMetadata` -> one token per row.

Order, as in vLLM's v1 sampler:

1. raw logprobs (log_softmax of the untouched logits) for rows that asked for logprobs;
2. the logits processors' edits (allowed_token_ids, bad_words, min_tokens, logit_bias,
   penalties, structured-output masks, a forced token; `tp_engine.sampling.processors`): each
   can move the argmax, so greedy rows get them too;
3. greedy rows take the argmax here; a batch of greedy rows only stops at this point, without
   a softmax or a sort;
4. temperature, min-p, then top-k/top-p on the rows that use them (only those rows are sorted);
5. sample with the exponential race: `argmax(p / E)` with `E ~ Exp(1)` i.i.d. is distributed
   as `Categorical(p)` (the Gumbel-max trick in another guise). It batches over rows with
   different distributions and lets each row draw its noise from its own generator: a seeded
   request's row uses its request's generator only, so its tokens do not depend on the rest
   of the batch (nor on the tensor-parallel size, which only changes logits by rounding).
"""

from __future__ import annotations

import torch

from tp_engine.sampling.filters import apply_min_p, apply_top_k_top_p
from tp_engine.sampling.logprob_tensors import gather_logprobs
from tp_engine.sampling.tensors import SamplerOutput, SamplingMetadata
from tp_engine.sampling_params import GREEDY_EPSILON


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Steps 2 and 4: the logits each row samples from (dropped tokens at -inf), scaled by
    temperature; greedy rows are penalised but neither scaled nor truncated. Never writes into
    `logits` (but may return it when nothing changes)."""
    logits = penalised_logits(logits, md)
    if md.temperature is None:
        return logits
    return _scaled_and_truncated(logits, md)


def penalised_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Step 2 on a float32 copy of `logits`; the input itself when there is nothing to change
    (the common case; later steps never write into it)."""
    if not md.logits_edits:
        return logits.float()
    logits = logits.to(torch.float32, copy=True)  # [B, V]
    for edit in md.logits_edits:
        edit.apply(logits)
    return logits


def sample_batch(
    logits: torch.Tensor, md: SamplingMetadata, generator: torch.Generator | None = None
) -> SamplerOutput:
    """One token per row of `logits [B, V]`; `generator` serves the rows without their own."""
    if logits.ndim != 2 or logits.shape[0] != md.num_rows:
        raise ValueError(
            f"sample_batch: logits {tuple(logits.shape)} must be [B, V] with B = {md.num_rows}"
        )
    raw_logprobs = None
    if md.logprob_rows is not None:
        raw_logprobs = torch.log_softmax(logits[md.logprob_rows].float(), dim=-1)  # [L, V]

    logits = penalised_logits(logits, md)  # [B, V]
    greedy = logits.argmax(dim=-1)  # [B]
    if md.temperature is None:
        tokens = greedy
    else:
        probs = torch.softmax(_scaled_and_truncated(logits, md), dim=-1)  # [B, V]
        noise = torch.empty_like(probs).exponential_(generator=generator)  # [B, V] ~ Exp(1)
        for row, row_generator in md.generators.items():
            noise[row].exponential_(generator=row_generator)
        # A draw of exactly 0 would pick its token whatever its probability (even 0: 0/0 is
        # NaN, which argmax prefers); some backends' exponential_ can return 0.
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
        sampled = (probs / noise).argmax(dim=-1)  # [B]
        tokens = torch.where(md.temperature <= GREEDY_EPSILON, greedy, sampled)
    logprobs = None
    if raw_logprobs is not None:
        assert md.logprob_rows is not None
        logprobs = gather_logprobs(raw_logprobs, tokens[md.logprob_rows], md.max_num_logprobs)
    return SamplerOutput(token_ids=tokens, logprobs=logprobs)


def _scaled_and_truncated(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    assert md.temperature is not None
    # Greedy rows are sampled too (their result is discarded): scale them by 1, not by ~0.
    temperature = torch.where(md.temperature <= GREEDY_EPSILON, 1.0, md.temperature)  # [B]
    logits = logits / temperature.unsqueeze(1)  # [B, V]
    if md.min_p_rows is not None:
        assert md.min_p is not None
        logits[md.min_p_rows] = apply_min_p(logits[md.min_p_rows], md.min_p)
    if md.top_k_top_p_rows is not None:
        assert md.top_k is not None
        rows = md.top_k_top_p_rows
        logits[rows] = apply_top_k_top_p(logits[rows], md.top_k, md.top_p, md.max_top_k)
    return logits
