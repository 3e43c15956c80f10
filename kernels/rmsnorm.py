"""RMSNorm, alone or fused with the residual add before it, with Qwen3's rounding.

Hugging Face's Qwen3RMSNorm computes `weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)`:
statistics in fp32, the normalised value rounded to the input dtype, THEN multiplied by the
weight (and rounded again). The kernels round at the same two places, so in bf16 they agree with
the reference except where a last-bit difference of fp32 rsqrt tips a bf16 rounding; rounding
once at the end instead would differ from transformers by one ulp in many outputs.

What the fusion pays: `fused_add_rms_norm` reads x and residual once and writes the sum and the
normed output once (4 tensor passes), where eager torch takes about 8 (add, cast, square, mean,
rsqrt-mul, cast, mul) and materialises fp32 temporaries. `rms_norm` is also used per head for
Qwen3's q/k norm (`[T, heads, head_dim]`, rows of 128); there the kernel is mostly launch cost
and pays only by saving the eager chain's temporaries.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    LaunchMemo,
    check_device,
    check_float,
    check_last_dim_contiguous,
    layout,
    next_pow2,
)


# The row count changes with every step: specialising on it (== 1, multiple of 16) would compile
# new variants while serving.
@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    out_ptr,  # [R, N] normed rows, contiguous
    x_ptr,  # [R, N] input rows; row r at (r // inner) * stride_xo + (r % inner) * stride_xi
    residual_ptr,  # [R, N] residual rows, same row addressing as x (only when ADD_RESIDUAL)
    sum_ptr,  # [R, N] x + residual, contiguous (only when ADD_RESIDUAL)
    weight_ptr,  # [N] norm weight, same dtype as x
    num_rows,
    inner,  # rows per outer index: 1 for 2-D inputs, num_heads for [T, heads, head_dim]
    stride_xo,
    stride_xi,
    stride_ro,
    stride_ri,
    eps,
    N: tl.constexpr,  # normalised dim (hidden size or head_dim)
    BLOCK_N: tl.constexpr,  # N rounded up to a power of two
    ROWS: tl.constexpr,  # rows per program
    ADD_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    mask = row_ok[:, None] & (cols[None, :] < N)
    outer = (rows // inner).to(tl.int64)
    in_row = rows % inner
    x_off = (outer * stride_xo + in_row * stride_xi)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)  # [ROWS, BLOCK_N]
    dense_off = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if ADD_RESIDUAL:
        r_off = (outer * stride_ro + in_row * stride_ri)[:, None] + cols[None, :]
        res = tl.load(residual_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        # The residual stream is kept in the input dtype, as the model's eager add does; the
        # norm then sees the rounded sum.
        s = (x + res).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + dense_off, s, mask=mask)
        x = s.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 1) / N + eps)  # [ROWS]
    normed = (x * inv_rms[:, None]).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + dense_off, (normed * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(name: str, x: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_rows, inner, outer stride, inner stride) addressing the rows of a 2-D or 3-D x."""
    check_last_dim_contiguous(name, x)
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"{name} must be [rows, dim] or [T, heads, dim], got {tuple(x.shape)}")


class _Decided(NamedTuple):
    """One layout's launch: grid, the row addressing (num_rows, inner, x's two strides, the
    residual's two), constexprs; `grid` None: no rows, nothing to launch."""

    grid: tuple[int] | None
    rows: tuple[int, int, int, int, int, int]
    meta: dict[str, Any]


_DECIDED: LaunchMemo[_Decided] = LaunchMemo()


def _decide(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> _Decided:
    """Every check of `_launch`'s arguments, and the launch they get."""
    tensors = [x, weight] if residual is None else [x, residual, weight]
    check_device(_rms_norm_kernel, *tensors)
    check_float("x", x)
    n = x.shape[-1]
    if weight.shape != (n,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(
            f"weight must be a contiguous [{n}] {x.dtype} tensor, "
            f"got {tuple(weight.shape)} {weight.dtype}"
        )
    num_rows, inner, stride_xo, stride_xi = _rows_view("x", x)
    stride_ro = stride_ri = 0  # the kernel never reads a residual when ADD_RESIDUAL is off
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        _, _, stride_ro, stride_ri = _rows_view("residual", residual)
    block_n = next_pow2(n)
    # Several short rows per program (per-head norms have 128-wide rows), up to 4096 elements.
    rows = max(1, min(16, 4096 // block_n))
    meta = dict(
        N=n,
        BLOCK_N=block_n,
        ROWS=rows,
        ADD_RESIDUAL=residual is not None,
        num_warps=8 if block_n >= 4096 else 4,
    )
    grid = (triton.cdiv(num_rows, rows),) if num_rows else None
    return _Decided(grid, (num_rows, inner, stride_xo, stride_xi, stride_ro, stride_ri), meta)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    new_residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Check (once per layout: `kernels._common.LaunchMemo`), allocate the normed output and
    launch; fills `new_residual` (a new contiguous tensor of x's shape) when a residual is
    given."""
    key = (layout(x), layout(weight), None if residual is None else layout(residual))
    decided = _DECIDED.get(key) or _DECIDED.put(key, _decide(x, residual, weight))
    # Contiguous whatever x's strides (`empty_like` would keep a dense permuted layout); an
    # `empty_like` allocates in about half the host time of `empty(shape, dtype, device)`.
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if decided.grid is None:
        return out
    # The kernel never touches the residual and the sum when ADD_RESIDUAL is off.
    res_arg, sum_arg = (
        (x, out) if residual is None or new_residual is None else (residual, new_residual)
    )
    _rms_norm_kernel[decided.grid](
        out, x, res_arg, sum_arg, weight, *decided.rows, eps, **decided.meta
    )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of `x` (`[rows, dim]` or `[T, heads, dim]`, last dim dense,
    other strides free); `weight [dim]` of x's dtype. Returns a new contiguous tensor."""
    return _launch(x, None, None, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`new_residual = x + residual` (in x's dtype) and `rms_norm(new_residual)`, in one pass.

    Returns `(normed, new_residual)`, both new contiguous tensors; the inputs are not modified.
    """
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    return _launch(x, residual, new_residual, weight, eps), new_residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm.forward, verbatim in substance."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual
