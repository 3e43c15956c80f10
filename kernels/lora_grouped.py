"""Multi-LoRA's shrink and expand grouped by slot (Punica's SGMV), for large eager steps.

The same two operations as `kernels.lora` (whose docstring has the stack layouts), over tokens
grouped by slot on the device (`lora_token_groups`): each program takes a tile of up to
BLOCK_M tokens of one slot and multiplies it with that slot's A or B by `tl.dot`, so a slot's
matrices are read once per tile rather than once per token (the per-token kernels' cost in a
long prefill). The grid covers every slot and T tokens of each; tiles past a slot's tokens
return at once, so the launch depends on T and S only. The references are `kernels.lora`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_device, dot_options, interpreting
from kernels.lora import check_stacks

# Tokens of one slot per program (tl.dot wants >= 16 rows).
_GROUP_M = 16


def lora_token_groups(slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(order [T] int32, starts [S+2] int32)`: token indices sorted by slot (stable), and where
    each slot's run starts: slot s's tokens are `order[starts[s+1] : starts[s+2]]` (the base
    tokens, slot -1, come first). Device ops only: no host sync."""
    order = torch.argsort(slots, stable=True).to(torch.int32)  # [T]
    counts = torch.zeros(num_slots + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, (slots + 1).long(), torch.ones_like(slots))  # [S+1], base first
    starts = torch.zeros(num_slots + 2, dtype=torch.int32, device=slots.device)
    torch.cumsum(counts, 0, dtype=torch.int32, out=starts[1:])
    return order, starts


