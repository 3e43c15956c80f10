"""KV cache layout and sizing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rank_worker.kv_cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    allocate_kv_cache,
    cpu_num_blocks,
    gpu_kv_budget_bytes,
)
from rank_worker.tp import TPInfo

HF = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=16, hidden_size=64,
                     num_attention_heads=4)  # fmt: skip


def test_spec_counts_local_kv_heads() -> None:
    assert KVCacheSpec.for_model(HF, TPInfo(0, 1), 16, torch.float32).num_kv_heads == 2
    assert KVCacheSpec.for_model(HF, TPInfo(1, 2), 16, torch.float32).num_kv_heads == 1
    # More ranks than KV heads: each rank caches one replicated head.
    spec = KVCacheSpec.for_model(HF, TPInfo(3, 4), 16, torch.bfloat16)
    assert spec.num_kv_heads == 1
    assert spec.bytes_per_block == 2 * 3 * 16 * 1 * 16 * 2  # K and V, layers, tokens, heads, dim


def test_layout_is_per_layer_contiguous() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    caches = allocate_kv_cache(spec, 5, "cpu")
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 2, 8)
        assert k.is_contiguous() and v.is_contiguous() and k.dtype == torch.float16
        assert not k.any()
    caches[0][1].fill_(1.0)  # layers and K/V do not alias
    assert not caches[0][0].any() and not caches[1][1].any()


def test_cpu_sizing() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32)
    assert cpu_num_blocks(spec, 7, None) == 7
    assert cpu_num_blocks(spec, None, 10 * spec.bytes_per_block + 1) == 10
    assert cpu_num_blocks(spec, None, None) == DEFAULT_CPU_KV_CACHE_BYTES // spec.bytes_per_block
    with pytest.raises(ValueError, match="hold no block"):
        cpu_num_blocks(spec, None, spec.bytes_per_block - 1)


def test_gpu_budget() -> None:
    assert gpu_kv_budget_bytes(100_000, 0.9, 30_000) == 60_000
    assert gpu_kv_budget_bytes(100_000, 0.5, 60_000) < 0
