"""Rank 0's sampler, batched over the step: penalties, temperature, min-p, top-k/top-p, seeded
per-request generators and raw logprobs. `sampler` holds the pipeline and its order; the other
modules are its stages. It sees tensors only: rank 0's engine builds the `SamplingMetadata`."""

from rank_worker.sampling.logprobs import compute_logprobs, gather_logprobs
from rank_worker.sampling.metadata import (
    LogprobsTensors,
    PenaltyTensors,
    SamplerOutput,
    SamplingMetadata,
)
from rank_worker.sampling.sampler import GREEDY_EPSILON, process_logits, sample_batch

__all__ = [
    "GREEDY_EPSILON",
    "LogprobsTensors",
    "PenaltyTensors",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs",
    "gather_logprobs",
    "process_logits",
    "sample_batch",
]
