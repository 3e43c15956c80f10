"""Time rank 0's sampler on a full step: `sample_batch` over `[rows, vocab]` logits.

Qwen3's generation_config samples with temperature 0.6, top_k 20 and top_p 0.95, and every
request that omits them gets them, so this is the common sampled step. The logits are seeded
random normals scaled like a real model's (a few dominant tokens over a long tail); the cost of
the truncation does not depend on them beyond that.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

QWEN3_VOCAB = 151_936
QWEN3_DEFAULTS = dict(temperature=0.6, top_k=20, top_p=0.95)


def time_sample_batch(
    rows: int = 256,
    vocab: int = QWEN3_VOCAB,
    *,
    temperature: float = 0.6,
    top_k: int = 20,
    top_p: float = 0.95,
    repeats: int = 5,
    device: str = "cpu",
    seed: int = 0,
) -> dict[str, Any]:
    """Median, minimum and every wall time of `sample_batch` (after one untimed call), and of
    its top-k/top-p step alone, in seconds. On a shared machine the minimum is the least
    disturbed figure."""
    import numpy as np

    from tp_engine.core.sampling import SamplingMetadata, sample_batch
    from tp_engine.core.sampling.filters import apply_top_k_top_p
    from tp_engine.core.sampling.groups import cpu_put, plan_groups

    gen = torch.Generator().manual_seed(seed)
    logits = (4.0 * torch.randn(rows, vocab, generator=gen)).to(device)  # [rows, vocab] fp32
    groups = plan_groups(
        cpu_put(device),
        vocab,
        temperature=np.full(rows, temperature, dtype=np.float32),
        seeds=np.arange(rows, dtype=np.int64) + seed,
        counters=np.zeros(rows, dtype=np.int64),
        top_k=np.full(rows, top_k, dtype=np.int64),
        top_p=np.full(rows, top_p, dtype=np.float32),
    )
    md = SamplingMetadata(num_rows=rows, groups=groups)
    top_k_rows = torch.full((rows,), top_k, dtype=torch.int64, device=device)
    top_p_rows = torch.full((rows,), top_p, device=device)

    def run() -> torch.Tensor:
        out = sample_batch(logits, md).token_ids
        if device != "cpu":
            torch.cuda.synchronize()
        return out

    def truncate() -> torch.Tensor:
        return apply_top_k_top_p(scaled, top_k_rows, top_p_rows, top_k)

    scaled = logits / temperature
    times, truncation_times = [], []
    for fn, out in ((run, times), (truncate, truncation_times)):
        fn()  # first-call costs (allocator, thread pool) out of the figures
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return {
        "rows": rows,
        "vocab": vocab,
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": times,
        # The top-k + top-p step alone (`apply_top_k_top_p` on the scaled logits of every row).
        "truncation_median_s": statistics.median(truncation_times),
        "truncation_min_s": min(truncation_times),
        "truncation_times_s": truncation_times,
    }