@triton.jit
def _grouped_shrink_kernel(
    h_ptr,  # [T, P, R] fp32, contiguous
    x_ptr,  # [T, K], row stride stride_xt, last dim dense
    a_ptr,  # [S, P, R, K] contiguous
    order_ptr,  # [T] int32 token indices grouped by slot
    starts_ptr,  # [S+2] int32 run starts (`lora_token_groups`)
    stride_xt,
    K,
    P: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= max(R, 16)
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Grid: (cdiv(T, BLOCK_M), P, S).
    p = tl.program_id(1)
    slot = tl.program_id(2)
    first = tl.load(starts_ptr + slot + 1) + tl.program_id(0) * BLOCK_M
    end = tl.load(starts_ptr + slot + 2)
    if first >= end:
        return
    m = first + tl.arange(0, BLOCK_M)
    m_ok = m < end
    tok = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    r = tl.arange(0, BLOCK_R)
    a_base = a_ptr + (slot.to(tl.int64) * P + p) * R * K
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(
            x_ptr + tok[:, None] * stride_xt + k[None, :],
            mask=m_ok[:, None] & (k[None, :] < K),
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        av = tl.load(
            a_base + r[None, :] * K + k[:, None],
            mask=(r[None, :] < R) & (k[:, None] < K),
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]: A^T
        xv = xv.to(av.dtype)
        if UPCAST_DOT:
            xv = xv.to(tl.float32)
            av = av.to(tl.float32)
        acc = tl.dot(xv, av, acc, input_precision=DOT_PRECISION)
    out = h_ptr + (tok[:, None] * P + p) * R + r[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & (r[None, :] < R))


@triton.jit
def _grouped_expand_kernel(
    y_ptr,  # [T, N], row stride stride_yt, last dim dense; updated in place
    h_ptr,  # [T, P, R] fp32 contiguous
    b_ptr,  # [S, N, R] contiguous
    order_ptr,  # [T] int32 token indices grouped by slot
    starts_ptr,  # [S+2] int32 run starts
    offsets_ptr,  # [P + 1] int32 part bounds
    stride_yt,
    N,
    N_TILES,  # cdiv(widest part, BLOCK_N)
    P: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Grid: (cdiv(T, BLOCK_M) * N_TILES, P, S).
    pid = tl.program_id(0)
    p = tl.program_id(1)
    slot = tl.program_id(2)
    first = tl.load(starts_ptr + slot + 1) + (pid // N_TILES) * BLOCK_M
    end = tl.load(starts_ptr + slot + 2)
    if first >= end:
        return
    m = first + tl.arange(0, BLOCK_M)
    m_ok = m < end
    tok = tl.load(order_ptr + m, mask=m_ok, other=0).to(tl.int64)  # [BLOCK_M]
    part_end = tl.load(offsets_ptr + p + 1)
    n = tl.load(offsets_ptr + p) + (pid % N_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < part_end
    r = tl.arange(0, BLOCK_R)
    hv = tl.load(
        h_ptr + (tok[:, None] * P + p) * R + r[None, :],
        mask=m_ok[:, None] & (r[None, :] < R),
        other=0.0,
    )  # [BLOCK_M, BLOCK_R] fp32
    bv = tl.load(
        b_ptr + (slot.to(tl.int64) * N + n[None, :]) * R + r[:, None],
        mask=n_ok[None, :] & (r[:, None] < R),
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]: B^T
    hv = hv.to(bv.dtype)  # as vLLM: the fp32 buffer meets B in B's dtype (exact for fp32)
    if UPCAST_DOT:
        hv = hv.to(tl.float32)
        bv = bv.to(tl.float32)
    delta = tl.dot(hv, bv, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    y_tile = y_ptr + tok[:, None] * stride_yt + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    yv = tl.load(y_tile, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_tile, (yv + delta).to(y_ptr.dtype.element_ty), mask=mask)


def grouped_meta(kernel: object, dtype: torch.dtype, rank: int) -> dict[str, object]:
    """Constexprs of a grouped kernel (`_grouped_shrink_kernel` or `_grouped_expand_kernel`)
    for stacks of `dtype` and rank `rank` (shared with the sm_90 compile test): 16-token
    tiles, the rank padded to a power of two >= 16 (tl.dot's least), 64 features or output
    rows per step (32 at ranks above 128, to bound the A and B tiles)."""
    block_r = max(16, triton.next_power_of_2(rank))
    width = 64 if block_r <= 128 else 32
    sizes = {"BLOCK_K": width} if kernel is _grouped_shrink_kernel else {"BLOCK_N": width}
    return dict(
        BLOCK_M=_GROUP_M, BLOCK_R=block_r, **sizes, **dot_options(dtype, interpreting(kernel))
    )


def _check_groups(groups: tuple[torch.Tensor, torch.Tensor], num_tokens: int, num_slots: int):
    order, starts = groups
    if order.shape != (num_tokens,) or starts.shape != (num_slots + 2,):
        raise ValueError(
            f"groups of {tuple(order.shape)} tokens and {tuple(starts.shape)} starts do not fit "
            f"{num_tokens} tokens over {num_slots} slots"
        )
    if order.dtype != torch.int32 or starts.dtype != torch.int32:
        raise ValueError("groups must be int32")


def lora_shrink_grouped(
    x: torch.Tensor, a: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """`lora_shrink` over tokens grouped by slot (`lora_token_groups`)."""
    order, starts = groups
    check_device(_grouped_shrink_kernel, x, a, order, starts)
    check_stacks(x, a, order)  # order: one int32 per token, as slots
    _check_groups(groups, x.shape[0], a.shape[0])
    num_tokens, (num_slots, parts, rank, k) = x.shape[0], a.shape
    h = torch.empty((num_tokens, parts, rank), dtype=torch.float32, device=x.device)
    if num_tokens:
        meta = grouped_meta(_grouped_shrink_kernel, a.dtype, rank)
        grid = (triton.cdiv(num_tokens, _GROUP_M), parts, num_slots)
        _grouped_shrink_kernel[grid](
            h, x, a, order, starts, x.stride(0), k, P=parts, R=rank, **meta
        )
    return h


def lora_expand_grouped(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor],
    offsets: torch.Tensor,
    widest_part: int,
) -> None:
    """`lora_expand` over tokens grouped by slot (`lora_token_groups`)."""
    order, starts = groups
    check_device(_grouped_expand_kernel, y, h, b, order, starts, offsets)
    num_tokens, parts, rank = h.shape
    if b.dim() != 3 or b.shape[1:] != (y.shape[1], rank) or not b.is_contiguous():
        raise ValueError(f"b must be contiguous [S, {y.shape[1]}, {rank}], got {tuple(b.shape)}")
    if y.shape[0] != num_tokens or y.stride(1) != 1 or not h.is_contiguous():
        raise ValueError("y must be [T, N] with its last dim dense, h contiguous [T, P, R]")
    _check_groups(groups, num_tokens, b.shape[0])
    if num_tokens:
        meta = grouped_meta(_grouped_expand_kernel, b.dtype, rank)
        n_tiles = triton.cdiv(widest_part, meta["BLOCK_N"])
        grid = (triton.cdiv(num_tokens, _GROUP_M) * n_tiles, parts, b.shape[0])
        _grouped_expand_kernel[grid](
            y, h, b, order, starts, offsets, y.stride(0), y.shape[1], n_tiles, P=parts,
            R=rank, **meta,
        )  # fmt: skip
