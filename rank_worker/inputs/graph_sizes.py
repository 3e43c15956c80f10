"""The batch sizes a step is padded to when it replays a CUDA graph: one ladder, shared by the
target's graphs (`rank_worker.runner.cuda_graphs`) and the EAGLE-3 draft chain's, so both pad a batch
to the same size."""

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
