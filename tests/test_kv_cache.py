"""KV cache layout and sizing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rank_worker.kv.cache import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    KVCacheSpec,
    allocate_kv_cache,
    cpu_num_blocks,
    gpu_kv_budget_bytes,
    measure_gpu_num_blocks,
)
from rank_worker.kv.device_memory import MemoryReading
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


def reading(**fields: int) -> MemoryReading:
    return MemoryReading(**{"reserved": fields.get("allocated", 0), **fields})


def test_gpu_budget() -> None:
    # 100k device, 10k outside torch, 30k of weights and activations at the peak.
    r = reading(total=100_000, free=60_000, allocated=0, reserved=30_000, peak_allocated=30_000)
    assert r.outside_torch == 10_000
    assert gpu_kv_budget_bytes(r, 0.9, baseline_allocated=0, scratch_bytes=0) == 50_000
    # A scratch cache of 5k inside that peak is not the engine's use: the real cache replaces it.
    assert gpu_kv_budget_bytes(r, 0.9, baseline_allocated=0, scratch_bytes=5_000) == 55_000
    # Never more than the device can still hand out.
    assert gpu_kv_budget_bytes(r, 1.0, baseline_allocated=0, scratch_bytes=0) == 60_000
    r = reading(total=100_000, free=20_000, allocated=0, reserved=70_000, peak_allocated=70_000)
    assert gpu_kv_budget_bytes(r, 0.5, baseline_allocated=0, scratch_bytes=0) < 0


# The first native run (H100, 85,017,493,504 bytes): a second LLM in the process counted the
# first one's 76.5 GB as its own peak and found "-256775783 bytes for the KV cache".
H100 = 85_017_493_504
WEIGHTS = 1_500_000_000  # this engine's weights and warm-up activations at the peak
CONTEXT = 500_000_000  # CUDA context and workspaces, outside torch


class ScriptedMemory:
    """A device whose readings the test writes: `allocated` before the engine (baseline), and
    the engine's peak during the warm-up on top of it."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.calls: list[str] = []

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def read(self) -> MemoryReading:
        self.calls.append("read")
        allocated = self.baseline + WEIGHTS
        return MemoryReading(
            total=H100,
            free=H100 - CONTEXT - allocated,
            reserved=allocated,
            allocated=allocated,
            peak_allocated=allocated,
        )


SPEC = KVCacheSpec(num_layers=28, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)


def test_a_second_engine_measures_its_own_use_only() -> None:
    first = measure_gpu_num_blocks(SPEC, lambda: 0, 0.9, ScriptedMemory(0), 0)
    want = (int(H100 * 0.9) - WEIGHTS - CONTEXT) // SPEC.bytes_per_block
    assert first == want
    # Once the first has released its memory, the second starts from the same baseline and
    # gets the same cache (the old arithmetic charged it with whatever the process held).
    assert measure_gpu_num_blocks(SPEC, lambda: 0, 0.9, ScriptedMemory(0), 0) == first
    # A previous engine still alive (76.5 GB): its tensors are not this engine's use, but
    # they are not free either; the cache gets what is left, and not one block too many.
    alive = int(H100 * 0.9)
    left = H100 - CONTEXT - alive - WEIGHTS
    second = measure_gpu_num_blocks(SPEC, lambda: 0, 0.9, ScriptedMemory(alive), alive)
    assert second == left // SPEC.bytes_per_block > 0
    # And when nothing is left, the error says why.
    with pytest.raises(ValueError, match="tensors were alive in this process before the engine"):
        full = H100 - CONTEXT - WEIGHTS  # the device holds nothing more
        measure_gpu_num_blocks(SPEC, lambda: 0, 0.9, ScriptedMemory(full), full)


def test_the_measurement_reads_after_the_warmup() -> None:
    memory = ScriptedMemory(0)

    def warmup() -> int:
        memory.calls.append("warmup")
        return 3 * SPEC.bytes_per_block  # scratch blocks inside the peak

    blocks = measure_gpu_num_blocks(SPEC, warmup, 0.9, memory, 0)
    assert memory.calls == ["reset_peak", "warmup", "read"]
    assert blocks == (int(H100 * 0.9) - WEIGHTS - CONTEXT) // SPEC.bytes_per_block + 3
