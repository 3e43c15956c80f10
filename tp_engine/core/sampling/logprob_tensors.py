"""Log-probabilities of chosen tokens and the top-k, for sampled tokens and for prompt tokens.

They are the model's own ("raw") log-probabilities, `log_softmax` of the logits before
penalties, min_tokens bans, temperature and truncation: vLLM's default `logprobs_mode =
"raw_logprobs"`. So a token's logprob does not depend on how it was sampled, and the prompt's
logprobs are comparable with the output's.
"""

from __future__ import annotations

import torch

from tp_engine.core.sampling.tensors import LogprobsTensors


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: int) -> LogprobsTensors:
    """`logprobs [L, V]` (log_softmax), `chosen [L]` token ids -> chosen + top-`num_top`."""
    chosen = chosen.to(torch.int64).unsqueeze(1)  # [L, 1]
    chosen_lp = logprobs.gather(1, chosen)  # [L, 1]
    # Rank 1 = most likely. Tokens tied with the chosen one count ahead of it (vLLM's rule:
    # the number of tokens at least as likely as the chosen one, itself included).
    ranks = (logprobs >= chosen_lp).sum(dim=-1)  # [L]
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)  # [L, K] each, descending
        token_ids = torch.cat([chosen, top_ids], dim=1)  # [L, K+1]
        values = torch.cat([chosen_lp, top_lp], dim=1)  # [L, K+1]
    else:
        token_ids, values = chosen, chosen_lp
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)


def compute_logprobs(logits: torch.Tensor, chosen: torch.Tensor, num_top: int) -> LogprobsTensors:
    """Raw logprobs of `chosen [L]` and the top-`num_top` from `logits [L, V]`."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), chosen, num_top)
