"""The store_kv kernel against its reference: slots written exactly, everything else untouched.

A store is a copy, so the comparison is exact (atol = rtol = 0) in every dtype.
"""

from __future__ import annotations

import pytest
import torch

from kernels.store_kv import store_kv, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (dtype, num_kv_heads, head_dim, block_size, slot dtype)
CPU_CASES = [
    (torch.float32, 2, 64, 16, torch.int64),
    (torch.float16, 1, 128, 32, torch.int32),
    (torch.bfloat16, 8, 128, 256, torch.int64),
    (torch.float32, 4, 64, 64, torch.int32),
]
GPU_CASES = [
    (dtype, heads, head_dim, block_size, slot_dtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for heads in (1, 2, 8)
    for head_dim in (64, 128)
    for block_size in (16, 128, 256)
    for slot_dtype in (torch.int32, torch.int64)
]
CASES = [*CPU_CASES, *(pytest.param(*c, marks=pytest.mark.gpu) for c in GPU_CASES)]


def _id(value: object) -> str:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else str(value)


def _caches(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype, gen):
    shape = (num_blocks, block_size, heads, head_dim)
    k = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)
    return k, v


@pytest.mark.parametrize(("dtype", "heads", "head_dim", "block_size", "slot_dtype"), CASES, ids=_id)
def test_store_kv_matches_ref(dtype, heads, head_dim, block_size, slot_dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 6, 23
    k_cache, v_cache = _caches(num_blocks, block_size, heads, head_dim, dtype, gen)
    # Distinct slots in shuffled order, two of them at a block's first and last offset, and
    # padding rows (-1) scattered through the batch, as a CUDA-graph batch pads.
    edges = torch.tensor([3 * block_size, 4 * block_size - 1])
    others = torch.randperm(num_blocks * block_size, generator=gen)
    others = others[(others != edges[0]) & (others != edges[1])]
    padding = torch.full((3,), -1)
    slots = torch.cat((edges, others[: num_tokens - 5], padding))
    slots = slots[torch.randperm(num_tokens, generator=gen)]
    key = torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    value = torch.randn(num_tokens, heads, head_dim, generator=gen).to(DEVICE, dtype)
    slot_mapping = slots.to(device=DEVICE, dtype=slot_dtype)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(key, value, k_ref, v_ref, slot_mapping)
    store_kv(key, value, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    # The reference itself wrote the real rows (so equality above is not vacuous).
    flat = k_ref.view(-1, heads, head_dim)
    keep = slots >= 0
    torch.testing.assert_close(flat[slots[keep].to(DEVICE)], key[keep.to(DEVICE)], atol=0, rtol=0)


def test_store_kv_strided_views_of_a_fused_qkv():
    """K and V as slices of one [T, (Hq + 2 Hkv) * D] projection output, never copied."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, num_tokens = 4, 2, 64, 5
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
    assert not key.is_contiguous()
    k_cache, v_cache = _caches(3, 16, kv_heads, head_dim, torch.float32, gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([17, -1, 0, 47, 30], dtype=torch.int64, device=DEVICE)
    store_kv(key, value, k_cache, v_cache, slots)
    store_kv_ref(key, value, k_ref, v_ref, slots)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)


def test_store_kv_all_padding_and_empty_batches_write_nothing():
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, gen)
    before = k_cache.clone()
    key = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    store_kv(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int32, device=DEVICE))
    store_kv(key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before)


def test_store_kv_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32, gen)
    key = torch.randn(3, 2, 64, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    with pytest.raises(ValueError, match="cache is"):
        store_kv(key.half(), key.half(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="must be"):
        store_kv(key[:, :1], key[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="int32 or int64"):
        store_kv(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="heads must be dense"):
        wide = torch.randn(3, 2, 128, device=DEVICE)[:, :, :64]
        store_kv(wide, wide, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(key, key, k_cache.transpose(1, 2), v_cache.transpose(1, 2), slots)
