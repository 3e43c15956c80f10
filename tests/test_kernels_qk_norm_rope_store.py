"""`qk_norm_rope_store_kv` (q/k RMSNorm + rotary + the K/V store, one launch) against its
plain-torch reference and against the two kernels it replaces.

Tolerances: against the reference, those of `tests/test_kernels_elementwise.py` (the qkv row
rounds where transformers rounds; a rare ulp apart). Against `qk_norm_rope` then `store_kv`
the comparison is exact (atol = rtol = 0): the same arithmetic, then a copy (or, for an fp8
cache, the same IEEE division and e4m3 rounding).
"""

from __future__ import annotations

import pytest
import torch

from kernels._common import FP8_KV_DTYPE
from kernels.qk_norm_rope import (
    qk_norm_rope,
    qk_norm_rope_store_kv,
    qk_norm_rope_store_kv_ref,
)
from kernels.store_kv import store_kv
from tests.test_kernels_elementwise import DEVICE, TOL, cos_sin_cache, randn

# (tokens, heads, kv_heads, head_dim, block_size): one token, GQA 4:1 at Qwen3's 128, MHA with
# tiny heads, a head_dim whose half is not a power of two (masked lanes), more heads than one
# program's 16 (q, k and v heads in one program and across programs).
CPU = [
    (1, 2, 1, 64, 16),
    (7, 8, 2, 128, 16),
    (5, 4, 4, 16, 32),
    (3, 6, 2, 80, 16),
    (4, 16, 8, 32, 16),
]
GPU = [(1, 16, 8, 128, 16), (300, 32, 8, 128, 16), (77, 64, 8, 128, 256), (33, 40, 8, 128, 32)]
CASES = [*CPU, *(pytest.param(*c, marks=pytest.mark.gpu) for c in GPU)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(tokens: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
    """A strided qkv (rows wider than q|k|v), positions, weights, the rope table, caches full
    of noise and a slot mapping with padding rows (-1) scattered in, as a CUDA-graph batch."""
    gen = torch.Generator().manual_seed(tokens * 131 + heads)
    table = cos_sin_cache(512, head_dim)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(DEVICE)
    q_w = randn(head_dim, dtype=dtype, seed=41, scale=0.1) + 1.0
    k_w = randn(head_dim, dtype=dtype, seed=42, scale=0.1) + 1.0
    row = (heads + 2 * kv_heads) * head_dim
    wide = randn(tokens, row + 48, dtype=dtype, seed=43, scale=3.0)
    num_blocks = 2 + tokens // block_size + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = randn(*shape, dtype=dtype, seed=44)
    v_cache = randn(*shape, dtype=dtype, seed=45)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    if tokens > 2:
        slots[1] = -1
        slots[-1] = -1
    return wide, row, positions, q_w, k_w, table, k_cache, v_cache, slots.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "block_size"), CASES)
