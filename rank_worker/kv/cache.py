"""The paged KV cache of one rank: its layout, its size in bytes, and how many blocks fit.

Layout, per layer, K and V alike:

    [num_blocks, block_size, num_local_kv_heads, head_dim]

token i of a sequence lives at `cache[block_table[i // block_size], i % block_size]`. The heads
of one token are contiguous and the head_dim is innermost, which is the paged layout flash-attn's
`flash_attn_with_kvcache` and the project's Triton kernels read. All layers live in one
allocation `[num_layers, 2, num_blocks, ...]`; each layer gets contiguous K and V views of it.

Sizing. Rank 0's block manager needs one block count that holds on every rank, so each rank
computes what fits and the minimum over ranks wins (`all_reduce_min_int` over the world, in the
model runner; under pipeline parallelism a rank's cache holds its stage's layers only, so its
blocks are smaller and the stages' budgets differ before the minimum):
- a fixed `RunnerConfig.num_kv_blocks` wins everywhere (tests that force preemption use it);
- on CPU, `kv_cache_memory_bytes` (default 1 GiB) divided by the bytes per block;
- on GPU, measured: `total * gpu_memory_utilization - the engine's own peak in a warm-up
  forward at the largest batch - memory outside torch`, divided by the bytes per block
  (`gpu_kv_budget_bytes`: the engine's own use only, so a second engine in a process sizes
  itself as the first did once the first has released its memory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rank_worker.kv.device_memory import DeviceMemory, MemoryReading
from rank_worker.models.layers.linear import local_kv_heads
from rank_worker.models.qwen3_attention import KVCachePair, head_dim_of
from rank_worker.tp import TPInfo

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one rank's cache, without the block count."""

    num_layers: int
    num_kv_heads: int  # local to this rank (after splitting or replicating)
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of `block_size` tokens over all layers, on this rank."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def for_model(
        cls,
        hf_config: Any,
        tp: TPInfo,
        block_size: int,
        dtype: torch.dtype,
        num_layers: int | None = None,
    ) -> KVCacheSpec:
        """`num_layers`: the layers this rank holds (its pipeline stage's); None: all."""
        return cls(
            num_layers=hf_config.num_hidden_layers if num_layers is None else num_layers,
            num_kv_heads=local_kv_heads(hf_config.num_key_value_heads, tp),
            head_dim=head_dim_of(hf_config),
            block_size=block_size,
            dtype=dtype,
        )


@dataclass(frozen=True)
class CacheGroup:
    """Caches that share block ids (a target model's and its draft model's): one block of the
    pool costs a block of each."""

    specs: tuple[KVCacheSpec, ...]

    @property
    def bytes_per_block(self) -> int:
        return sum(spec.bytes_per_block for spec in self.specs)


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device | str
) -> list[KVCachePair]:
    """One `(k_cache, v_cache)` pair per layer, each `[num_blocks, block_size, kv_heads, head_dim]`.

    Zero-filled: attention may read padding slots that it then masks, and masked garbage that
    happens to be NaN or inf would still poison `probs @ V` (0 * NaN = NaN).
    """
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    storage = torch.zeros(
        (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
        dtype=spec.dtype,
        device=device,
    )
    return [(storage[layer, 0], storage[layer, 1]) for layer in range(spec.num_layers)]


def blocks_from_bytes(spec: KVCacheSpec | CacheGroup, budget_bytes: int, where: str) -> int:
    """How many blocks `budget_bytes` holds; a clear error when not even one does."""
    n = budget_bytes // spec.bytes_per_block
    if n < 1:
        raise ValueError(
            f"{where}: {budget_bytes} bytes for the KV cache hold no block of "
            f"{spec.bytes_per_block} bytes; give more memory or a smaller block_size"
        )
    return int(n)


def cpu_num_blocks(
    spec: KVCacheSpec | CacheGroup, num_kv_blocks: int | None, kv_cache_memory_bytes: int | None
) -> int:
    """Blocks for a CPU rank: `num_kv_blocks`, else `kv_cache_memory_bytes` (default 1 GiB)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    budget = kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    return blocks_from_bytes(spec, budget, "kv_cache_memory_bytes")


def gpu_kv_budget_bytes(
    reading: MemoryReading, utilization: float, baseline_allocated: int, scratch_bytes: int
) -> int:
    """Bytes for the KV cache, from a reading taken after the warm-up.

    The engine may use `utilization` of the device. Its own use is its peak over the warm-up
    (weights, activations, the sampler's workspace) minus what this process's tensors held
    before the engine started (`baseline_allocated`: a previous engine not shut down, the
    user's tensors) and minus the scratch cache (the real cache takes its place); memory outside
    torch (CUDA context, NCCL, other processes) counts as used. What the baseline tensors
    occupy is not the engine's, but it is not free either: the budget never exceeds what the
    device could still hand out (free, plus what torch caches unused).
    """
    own_peak = reading.peak_allocated - baseline_allocated - scratch_bytes
    budget = int(reading.total * utilization) - own_peak - reading.outside_torch
    available = reading.free + reading.reserved - reading.allocated
    return min(budget, available)


def measure_gpu_num_blocks(
    spec: KVCacheSpec | CacheGroup,
    warmup: Callable[[], int],
    utilization: float,
    memory: DeviceMemory,
    baseline_allocated: int,
    graph_reserve: Callable[[], int] | None = None,
) -> int:
    """Run `warmup` (a forward at the largest batch) and size the cache from what is left.

    `warmup` returns the bytes of scratch KV cache it allocated (and freed). The arithmetic is
    `gpu_kv_budget_bytes`; `memory` is the device's (`CudaMemory`) or a test's stand-in.
    `graph_reserve`, called after the reading: the bytes the CUDA graphs' memory pool will hold
    beside the warm-up's peak (a pool of its own, `rank_worker.runner.graph_setup`), taken off
    the budget; None where no graph is captured.
    """
    memory.reset_peak()
    scratch_bytes = warmup()
    reading = memory.read()
    budget = gpu_kv_budget_bytes(reading, utilization, baseline_allocated, scratch_bytes)
    reserved = graph_reserve() if graph_reserve is not None else 0
    budget -= reserved
    where = (
        f"gpu_memory_utilization={utilization} of {reading.total} bytes, with "
        f"{reading.peak_allocated - baseline_allocated - scratch_bytes} bytes of weights and "
        f"activations at the peak, {reading.outside_torch} bytes outside torch, "
        f"{reading.free} bytes free and {reserved} bytes for the CUDA graphs"
    )
    if baseline_allocated:
        where += (
            f" ({baseline_allocated} bytes of tensors were alive in this process before the "
            "engine started: a previous LLM that was not shut down?)"
        )
    return blocks_from_bytes(spec, budget, where)
