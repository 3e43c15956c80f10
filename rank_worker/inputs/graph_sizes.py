"""The sizes a step is padded to when it replays a CUDA graph: the batch sizes of uniform steps,
one ladder shared by the target's graphs (`rank_worker.runner.cuda_graphs`) and the EAGLE-3 draft
chain's, so both pad a batch to the same size; and the token counts of mixed steps
(`rank_worker.runner.mixed_graphs`)."""

from __future__ import annotations

import bisect

# Sizes below the first multiple of 8 (batches of a few interactive requests are common).
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then multiples of 8, up to and including max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in _SMALL_SIZES if s <= max_num_seqs}
    sizes.update(range(_SIZE_STEP, max_num_seqs + 1, _SIZE_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def graph_size_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows (sizes sorted), or None."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


# Token buckets of mixed steps: powers of two up to the first multiple of 64, then every 64 up
# to 512, then every 256 (vLLM's capture sizes thin out the same way). Not tuned on a GPU yet.
_SMALL_BUCKETS = (8, 16, 32, 64)
_MID_STEP, _MID_END, _LARGE_STEP = 64, 512, 256


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture mixed steps at, up to and including `max_tokens` (>= 2: a step
    of one token is a decode)."""
    if max_tokens < 2:
        raise ValueError(f"the largest mixed-step bucket must be >= 2 tokens, got {max_tokens}")
    sizes = {s for s in _SMALL_BUCKETS if s <= max_tokens}
    sizes.update(range(_MID_STEP, min(max_tokens, _MID_END) + 1, _MID_STEP))
    sizes.update(range(_MID_END, max_tokens + 1, _LARGE_STEP))
    sizes.add(max_tokens)
    return sorted(sizes)
