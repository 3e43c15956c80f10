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
- per slot (Punica's SGMV; `kernels.lora_grouped`): tokens grouped by slot, each program a
  tile of one slot's tokens multiplied with `tl.dot`: what large eager steps run.

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

from kernels._common import check_device, check_float


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


def check_stacks(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> None:
    """x `[T, K]` (last dim dense), a contiguous `[S, P, R, K]`, slots int32 `[T]`: what both
    shrink kernels index without bounds of their own."""
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
    check_stacks(x, a, slots)
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
