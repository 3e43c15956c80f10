"""Rank 0's sampling, batched over the step: logits processors (logit bias, allowed tokens, bad
words, min_tokens, penalties, structured-output masks, a forced token), temperature, min-p,
top-k/top-p with counter-based seeded noise (one Gumbel-max pass over the logits where it can),
and raw logprobs.

Only rank 0 samples (the logits are gathered to it), so this lives with rank 0's control plane
rather than in `rank_worker`. Two layers:

- tensors in, tensors out: `sampler` holds the pipeline and its order, `groups` splits a
  step's rows by the path each takes, `top_k_slice` samples from the top-k slice, `filters`,
  `edits` (the logits processors' per-step changes, with `penalties` and `grammar_mask`) and
  `logprob_tensors` are its stages, `tensors` the per-step inputs and outputs
  (`SamplingMetadata`, `LogprobsTensors`), `profiling` its worst case for the memory warm-up;
- requests to tensors and back: `processors` keep each logits change's per-row state and make
  its edits, `batch` builds a step's `SamplingMetadata` from the rows that sample, and
  `logprob_records` turns logprob tensors into entries on the sequences.
"""

from tp_engine.core.sampling.logprob_tensors import compute_logprobs, gather_logprobs
from tp_engine.core.sampling.sampler import GREEDY_EPSILON, process_logits, sample_batch
from tp_engine.core.sampling.tensors import (
    MAX_NUM_LOGPROBS,
    GrammarMask,
    LogprobsTensors,
    PenaltyTensors,
    SamplerOutput,
    SamplingMetadata,
)

__all__ = [
    "GREEDY_EPSILON",
    "MAX_NUM_LOGPROBS",
    "GrammarMask",
    "LogprobsTensors",
    "PenaltyTensors",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_logprobs",
    "gather_logprobs",
    "process_logits",
    "sample_batch",
]
