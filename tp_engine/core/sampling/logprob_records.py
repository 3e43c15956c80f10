"""Rank 0's logprob bookkeeping: which extra logits rows prompt logprobs need, and recording
sampled and prompt logprobs on the sequences.

Device tensors (`tp_engine.core.sampling.LogprobsTensors`) -> one `TokenLogprobs` per position on
the sequence, copied to the host once per step. Prompt logprobs ask the StepPlan for the logits
of every prompt position a chunk computes (after the rows that are sampled); each such row adds
`[1, V]` fp32 logits on rank 0. With chunked prefill the scheduler gives a step at most
`max_num_seqs` such rows (as many as the sampled rows the GPU memory profile measures), so a
long prompt with prompt_logprobs is computed in small chunks instead of exhausting memory.
Without chunked prefill a whole prompt is one chunk: `prompt_len * V * 4` bytes in its step.
"""

from __future__ import annotations

import torch

from tp_engine.common.transfers import to_device_async
from tp_engine.core.plan_builder import PromptLogprobRows
from tp_engine.core.sampling import LogprobsTensors, compute_logprobs
from tp_engine.core.sequence import Sequence, TokenLogprobs


def prompt_logprob_tensors(logits: torch.Tensor, found: list[PromptLogprobRows]) -> LogprobsTensors:
    """`logits [R, V]`: the extra rows of `found`, in order -> their logprobs, on the device
    (queued without waiting for the GPU)."""
    targets = torch.tensor([t for f in found for t in f.targets], dtype=torch.int64)
    max_num = max(f.seq.sampling_params.prompt_logprobs or 0 for f in found)
    return compute_logprobs(
        logits, to_device_async(targets, logits.device), min(max_num, logits.shape[-1])
    )


def record_prompt_logprobs(tensors: LogprobsTensors, found: list[PromptLogprobRows]) -> None:
    """Append the entries of `prompt_logprob_tensors(..., found)` (host tensors) to the
    sequences."""
    nums = [f.seq.sampling_params.prompt_logprobs or 0 for f in found]
    entries = _entries(tensors, [n for f, n in zip(found, nums, strict=True) for _ in f.targets])
    offset = 0
    for f in found:
        # A preempted sequence keeps them (its recompute skips recorded positions).
        if not f.seq.is_finished:
            f.seq.prompt_logprobs.extend(entries[offset : offset + len(f.targets)])
        offset += len(f.targets)


def _entries(tensors: LogprobsTensors, num_top: list[int]) -> list[TokenLogprobs]:
    """Device tensors -> one TokenLogprobs per row, each cut to its own top-k (one copy)."""
    ids = tensors.token_ids.tolist()
    values = tensors.logprobs.tolist()
    ranks = tensors.ranks.tolist()
    return [
        TokenLogprobs(ids[r][: k + 1], values[r][: k + 1], ranks[r]) for r, k in enumerate(num_top)
    ]


def record_sample_logprobs(seqs: list[Sequence], tensors: LogprobsTensors) -> None:
    """Give each sequence the entries of its sampled rows (rows in `seqs` order; a sequence's
    rows are consecutive, in output order) for the tokens it received.

    Call after `Scheduler.update`: a sequence gets an entry while it has more output tokens than
    entries, so one no longer running when the step was applied (aborted, preempted, finished
    meanwhile) gets none, and one that a stop check ended within a speculative step gets
    entries up to its last token only.
    """
    entries = _entries(tensors, [seq.sampling_params.logprobs or 0 for seq in seqs])
    for seq, entry in zip(seqs, entries, strict=True):
        if len(seq.output_logprobs) >= seq.num_output_tokens:
            continue
        seq.output_logprobs.append(entry)
        seq.cumulative_logprob += entry.logprobs[0]
