"""Qwen3's per-head q/k RMSNorm followed by rotary embedding, in place on the fused QKV output.

Qwen3 normalises every query and key head on its own (`q_norm`, `k_norm`, weights `[head_dim]`)
and then rotates it by its token's position (neox layout, see `kernels.rotary`). Done as
separate ops that is two norms (about 8 eager ops each) and a rotary (about 10), each pass
reading and writing q and k again; this kernel reads each q/k element once and writes it once,
straight into the `[T, (H + 2 KV) * head_dim]` projection output, which attention then reads
through views (no copy of q or k is ever made). V is not touched.

In the QKV row the H query heads and the KV key heads are adjacent, so the kernel sees them as
one run of `H + KV` heads of `head_dim` elements: head h < H takes the q weight, the others the k
weight. Grid `(T, cdiv(H + KV, BLOCK_H))`: a program normalises and rotates BLOCK_H heads of one
token, each head as its two halves `[x1 | x2]`, which are exactly the pairs the rotation mixes.

Rounding is that of the two kernels it replaces, `kernels.rmsnorm` then `kernels.rotary`:
statistics in fp32, the normed value rounded to the input dtype, times the weight, rounded
again (transformers' Qwen3RMSNorm), then rotated in fp32 and rounded once. Only the row sum's
order differs from `rms_norm` (two half sums), a last-bit difference of the fp32 statistics.

`qk_norm_rope_store_kv` also does the step's K/V store (`kernels.store_kv`) in the same launch,
one kernel fewer per layer: the grid then covers the V heads too (`NUM_ALL = H + 2 KV`), the
rotated keys go to the qkv row AND to their cache slot, the values are copied to theirs as they
are (an fp8 cache gets `x / scale` saturated to ±448, as `store_kv` stores it). A negative slot
(a CUDA-graph batch's padding row) stores nothing, its q and k are still rotated in place.
What the cache holds is bit for bit what `qk_norm_rope` then `store_kv` would leave there.
"""

from __future__ import annotations

from typing import cast

import torch
import triton
import triton.language as tl

