"""Rotary position embedding, neox layout (Qwen3), applied to q and k IN PLACE.

The head dim is two halves `[x1 | x2]` rotated as pairs `(x1[i], x2[i])` by the angle of
frequency i at the token's position (transformers' `rotate_half`):
`out1 = x1 cos - x2 sin`, `out2 = x2 cos + x1 sin`. The table is `cos_sin_cache
[max_position, head_dim]`: cos of the head_dim/2 frequencies in the first half, sin in the
second.

Precision: the kernel rotates in fp32 and rounds once; transformers multiplies in the model
dtype (cos/sin cast down first), so in bf16 the two can differ by an ulp or two. In fp32 they
agree to fp32 rounding.

What the fusion pays: q and k of a token are rotated by one program that reads the cos/sin row
once and each q/k element once, in place; eager torch gathers cos and sin, builds `rotate_half`
copies and concatenates, about 6 full passes over q and k. It is kept simple (one program per
token, all heads as one tile) because it is a small share of a layer's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    check_device,
    check_float,
    check_index,
    check_last_dim_contiguous,
    next_pow2,
)


@triton.jit
def _rotate_heads(
    x_ptr,  # [T, num_heads, head_dim] q or k of this program's token (offset applied)
    stride_h,
    cos,  # [1, BLOCK_HALF] fp32
    sin,  # [1, BLOCK_HALF] fp32
    NUM_HEADS: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_HEADS)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < NUM_HEADS) & (i[None, :] < HALF)
    p1 = x_ptr + h[:, None] * stride_h + i[None, :]  # [BLOCK_HEADS, BLOCK_HALF] first halves
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    out_ty = x_ptr.dtype.element_ty
    tl.store(p1, (x1 * cos - x2 * sin).to(out_ty), mask=mask)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(out_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int32/int64 absolute position of each token
    q_ptr,  # [T, num_heads, head_dim] rotated in place; strides stride_qt, stride_qh, 1
    k_ptr,  # [T, num_kv_heads, head_dim] rotated in place; strides stride_kt, stride_kh, 1
    cos_sin_ptr,  # [max_position, head_dim] cos | sin, contiguous
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_HALF: tl.constexpr,
):
    # Grid: (T,).
    token = tl.program_id(0)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    table = cos_sin_ptr + pos * (2 * HALF)
    cos = tl.load(table + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    t = token.to(tl.int64)
    _rotate_heads(
        q_ptr + t * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_Q_HEADS, HALF, BLOCK_HALF
    )
    _rotate_heads(
        k_ptr + t * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, BLOCK_K_HEADS, HALF, BLOCK_HALF
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `query [T, num_heads, head_dim]` and `key [T, num_kv_heads, head_dim]` IN PLACE by
    `positions [T]` (int32/int64) and return them (the same tensors).

    q/k may be strided views (e.g. of a fused QKV output) with a dense last dim.
    `cos_sin_cache [max_position, head_dim]` (fp32 advised; any float dtype is read as fp32) is
    contiguous. Positions are not range-checked on the device.
    """
    check_device(_rotary_kernel, positions, query, key, cos_sin_cache)
    check_index("positions", positions, 1)
    for name, t in (("query", query), ("key", key)):
        check_float(name, t)
        if t.dim() != 3 or t.shape[0] != positions.shape[0]:
            raise ValueError(
                f"{name} must be [{positions.shape[0]}, heads, head_dim], got {tuple(t.shape)}"
            )
        check_last_dim_contiguous(name, t)
    head_dim = query.shape[2]
    if key.shape[2] != head_dim or key.dtype != query.dtype or head_dim % 2:
        raise ValueError(
            f"query {tuple(query.shape)} {query.dtype} and key {tuple(key.shape)} {key.dtype} "
            "need one even head_dim and one dtype"
        )
    check_float("cos_sin_cache", cos_sin_cache)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, {head_dim}], got {tuple(cos_sin_cache.shape)}"
        )
    if not cos_sin_cache.is_contiguous():
        raise ValueError("cos_sin_cache must be contiguous")
    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return query, key
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        NUM_Q_HEADS=query.shape[1],
        NUM_K_HEADS=key.shape[1],
        BLOCK_Q_HEADS=next_pow2(query.shape[1]),
        BLOCK_K_HEADS=next_pow2(key.shape[1]),
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        num_warps=4,
    )
    return query, key


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `rotary_embedding`, in fp32, returning NEW tensors (inputs untouched)."""
    half = query.shape[-1] // 2
    table = cos_sin_cache[positions.long()].float()  # [T, head_dim]
    cos, sin = table[:, None, :half], table[:, None, half:]  # [T, 1, half]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)
