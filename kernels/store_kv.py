"""Write a step's new K/V rows into their slots of the paged cache.

Slot `s` is `block_id * block_size + offset`, i.e. row `s` of the cache viewed as
`[num_blocks * block_size, num_kv_heads, head_dim]`. A negative slot means "not a real token"
(padding rows of a CUDA-graph batch) and its row is skipped, so a padded batch never scribbles
over a block some sequence owns. Slots are not range-checked on the device (that would need a
sync); the block manager hands out only slots of allocated blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    LaunchMemo,
    check_device,
    check_index,
    check_kv_cache,
    check_kv_scales,
    check_last_dim_contiguous,
    interpreting,
    layout,
    next_pow2,
    quantized,
)
from kernels._fp8_cast import to_e4m3


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim] new keys; token stride stride_kt, heads dense
    value_ptr,  # [T, num_kv_heads, head_dim] new values; token stride stride_vt, heads dense
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
    v_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_dim] contiguous
    slot_mapping_ptr,  # [T] int32/int64 flat slot per token, negative = skip
    kv_scale_ptr,  # [2] fp32 (k_scale, v_scale) of an fp8 cache (KV_FP8; else unused)
    stride_kt,
    stride_vt,
    ROW: tl.constexpr,  # num_kv_heads * head_dim: elements of one token's K (or V)
    BLOCK: tl.constexpr,  # elements copied per program, a power of two
    KV_FP8: tl.constexpr,  # the caches are float8_e4m3fn: store K / k_scale, saturated
    FP8_MAX: tl.constexpr,
    INTERPRETED: tl.constexpr,  # see kernels._fp8_cast
):
    # Grid: (T, cdiv(ROW, BLOCK)); one program copies one chunk of one token's K and V rows.
    # int64 so that token * stride stays exact for any step size.
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(key_ptr + token * stride_kt + offs, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs, mask=mask)
    if KV_FP8:
        # Through fp32: e4m3 has no infinity, and an out-of-range value would become NaN.
        k = tl.clamp(k.to(tl.float32) / tl.load(kv_scale_ptr), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / tl.load(kv_scale_ptr + 1), -FP8_MAX, FP8_MAX)
        k = to_e4m3(k, k_cache_ptr.dtype.element_ty, INTERPRETED)
        v = to_e4m3(v, v_cache_ptr.dtype.element_ty, INTERPRETED)
    # int64: slot * ROW passes 2**31 once a layer's cache holds more than 2**31 elements.
    tl.store(k_cache_ptr + slot * ROW + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Copy `key`/`value` `[T, num_kv_heads, head_dim]` into `k_cache`/`v_cache` (in place).

    Caches are `[num_blocks, block_size, num_kv_heads, head_dim]`, contiguous, of the same dtype
    as key/value (no silent cast). `slot_mapping [T]` is int32 or int64; rows with a negative
    slot are skipped. key/value may be strided views (e.g. slices of a fused QKV output) as long
    as each token's heads are dense. An fp8 cache (float8_e4m3fn) takes key/value of any float
    dtype and stores `key / k_scale` (and `value / v_scale`) saturated to ±448, with
    `kv_scales [2]` fp32 `(k_scale, v_scale)`. Checked once per layout of the arguments
    (`kernels._common.LaunchMemo`).
    """
    key_ = (
        layout(key), layout(value), layout(k_cache), layout(v_cache), layout(slot_mapping),
        None if kv_scales is None else layout(kv_scales),
    )  # fmt: skip
    decided = _DECIDED.get(key_) or _DECIDED.put(
        key_, _decide(key, value, k_cache, v_cache, slot_mapping, kv_scales)
    )
    grid, fp8, meta = decided
    if grid is None:
        return
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping, kv_scales if fp8 else k_cache,
        key.stride(0), value.stride(0), **meta,
    )  # fmt: skip


# One layout's launch, checked (`kernels._common.LaunchMemo`): the grid (None: no tokens),
# whether the cache is fp8 (else the kernel gets the cache as a stand-in scales pointer), and
# the constexprs.
_Decided = tuple[tuple[int, int] | None, bool, dict[str, object]]
_DECIDED: LaunchMemo[_Decided] = LaunchMemo()


def _decide(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None,
) -> _Decided:
    """Every check of `store_kv`'s arguments, and the launch they get."""
    check_device(_store_kv_kernel, key, value, k_cache, v_cache, slot_mapping)
    check_kv_cache(k_cache, v_cache)
    check_index("slot_mapping", slot_mapping, 1)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    num_tokens = slot_mapping.shape[0]
    for name, t in (("key", key), ("value", value)):
        if t.shape != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must be [{num_tokens}, {num_kv_heads}, {head_dim}] to match "
                f"slot_mapping and the cache, got {tuple(t.shape)}"
            )
        check_kv_scales(k_cache, t.dtype, kv_scales)
        check_last_dim_contiguous(name, t)
        if t.stride(1) != head_dim:
            raise ValueError(f"{name}'s heads must be dense (stride {head_dim}), got {t.stride()}")
    row = num_kv_heads * head_dim
    block = min(next_pow2(row), 4096)
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    meta = dict(
        ROW=row,
        BLOCK=block,
        KV_FP8=fp8,
        FP8_MAX=FP8_KV_MAX,
        INTERPRETED=interpreting(_store_kv_kernel),
        num_warps=4,
    )
    return ((num_tokens, triton.cdiv(row, block)) if num_tokens else None), fp8, meta


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Plain-torch `store_kv`: same arguments, same in-place effect. The one K/V store in plain
    torch: the fused q/k norm + rotary + store's reference and the torch attention backend (the
    CPU path, `rank_worker.attention.torch_backend`) store through it too."""
    slots = slot_mapping.long()  # [T]
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = quantized(key, kv_scales, 0, k_cache.dtype)  # [T', num_kv_heads, head_dim]
    v = quantized(value, kv_scales, 1, v_cache.dtype)
    if k_cache.dtype == FP8_KV_DTYPE:
        # CPU torch has no index_copy_ for fp8: copy the bytes.
        k_cache, v_cache, k, v = (t.view(torch.uint8) for t in (k_cache, v_cache, k, v))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
