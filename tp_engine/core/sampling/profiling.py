"""The sampler at its most memory-hungry, for the GPU memory warm-up.

`rank_worker.runner.model_runner` measures the memory a step can take by running the largest step
once; only rank 0 samples, so rank 0's engine hands it `profile_sampling`, which puts every
sampled row through the widest path of the pipeline (a sort over the vocabulary for top-p
without top-k, logprobs) and the prompt-logprob rows through `compute_logprobs`, so that the
measurement leaves room for the worst step the sampler can see. It holds the penalties' token
counts of every sampled row meanwhile (`processors.TokenCounts`: kept between steps, so they
add to any step's peak).
"""

from __future__ import annotations

import numpy as np
import torch

from tp_engine.core.sampling.groups import cpu_put, plan_groups
from tp_engine.core.sampling.logprob_tensors import compute_logprobs
from tp_engine.core.sampling.sampler import sample_batch
from tp_engine.core.sampling.tensors import MAX_NUM_LOGPROBS, SamplingMetadata


def sample_for_profiling(logits: torch.Tensor) -> torch.Tensor:
    """Sample every row of `logits [B, V]` through top-p without top-k (a full sort) with
    logprobs."""
    num_rows, vocab_size = logits.shape
    md = SamplingMetadata(
        num_rows=num_rows,
        groups=plan_groups(
            cpu_put(logits.device),
            vocab_size,
            temperature=np.ones(num_rows, dtype=np.float32),
            seeds=np.zeros(num_rows, dtype=np.int64),
            counters=np.zeros(num_rows, dtype=np.int64),
            top_p=np.full(num_rows, 0.9, dtype=np.float32),
        ),
        logprob_rows=torch.arange(num_rows, device=logits.device),
        max_num_logprobs=min(MAX_NUM_LOGPROBS, vocab_size),
    )
    return sample_batch(logits, md).token_ids


def profile_sampling(logits: torch.Tensor, num_sampled: int) -> None:
    """`logits [B' + R, V]`: the first `num_sampled` rows are sampled, the other R are
    prompt-logprob rows (the engine's order); `rank_worker.runner.startup.ProfileSampling`."""
    vocab_size = logits.shape[-1]
    # What TokenCounts holds when every sampled row has penalties.
    counts = torch.zeros((num_sampled, vocab_size), dtype=torch.int32, device=logits.device)
    seen = torch.zeros((num_sampled, vocab_size), dtype=torch.bool, device=logits.device)
    sample_for_profiling(logits[:num_sampled])
    del counts, seen
    prompt_rows = logits[num_sampled:]
    if prompt_rows.shape[0]:
        targets = torch.zeros(prompt_rows.shape[0], dtype=torch.int64, device=logits.device)
        compute_logprobs(prompt_rows, targets, min(MAX_NUM_LOGPROBS, logits.shape[-1]))
