"""Multi-LoRA over a mixed batch: every token adds the term of its own adapter slot.

A linear layer with LoRA computes `y[t] += B[s] (A[s] x[t])` where `s = slots[t]` is token t's
adapter slot (-1: the base model, nothing added). The slot stacks hold every loaded adapter:

    a  [S, P, R, K]  A of each slot and packed part (q, k, v / gate, up / one part), its rows
                     past the adapter's rank zero
    b  [S, N, R]     B of each slot over the layer's N local output rows, the scaling folded
                     in; part p owns rows offsets[p] .. offsets[p+1]

Two kernels, in two forms:

    shrink  h[T, P, R] fp32 = x[T, K] @ a[slot]^T, part by part
    expand  y[T, N] += h[t, p] @ b[slot, rows of p]^T, in y's dtype

- per token (Punica's BGMV; `lora_shrink`, `lora_expand`): one program per token, so a batch
  mixing adapters needs no sorting and the launch depends on T only: what decode steps and
  their CUDA graphs run;
- per slot (Punica's SGMV; `lora_shrink_grouped`, `lora_expand_grouped`): tokens grouped by
  slot (`lora_token_groups`, on the device), each program a tile of up to BLOCK_M tokens of one
  slot, multiplied with `tl.dot`, so a slot's A and B are read once per tile rather than once
  per token: what prefill steps run. The grid covers every slot and T tokens of each; tiles
  past a slot's tokens return at once.

A token of slot -1 returns at once in both. `*_ref` are the plain-torch references: they loop
over the S slots with masks, so they cost S times a dense LoRA but never read a slot per token
on the host (a GPU running the torch layers may capture them in a graph). `lora_apply_by_slot`
is the CPU path: it reads which slots the step uses and computes each on its tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels._common import check_device, check_float, dot_options, interpreting


def _block(rank: int) -> int:
    """Input features per shrink iteration, and output rows per expand program: a
    `[BLOCK_R, block]` tile of about 4096 elements (registers), whatever the rank."""
    return max(16, min(256, 4096 // triton.next_power_of_2(rank)))


@triton.jit
def _shrink_kernel(
    h_ptr,  # [T, P, R] fp32, contiguous
    x_ptr,  # [T, K], row stride stride_xt, last dim dense
    a_ptr,  # [S, P, R, K] contiguous
    slots_ptr,  # [T] int32, -1 = base
    stride_xt,
    K,
    P: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,  # next power of two >= R
    BLOCK_K: tl.constexpr,
):
    # Grid: (T, P).
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    a_base = a_ptr + (slot * P + p) * R * K
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * stride_xt + k, mask=k < K, other=0.0).to(tl.float32)
        av = tl.load(
            a_base + r[:, None] * K + k[None, :],
            mask=(r[:, None] < R) & (k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(h_ptr + (t * P + p) * R + r, acc, mask=r < R)


@triton.jit
def _expand_kernel(
    y_ptr,  # [T, N], row stride stride_yt, last dim dense; updated in place
    h_ptr,  # [T, P, R] fp32 contiguous (shrink's output)
    b_ptr,  # [S, N, R] contiguous
    slots_ptr,  # [T] int32, -1 = base
    offsets_ptr,  # [P + 1] int32: part p owns output rows offsets[p] .. offsets[p+1]
    stride_yt,
    N,
    P: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Grid: (T, P, cdiv(widest part, BLOCK_N)).
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:
        return
    end = tl.load(offsets_ptr + p + 1)
    n = tl.load(offsets_ptr + p) + tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < end
    r = tl.arange(0, BLOCK_R)
    hv = tl.load(h_ptr + (t * P + p) * R + r, mask=r < R, other=0.0)
    bv = tl.load(
        b_ptr + (slot * N + n[:, None]) * R + r[None, :],
        mask=n_mask[:, None] & (r[None, :] < R),
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(bv * hv[None, :], axis=1)
    y_row = y_ptr + t * stride_yt + n
    yv = tl.load(y_row, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_row, (yv + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _check_stacks(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> None:
    check_float("x", x)
    if a.dim() != 4 or x.dim() != 2 or a.shape[3] != x.shape[1]:
        raise ValueError(
            f"x [T, K] and a [S, P, R, K] disagree: {tuple(x.shape)}, {tuple(a.shape)}"
        )
    if slots.dtype != torch.int32 or slots.shape != (x.shape[0],):
        raise ValueError(
            f"slots must be int32 [{x.shape[0]}], got {slots.dtype} {tuple(slots.shape)}"
        )
    if not a.is_contiguous() or x.stride(1) != 1:
        raise ValueError("a must be contiguous and x's last dim dense")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`h [T, P, R]` fp32: each token's input times its slot's A, part by part (rows of slot
    -1 tokens are left unwritten: expand skips them)."""
    check_device(_shrink_kernel, x, a, slots)
    _check_stacks(x, a, slots)
    num_tokens, (_, parts, rank, k) = x.shape[0], a.shape
    h = torch.empty((num_tokens, parts, rank), dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(num_tokens, parts)](
            h, x, a, slots, x.stride(0), k, P=parts, R=rank,
            BLOCK_R=triton.next_power_of_2(rank), BLOCK_K=_block(rank),
        )  # fmt: skip
    return h


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    widest_part: int,
) -> None:
    """`y [T, N] += h[t, p] @ b[slots[t], rows of p]^T` in place for every token whose slot is
    not -1. `offsets [P+1]` int32 on y's device; `widest_part`: the most rows of one part."""
    check_device(_expand_kernel, y, h, b, slots, offsets)
    num_tokens, parts, rank = h.shape
    if b.dim() != 3 or b.shape[1:] != (y.shape[1], rank) or not b.is_contiguous():
        raise ValueError(f"b must be contiguous [S, {y.shape[1]}, {rank}], got {tuple(b.shape)}")
    if y.shape[0] != num_tokens or y.stride(1) != 1 or not h.is_contiguous():
        raise ValueError("y must be [T, N] with its last dim dense, h contiguous [T, P, R]")
    if num_tokens:
        block_n = _block(rank)
        grid = (num_tokens, parts, triton.cdiv(widest_part, block_n))
        _expand_kernel[grid](
            y, h, b, slots, offsets, y.stride(0), y.shape[1], P=parts, R=rank,
            BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=block_n,
        )  # fmt: skip


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`lora_shrink` in plain torch (rows of slot -1 tokens are zero)."""
    h = torch.zeros((x.shape[0], a.shape[1], a.shape[2]), dtype=torch.float32, device=x.device)
    xf = x.float()
    for slot in range(a.shape[0]):
        mine = (slots == slot)[:, None, None]  # [T, 1, 1]
        h = torch.where(mine, torch.einsum("tk,prk->tpr", xf, a[slot].float()), h)
    return h


def lora_expand_ref(
    y: torch.Tensor,
    h: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor | Sequence[int],
    widest_part: int = 0,
) -> None:
    """`lora_expand` in plain torch (`widest_part` unused: the grid's bound). `offsets` may be
    a host list, which a CUDA graph can capture (a device tensor's `tolist` syncs)."""
    bounds = offsets.tolist() if isinstance(offsets, torch.Tensor) else list(offsets)
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for slot in range(b.shape[0]):
        mine = (slots == slot)[:, None]  # [T, 1]
        for p in range(h.shape[1]):
            rows = slice(bounds[p], bounds[p + 1])
            part = h[:, p] @ b[slot, rows].float().T  # [T, rows of p]
            delta[:, rows] = torch.where(mine, part, delta[:, rows])
    y.copy_((y.float() + delta).to(y.dtype))  # one rounding, as the kernel


def lora_apply_by_slot(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    slots: torch.Tensor,
    offsets: Sequence[int],
) -> None:
    """`lora_shrink` then `lora_expand`, for the CPU: each slot the step uses, on its tokens
    only (gathered and scattered back), so the cost follows the adapters' tokens, not the
    number of slots. Reads the slots on the host: not for a CUDA graph."""
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)  # [T_s] this slot's tokens
        h = torch.einsum("tk,prk->tpr", x.index_select(0, rows).float(), a[slot].float())
        delta = torch.cat(
            [h[:, p] @ b[slot, offsets[p] : offsets[p + 1]].float().T for p in range(h.shape[1])],
            dim=1,
        )  # [T_s, N]
        y.index_copy_(0, rows, (y.index_select(0, rows).float() + delta).to(y.dtype))


# -- per slot (SGMV) ------------------------------------------------------------------------------

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


def lora_shrink_grouped(
    x: torch.Tensor, a: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """`lora_shrink` over tokens grouped by slot (`lora_token_groups`)."""
    order, starts = groups
    check_device(_grouped_shrink_kernel, x, a, order, starts)
    _check_stacks(x, a, torch.empty(x.shape[0], dtype=torch.int32))
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
    if num_tokens:
        meta = grouped_meta(_grouped_expand_kernel, b.dtype, rank)
        n_tiles = triton.cdiv(widest_part, meta["BLOCK_N"])
        grid = (triton.cdiv(num_tokens, _GROUP_M) * n_tiles, parts, b.shape[0])
        _grouped_expand_kernel[grid](
            y, h, b, order, starts, offsets, y.stride(0), y.shape[1], n_tiles, P=parts,
            R=rank, **meta,
        )  # fmt: skip
