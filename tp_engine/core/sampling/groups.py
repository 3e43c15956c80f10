"""A step's rows, grouped so that each group takes its cheapest sampling path.

Decided on the host from the rows' parameters (numpy arrays over the step's B rows), so the
sampler never reads the device to choose. A row goes to the first path that serves it:

    greedy, no temperature row in the step          ARGMAX     argmax, one read
    greedy, temperature or min-p (no top-k/top-p)   ONE_PASS   kernels.gumbel_sample, one read
    a top-k bound below V (any top-p, min-p)        TOP_K      the top-(max_k + 1) slice
    top-p without a top-k bound                     FULL_SORT  a sort of the row, then one pass

Greedy rows join the ONE_PASS group when there is one (the kernel takes the argmax of a row
whose inverse temperature is 0 in the same launch) rather than being read by a separate
argmax. Each path is split again by source: rows that a logits processor changes are read from
the float32 copy of those rows alone (`SamplingMetadata.edited_rows`), the others from the raw
logits.

top-p without top-k keeps the exact full sort: a candidate slice would need the row's total
mass to know whether the nucleus fits in it, and a fallback decided on the device would wait
for the GPU on the host. Qwen3's defaults (and most clients') set a top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tp_engine.core.sampling.tensors import SampleGroup, SamplePath
from tp_engine.sampling_params import GREEDY_EPSILON

_SEED_MASK = (1 << 64) - 1


def seed_bits(seed: int) -> int:
    """Any integer seed as the int64 with its low 64 bits (what `seeds` arrays hold)."""
    seed &= _SEED_MASK
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def plan_groups(
    put: Callable[[np.ndarray], torch.Tensor],
    vocab_size: int,
    temperature: np.ndarray,
    seeds: np.ndarray,
    counters: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
    edited_index: np.ndarray | None = None,
) -> tuple[SampleGroup, ...]:
    """The groups of a step of B rows. Arrays are [B]: `temperature` (<= GREEDY_EPSILON:
    greedy), `seeds` and `counters` int64, `top_k` (>= V or <= 0: off), `top_p` (1: off),
    `min_p` (0: off), `edited_index` (the row's index in the edited copy, -1 if not edited).
    `put` makes a device tensor of a host array."""
    num_rows = temperature.shape[0]
    greedy = temperature <= GREEDY_EPSILON
    top_k = np.full(num_rows, vocab_size) if top_k is None else top_k
    top_k = np.where((top_k <= 0) | (top_k > vocab_size), vocab_size, top_k).astype(np.int64)
    top_p = np.ones(num_rows, np.float32) if top_p is None else top_p.astype(np.float32)
    min_p = np.zeros(num_rows, np.float32) if min_p is None else min_p.astype(np.float32)
    # Greedy rows ignore every truncation (none can move the argmax).
    top_k[greedy], top_p[greedy], min_p[greedy] = vocab_size, 1.0, 0.0
    path = np.where(
        greedy,
        0,
        np.where(top_k < vocab_size, 2, np.where(top_p < 1.0, 3, 1)),
    )
    if (path == 1).any():
        path[greedy] = 1
    edited_index = np.full(num_rows, -1) if edited_index is None else edited_index
    num_edited = int((edited_index >= 0).sum())
    with np.errstate(divide="ignore"):
        inv_temp = np.where(greedy, 0.0, 1.0 / np.maximum(temperature, GREEDY_EPSILON))
        log_min_p = np.where(min_p > 0.0, np.log(np.maximum(min_p, 1e-45)), -np.inf)
    inv_temp = inv_temp.astype(np.float32)
    log_min_p = log_min_p.astype(np.float32)

    groups = []
    paths = [SamplePath.ARGMAX, SamplePath.ONE_PASS, SamplePath.TOP_K, SamplePath.FULL_SORT]
    for code, kind in enumerate(paths):
        for edited in (False, True):
            rows = np.flatnonzero((path == code) & ((edited_index >= 0) == edited))
            if rows.size == 0:
                continue
            src = edited_index[rows] if edited else rows
            source_size = num_edited if edited else num_rows
            whole = rows.size == source_size and bool((src == np.arange(source_size)).all())
            extra: dict = {}
            if kind in (SamplePath.TOP_K, SamplePath.FULL_SORT):
                extra = dict(top_k=put(top_k[rows]), top_p=put(top_p[rows]))
                extra["max_top_k"] = int(top_k[rows].max())
                extra["any_top_p"] = bool((top_p[rows] < 1.0).any())
            groups.append(
                SampleGroup(
                    path=kind,
                    edited=edited,
                    out_rows=put(rows.astype(np.int64)),
                    src_rows=put(src.astype(np.int64)),
                    whole=whole,
                    inv_temp=put(inv_temp[rows]),
                    log_min_p=put(log_min_p[rows]),
                    seeds=put(seeds[rows].astype(np.int64)),
                    counters=put(counters[rows].astype(np.int64)),
                    any_min_p=bool((min_p[rows] > 0.0).any()),
                    **extra,
                )
            )
    return tuple(groups)


def cpu_put(device: torch.device | str = "cpu") -> Callable[[np.ndarray], torch.Tensor]:
    """A `put` for tests and benchmarks: a plain copy to `device`."""
    return lambda a: torch.as_tensor(np.ascontiguousarray(a)).to(device)