def test_fused_store_matches_reference_and_the_two_kernels(
    dtype, tokens, heads, kv_heads, head_dim, block_size
):
    wide, row, pos, q_w, k_w, table, k_cache, v_cache, slots = _inputs(
        tokens, heads, kv_heads, head_dim, block_size, dtype
    )
    args = (heads, kv_heads, head_dim, 1e-6)
    qkv = wide[:, :row]
    before = wide.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref = qk_norm_rope_store_kv_ref(qkv, pos, q_w, k_w, table, k_ref, v_ref, slots, *args)
    # The two kernels the fused one replaces, on copies.
    two = before[:, :row].clone()
    k_two, v_two = k_cache.clone(), v_cache.clone()
    qk_norm_rope(two, pos, q_w, k_w, table, *args)
    k_start, v_start = heads * head_dim, (heads + kv_heads) * head_dim
    store_kv(
        two[:, k_start:v_start].view(tokens, kv_heads, head_dim),
        two[:, v_start:].view(tokens, kv_heads, head_dim),
        k_two, v_two, slots,
    )  # fmt: skip

    out = qk_norm_rope_store_kv(qkv, pos, q_w, k_w, table, k_cache, v_cache, slots, *args)

    assert out is qkv
    torch.testing.assert_close(qkv.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(k_cache.float(), k_ref.float(), **TOL[dtype])
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)  # V is a copy
    torch.testing.assert_close(qkv, two, atol=0, rtol=0)
    torch.testing.assert_close(k_cache, k_two, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, v_two, atol=0, rtol=0)
    assert torch.equal(wide[:, v_start:], before[:, v_start:])  # V and the padding untouched
    # The stores happened (the equalities above are not about untouched caches), and padding
    # rows wrote nothing: every slot not in the mapping still holds its noise.
    kept = slots[slots >= 0]
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_k[kept], two[slots >= 0, k_start:v_start].view(-1, kv_heads, head_dim))
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[kept] = False
    # (k_ref began as a copy of the same noise and the reference stored only the kept slots.)
    assert torch.equal(flat_k[untouched], k_ref.view(-1, kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fused_store_into_an_fp8_cache_quantizes_as_store_kv(dtype):
    """K / k_scale and V / v_scale, saturated to ±448 (the small k_scale saturates some)."""
    tokens, heads, kv_heads, head_dim, block_size = 6, 4, 2, 64, 16
    wide, row, pos, q_w, k_w, table, k_cache, v_cache, slots = _inputs(
        tokens, heads, kv_heads, head_dim, block_size, dtype
    )
    k_cache, v_cache = k_cache.to(FP8_KV_DTYPE), v_cache.to(FP8_KV_DTYPE)
    scales = torch.tensor([0.004, 0.5], device=DEVICE)
    args = (heads, kv_heads, head_dim, 1e-6)
    qkv = wide[:, :row]
    two = qkv.clone()
    k_two, v_two = k_cache.clone(), v_cache.clone()
    qk_norm_rope(two, pos, q_w, k_w, table, *args)
    k_start, v_start = heads * head_dim, (heads + kv_heads) * head_dim
    store_kv(
        two[:, k_start:v_start].view(tokens, kv_heads, head_dim),
        two[:, v_start:].view(tokens, kv_heads, head_dim),
        k_two, v_two, slots, scales,
    )  # fmt: skip
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qk_norm_rope_store_kv_ref(qkv, pos, q_w, k_w, table, k_ref, v_ref, slots, *args, scales)

    qk_norm_rope_store_kv(qkv, pos, q_w, k_w, table, k_cache, v_cache, slots, *args, scales)

    bits = torch.uint8
    assert torch.equal(k_cache.view(bits), k_two.view(bits))
    assert torch.equal(v_cache.view(bits), v_two.view(bits))
    assert torch.equal(v_cache.view(bits), v_ref.view(bits))
    # Against the plain-torch reference, keys differ only where the qkv row's last bit did.
    assert (k_cache.view(bits) == k_ref.view(bits)).float().mean() > 0.97
    assert (k_cache.float().abs() == 448).any()  # some keys saturated


def test_fused_store_checks_its_arguments():
    wide, row, pos, q_w, k_w, table, k_cache, v_cache, slots = _inputs(
        3, 2, 1, 16, 16, torch.float32
    )
    qkv = wide[:, :row]
    args = (2, 1, 16, 1e-6)
    with pytest.raises(ValueError, match="qkv must be"):  # the values are missing from the row
        qk_norm_rope_store_kv(qkv[:, :48], pos, q_w, k_w, table, k_cache, v_cache, slots, *args)
    with pytest.raises(ValueError, match="the cache holds"):
        k2 = k_cache.expand(-1, -1, 2, -1).contiguous()
        qk_norm_rope_store_kv(qkv, pos, q_w, k_w, table, k2, k2.clone(), slots, *args)
    with pytest.raises(ValueError, match="slot_mapping"):
        qk_norm_rope_store_kv(qkv, pos, q_w, k_w, table, k_cache, v_cache, slots[:2], *args)
    with pytest.raises(ValueError, match="cache is"):
        half = k_cache.half()
        qk_norm_rope_store_kv(qkv, pos, q_w, k_w, table, half, half.clone(), slots, *args)
    with pytest.raises(ValueError, match="kv_scales"):
        fp8 = k_cache.to(FP8_KV_DTYPE)
        qk_norm_rope_store_kv(qkv, pos, q_w, k_w, table, fp8, fp8.clone(), slots, *args)


# -- which layers use it -------------------------------------------------------------------------


def test_the_layer_fuses_the_store_only_where_the_backend_stores_with_store_kv():
    """triton and flash_attn store with `kernels.store_kv` and attend after it: the layer's
    kernel takes the store over. The torch backend stores by indexing, and a backend that wraps
    `forward` may do more around the store: they keep their own."""
    from rank_worker.attention.flash_attn_backend import FlashAttnBackend
    from rank_worker.attention.selection import get_backend
    from rank_worker.attention.triton_backend import TritonAttentionBackend
    from rank_worker.models.qwen3_attention import _stores_with_the_kernel

    class Wrapping(TritonAttentionBackend):
        def forward(self, *args, **kwargs):  # e.g. records what it stores
            return super().forward(*args, **kwargs)

    assert _stores_with_the_kernel(get_backend("triton"))
    # Not instantiated: flash-attn may not be installed here; the rule reads the class.
    assert _stores_with_the_kernel(FlashAttnBackend.__new__(FlashAttnBackend))
    assert not _stores_with_the_kernel(get_backend("torch"))
    assert not _stores_with_the_kernel(Wrapping())