from kernels._common import (
    FP8_KV_DTYPE,
    FP8_KV_MAX,
    LaunchMemo,
    check_device,
    check_float,
    check_index,
    check_kv_cache,
    check_kv_scales,
    check_last_dim_contiguous,
    interpreting,
    layout,
    next_pow2,
)
from kernels._fp8_cast import to_e4m3
from kernels.rmsnorm import rms_norm_ref
from kernels.rotary import rotary_embedding_ref
from kernels.store_kv import store_kv_ref


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr,  # [T, row] q heads | k heads | v heads, head_dim each; rows stride_t apart
    positions_ptr,  # [T] int32/int64 absolute position of each token
    q_weight_ptr,  # [head_dim] q_norm weight, qkv's dtype
    k_weight_ptr,  # [head_dim] k_norm weight, qkv's dtype
    cos_sin_ptr,  # [max_position, head_dim] fp32: cos of the head_dim/2 frequencies | sin
    k_cache_ptr,  # [num_slots, KV, head_dim] contiguous (STORE_KV; else a stand-in, unused)
    v_cache_ptr,  # [num_slots, KV, head_dim] contiguous, k_cache's dtype (STORE_KV)
    slot_mapping_ptr,  # [T] int32/int64 flat cache slot per token, negative = skip (STORE_KV)
    kv_scale_ptr,  # [2] fp32 (k_scale, v_scale) of an fp8 cache (KV_FP8; else unused)
    stride_t,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    NUM_HEADS: tl.constexpr,  # q heads + k heads: the heads normalised and rotated
    NUM_ALL: tl.constexpr,  # heads the grid covers: NUM_HEADS, or + the V heads (STORE_KV)
    BLOCK_H: tl.constexpr,  # heads per program, a power of two
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,  # HALF rounded up to a power of two
    STORE_KV: tl.constexpr,  # also write K (rotated) and V into their cache slots
    KV_FP8: tl.constexpr,  # the caches are float8_e4m3fn: store x / scale, saturated
    FP8_MAX: tl.constexpr,
    INTERPRETED: tl.constexpr,  # see kernels._fp8_cast
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    mask = (h < NUM_ALL)[:, None] & i_ok[None, :]
    p1 = qkv_ptr + token * stride_t + h[:, None] * (2 * HALF) + i[None, :]  # first halves
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)

    is_q = (h < NUM_Q_HEADS)[:, None]
    w1 = tl.where(
        is_q,
        tl.load(q_weight_ptr + i, mask=i_ok, other=0.0).to(tl.float32)[None, :],
        tl.load(k_weight_ptr + i, mask=i_ok, other=0.0).to(tl.float32)[None, :],
    )
    w2 = tl.where(
        is_q,
        tl.load(q_weight_ptr + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :],
        tl.load(k_weight_ptr + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :],
    )
    ty = qkv_ptr.dtype.element_ty
    # Round where transformers does: the normed value, then its product with the weight.
    n1 = ((x1 * inv_rms[:, None]).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
    n2 = ((x2 * inv_rms[:, None]).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)

    pos = tl.load(positions_ptr + token).to(tl.int64)
    table = cos_sin_ptr + pos * (2 * HALF)
    cos = tl.load(table + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table + HALF + i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    o1 = (n1 * cos - n2 * sin).to(ty)
    o2 = (n2 * cos + n1 * sin).to(ty)
    # V heads (STORE_KV) are read for the cache only: the qkv row keeps them as they are.
    is_qk = (h < NUM_HEADS)[:, None]
    tl.store(p1, o1, mask=mask & is_qk)
    tl.store(p1 + HALF, o2, mask=mask & is_qk)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        is_k = is_qk & (h >= NUM_Q_HEADS)[:, None]
        is_v = (h >= NUM_HEADS)[:, None]
        # What the cache gets: the key as rounded into the qkv row above, the value as loaded
        # (both exact in fp32), so the cache holds what a separate store_kv would copy.
        c1 = tl.where(is_v, x1, o1.to(tl.float32))
        c2 = tl.where(is_v, x2, o2.to(tl.float32))
        # Cache head of each lane; q lanes (never stored) are clamped to 0 to stay in bounds.
        kv_head = tl.maximum(tl.where(h >= NUM_HEADS, h - NUM_HEADS, h - NUM_Q_HEADS), 0)
        # int64: slot * row passes 2**31 once a layer's cache holds more than 2**31 elements.
        c_off = slot * ((NUM_HEADS - NUM_Q_HEADS) * 2 * HALF) + kv_head[:, None] * (2 * HALF)
        c_off = c_off + i[None, :]
        if KV_FP8:
            # Through fp32 with an IEEE division, as the reference divides: e4m3 has no
            # infinity, and an out-of-range value would become NaN.
            scale = tl.where(is_v, tl.load(kv_scale_ptr + 1), tl.load(kv_scale_ptr))
            c1 = tl.clamp(tl.math.div_rn(c1, scale), -FP8_MAX, FP8_MAX)
            c2 = tl.clamp(tl.math.div_rn(c2, scale), -FP8_MAX, FP8_MAX)
            c1 = to_e4m3(c1, k_cache_ptr.dtype.element_ty, INTERPRETED)
            c2 = to_e4m3(c2, k_cache_ptr.dtype.element_ty, INTERPRETED)
        else:
            c1 = c1.to(k_cache_ptr.dtype.element_ty)
            c2 = c2.to(k_cache_ptr.dtype.element_ty)
        if slot >= 0:
            tl.store(k_cache_ptr + c_off, c1, mask=mask & is_k)
            tl.store(k_cache_ptr + c_off + HALF, c2, mask=mask & is_k)
            tl.store(v_cache_ptr + c_off, c1, mask=mask & is_v)
            tl.store(v_cache_ptr + c_off + HALF, c2, mask=mask & is_v)


def launch_meta(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    store_kv: bool = False,
    kv_fp8: bool = False,
    interpreted: bool = False,
) -> dict[str, object]:
    """Constexprs and launch options (shared with the sm_90 compile test)."""
    num_heads = num_q_heads + num_kv_heads
    num_all = num_heads + (num_kv_heads if store_kv else 0)
    half = head_dim // 2
    return dict(
        NUM_Q_HEADS=num_q_heads,
        NUM_HEADS=num_heads,
        NUM_ALL=num_all,
        # 16 heads x 128 dims per program: 2048 elements in two fp32 halves, no spills.
        BLOCK_H=min(16, next_pow2(num_all)),
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        STORE_KV=store_kv,
        KV_FP8=kv_fp8,
        FP8_MAX=FP8_KV_MAX,
        INTERPRETED=interpreted,
        num_warps=4,
    )


# One layout's launch, checked (`kernels._common.LaunchMemo`): the grid (None: no tokens),
# whether the cache is fp8 (else the kernel gets the cache as a stand-in scales pointer), and
# the constexprs.
_Decided = tuple[tuple[int, int] | None, bool, dict[str, object]]
_DECIDED: LaunchMemo[_Decided] = LaunchMemo()
_DECIDED_STORE: LaunchMemo[_Decided] = LaunchMemo()  # `qk_norm_rope_store_kv`'s


def _grid(num_tokens: int, meta: dict[str, object]) -> tuple[int, int] | None:
    if num_tokens == 0:
        return None
    return (num_tokens, triton.cdiv(cast(int, meta["NUM_ALL"]), cast(int, meta["BLOCK_H"])))


def _check(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_row_heads: int,
) -> None:
    """`num_row_heads`: the heads the kernel reads of each qkv row (q + k, or q + k + v)."""
    check_device(_qk_norm_rope_kernel, qkv, positions, q_weight, k_weight, cos_sin_cache)
    check_float("qkv", qkv)
    if qkv.dim() != 2 or qkv.shape[1] < num_row_heads * head_dim:
        raise ValueError(
            f"qkv must be [T, >= {num_row_heads * head_dim}] ({num_row_heads} heads of "
            f"{head_dim}), got {tuple(qkv.shape)}"
        )
    check_last_dim_contiguous("qkv", qkv)
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    check_index("positions", positions, 1)
    if positions.shape[0] != qkv.shape[0]:
        raise ValueError(f"positions {tuple(positions.shape)} do not match qkv {qkv.shape[0]}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.dtype != qkv.dtype or not w.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [{head_dim}] {qkv.dtype} tensor, "
                f"got {tuple(w.shape)} {w.dtype}"
            )
    check_float("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> torch.Tensor:
    """Normalise (RMSNorm per head) and rotate the q and k heads of `qkv` IN PLACE; returns qkv.

    `qkv [T, row]`: each row holds `num_q_heads` query heads then `num_kv_heads` key heads of
    `head_dim` (then anything, e.g. the values, left alone); last dim dense, any row stride.
    `positions [T]` int32/int64 (not range-checked on the device); weights `[head_dim]` of
    qkv's dtype; `cos_sin_cache [max_position, head_dim]` contiguous, cos | sin, read as fp32.
    Checked once per layout of the arguments (`kernels._common.LaunchMemo`).
    """
    key = (
        layout(qkv), layout(positions), layout(q_weight), layout(k_weight),
        layout(cos_sin_cache), num_q_heads, num_kv_heads, head_dim,
    )  # fmt: skip
    decided = _DECIDED.get(key)
    if decided is None:
        _check(
            qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads,
            head_dim, num_q_heads + num_kv_heads,
        )  # fmt: skip
        meta = launch_meta(num_q_heads, num_kv_heads, head_dim)
        decided = _DECIDED.put(key, (_grid(qkv.shape[0], meta), False, meta))
    grid, _, meta = decided
    if grid is not None:
        # The cache pointers are stand-ins the kernel never reads without STORE_KV.
        _qk_norm_rope_kernel[grid](
            qkv, positions, q_weight, k_weight, cos_sin_cache, qkv, qkv, positions,
            cos_sin_cache, qkv.stride(0), eps, **meta,
        )  # fmt: skip
    return qkv


def qk_norm_rope_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`qk_norm_rope` then `store_kv` of the rotated keys and the values, in one launch.

    `qkv [T, row]` must hold the `num_kv_heads` value heads after the keys (the whole QKV
    projection output); its q and k are normalised and rotated IN PLACE (V left as is) and each
    token's K and V go to its slot of `k_cache` / `v_cache` (`[num_blocks, block_size,
    num_kv_heads, head_dim]`, contiguous; `slot_mapping [T]` int32/int64, negative: not stored;
    an fp8 cache takes `kv_scales [2]` fp32, see `kernels.store_kv`). Returns qkv. Checked
    once per layout of the arguments, as `qk_norm_rope`.
    """
    key = (
        layout(qkv), layout(positions), layout(q_weight), layout(k_weight),
        layout(cos_sin_cache), layout(k_cache), layout(v_cache), layout(slot_mapping),
        None if kv_scales is None else layout(kv_scales), num_q_heads, num_kv_heads, head_dim,
    )  # fmt: skip
    decided = _DECIDED_STORE.get(key)
    if decided is None:
        decided = _DECIDED_STORE.put(key, _decide_store(
            qkv, positions, q_weight, k_weight, cos_sin_cache, k_cache, v_cache, slot_mapping,
            num_q_heads, num_kv_heads, head_dim, kv_scales,
        ))  # fmt: skip
    grid, fp8, meta = decided
    if grid is not None:
        _qk_norm_rope_kernel[grid](
            qkv, positions, q_weight, k_weight, cos_sin_cache, k_cache, v_cache, slot_mapping,
            kv_scales if fp8 else k_cache, qkv.stride(0), eps, **meta,
        )  # fmt: skip
    return qkv


def _decide_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scales: torch.Tensor | None,
) -> _Decided:
    """Every check of `qk_norm_rope_store_kv`'s arguments, and the launch they get."""
    _check(
        qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim,
        num_q_heads + 2 * num_kv_heads,
    )  # fmt: skip
    check_device(_qk_norm_rope_kernel, qkv, k_cache, v_cache, slot_mapping)
    check_kv_cache(k_cache, v_cache)
    if tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"the cache holds {tuple(k_cache.shape[2:])} (heads, head_dim) per slot, the qkv "
            f"row ({num_kv_heads}, {head_dim})"
        )
    check_kv_scales(k_cache, qkv.dtype, kv_scales)
    check_index("slot_mapping", slot_mapping, 1)
    num_tokens = qkv.shape[0]
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping {tuple(slot_mapping.shape)} does not match qkv's {num_tokens} tokens"
        )
    fp8 = k_cache.dtype == FP8_KV_DTYPE
    meta = launch_meta(
        num_q_heads, num_kv_heads, head_dim, store_kv=True, kv_fp8=fp8,
        interpreted=interpreting(_qk_norm_rope_kernel),
    )  # fmt: skip
    return _grid(num_tokens, meta), fp8, meta


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> torch.Tensor:
    """Plain torch: `rms_norm_ref` per head, then `rotary_embedding_ref`; returns a NEW tensor
    (qkv untouched)."""
    num_tokens = qkv.shape[0]
    q_end = num_q_heads * head_dim
    k_end = q_end + num_kv_heads * head_dim
    q = rms_norm_ref(qkv[:, :q_end].reshape(num_tokens, num_q_heads, head_dim), q_weight, eps)
    k = rms_norm_ref(qkv[:, q_end:k_end].reshape(num_tokens, num_kv_heads, head_dim), k_weight, eps)
    q, k = rotary_embedding_ref(positions, q, k, cos_sin_cache)
    return torch.cat((q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), qkv[:, k_end:]), -1)


def qk_norm_rope_store_kv_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch: `qk_norm_rope_ref`, then `store_kv_ref` of its keys and values into the
    caches (in place); returns the NEW qkv (the argument untouched)."""
    out = qk_norm_rope_ref(
        qkv, positions, q_weight, k_weight, cos_sin_cache, num_q_heads, num_kv_heads, head_dim, eps
    )
    num_tokens = qkv.shape[0]
    k_start = num_q_heads * head_dim
    v_start = k_start + num_kv_heads * head_dim
    key = out[:, k_start:v_start].reshape(num_tokens, num_kv_heads, head_dim)
    value = out[:, v_start : v_start + num_kv_heads * head_dim].reshape(key.shape)
    store_kv_ref(key, value, k_cache, v_cache, slot_mapping, kv_scales)
    return out
