"""Block-scaled FP8 (W8A8) matmul, as Qwen3's and DeepSeek's FP8 checkpoints define it.

A weight `W [N, K]` is stored as `float8_e4m3fn` with one fp32 scale per 128×128 block,
`weight_scale_inv [cdiv(N, 128), cdiv(K, 128)]`: `W ≈ W_fp8 * scale_inv[n // 128, k // 128]`.
Activations are quantized at run time ("dynamic"), per token and per 128-column group:
`x ≈ x_fp8 * x_scale[t, k // 128]` with `x_scale = max|x| over the group / 448` (448 is
e4m3's largest finite value). Then

    y[t, n] = sum over k groups g of  x_scale[t, g] * w_scale[n // 128, g] * (x_fp8[t, g] · W_fp8[n, g])

The kernel computes each group's partial product with an fp8 `tl.dot` (tensor cores on
Hopper) into fp32 and applies both scales per group, which is exact up to fp32 accumulation
order. The references (`*_ref`) dequantize and multiply in fp32: the CPU path.

`GROUP = 128` is both the activation group and the weight block's K side, so one K step of
the kernel (BLOCK_K divides 128) lies inside one group of both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import check_device, check_float, check_last_dim_contiguous, interpreting
from kernels._fp8_cast import to_e4m3

GROUP = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A group of zeros gets this scale instead of 0, so that x / scale stays finite.
_MIN_SCALE = 1e-10


@triton.jit(do_not_specialize=["num_tokens"])
def _token_group_quant_kernel(
    x_ptr,  # [T, K] input; row stride stride_xt, last dim dense
    q_ptr,  # [T, K] out, contiguous float8_e4m3fn
    s_ptr,  # [T, K // GROUP] out, contiguous fp32 scales
    num_tokens,
    stride_xt,
    K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,  # see kernels._fp8_cast
):
    # Grid: (T, K // GROUP); one program quantizes one group of one token.
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = group * GROUP_SIZE + tl.arange(0, GROUP_SIZE)
    # fp32 first: the interpreter's direct bf16 -> fp8 conversion rounds differently from torch.
    x = tl.load(x_ptr + token * stride_xt + offs).to(tl.float32)
    # IEEE divisions, as torch divides: `/` on a GPU is an approximate division (2 ulp), which
    # moves values that sit on an e4m3 rounding tie (common from bf16 inputs) to the other side.
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX_VALUE), MIN_SCALE)
    q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX_VALUE, FP8_MAX_VALUE)
    tl.store(q_ptr + token * K + offs, to_e4m3(q, q_ptr.dtype.element_ty, INTERPRETED))
    tl.store(s_ptr + token * (K // GROUP_SIZE) + group, scale)


def per_token_group_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [T, K]` (K a multiple of 128, last dim dense) -> `(x_fp8 [T, K] e4m3, x_scale
    [T, K / 128] fp32)`, both new and contiguous."""
    check_device(_token_group_quant_kernel, x)
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    num_tokens, k = _check_groups(x)
    q = torch.empty((num_tokens, k), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((num_tokens, k // GROUP), dtype=torch.float32, device=x.device)
    if num_tokens:
        _token_group_quant_kernel[(num_tokens, k // GROUP)](
            x, q, s, num_tokens, x.stride(0),
            K=k, GROUP_SIZE=GROUP, FP8_MAX_VALUE=FP8_MAX, MIN_SCALE=_MIN_SCALE,
            INTERPRETED=interpreting(_token_group_quant_kernel), num_warps=1,
        )  # fmt: skip
    return q, s


def per_token_group_quant_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch `per_token_group_quant_fp8`, the same arithmetic in the same order."""
    num_tokens, k = _check_groups(x)
    groups = x.float().reshape(num_tokens, k // GROUP, GROUP)
    scale = (groups.abs().amax(-1) / FP8_MAX).clamp(min=_MIN_SCALE)  # [T, K / 128]
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(num_tokens, k), scale


def _check_groups(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.shape[1] % GROUP:
        raise ValueError(
            f"x must be [T, K] with K a multiple of {GROUP} (the activation group), got "
            f"{tuple(x.shape)}"
        )
    return int(x.shape[0]), int(x.shape[1])


@triton.jit(do_not_specialize=["num_tokens"])
def _w8a8_block_matmul_kernel(
    out_ptr,  # [T, N] out, contiguous, the activations' dtype
    xq_ptr,  # [T, K] contiguous float8_e4m3fn quantized activations
    xs_ptr,  # [T, K // GROUP] contiguous fp32 activation scales
    w_ptr,  # [N, K] contiguous float8_e4m3fn weight
    ws_ptr,  # [cdiv(N, GROUP), K // GROUP] contiguous fp32 block scales (weight_scale_inv)
    num_tokens,
    N: tl.constexpr,
    K: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides GROUP_SIZE: each K step lies in one scale group
):
    # Grid: (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)).
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    k = tl.arange(0, BLOCK_K)
    m_ok = m < num_tokens
    n_ok = n < N
    m64 = m.to(tl.int64)
    a_rows = xq_ptr + m64[:, None] * K  # [BLOCK_M, 1]
    b_cols = w_ptr + n.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: column j of the tile is row j of W
    a_scales = xs_ptr + m64 * (K // GROUP_SIZE)  # [BLOCK_M]
    b_scales = ws_ptr + (n // GROUP_SIZE) * (K // GROUP_SIZE)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_rows + (k0 + k)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(b_cols + (k0 + k)[:, None], mask=n_ok[None, :], other=0.0)
        g = k0 // GROUP_SIZE
        sa = tl.load(a_scales + g, mask=m_ok, other=0.0)  # [BLOCK_M]
        sb = tl.load(b_scales + g, mask=n_ok, other=0.0)  # [BLOCK_N]
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    out = out_ptr + m64[:, None] * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def launch_meta(interpret: bool) -> dict[str, int]:
    """Tiles of the GEMM. Interpreter: small, so that test shapes span several tiles and K
    steps. GPU: 64×128×128 (fp8 operands are 1 byte: a 128-deep K step is one scale group and
    one 128-byte row), 3 stages; not tuned by GPU timing yet."""
    if interpret:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=1)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)


def w8a8_block_fp8_matmul(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`y [T, N]` (new, `out_dtype`) from quantized activations `xq [T, K]` e4m3 with `xs
    [T, K/128]` fp32 (`per_token_group_quant_fp8`) and a block-quantized weight `w [N, K]` e4m3
    with `ws [cdiv(N, 128), K/128]` fp32. All contiguous."""
    check_device(_w8a8_block_matmul_kernel, xq, xs, w, ws)
    num_tokens, k, n = _check_matmul(xq, xs, w, ws)
    out = torch.empty((num_tokens, n), dtype=out_dtype, device=xq.device)
    if num_tokens == 0:
        return out
    meta = launch_meta(interpreting(_w8a8_block_matmul_kernel))
    grid = (triton.cdiv(num_tokens, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
    _w8a8_block_matmul_kernel[grid](
        out, xq, xs, w, ws, num_tokens, N=n, K=k, GROUP_SIZE=GROUP, **meta
    )
    return out


def w8a8_block_fp8_matmul_ref(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    ws: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Plain torch: dequantize both operands to fp32 and multiply."""
    _check_matmul(xq, xs, w, ws)
    x = (xq.float().unflatten(1, (-1, GROUP)) * xs[..., None]).flatten(1)  # [T, K] fp32
    return torch.nn.functional.linear(x, dequantize_block_fp8(w, ws)).to(out_dtype)


def dequantize_block_fp8(w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """`w [..., N, K]` e4m3 with `ws [..., cdiv(N, 128), cdiv(K, 128)]` -> fp32 `[..., N, K]`
    (`W_fp8 * scale_inv` of its block; the last blocks may be partial)."""
    n, k = w.shape[-2:]
    scale = ws.repeat_interleave(GROUP, -2)[..., :n, :].repeat_interleave(GROUP, -1)[..., :k]
    return w.float() * scale


def quantize_block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., N, K]` float -> `(w_fp8 e4m3, scale_inv [..., cdiv(N,128), cdiv(K,128)] fp32)`:
    each 128×128 block scaled so that its largest magnitude maps to 448, as Qwen's FP8
    checkpoints are made. The inverse of `dequantize_block_fp8` up to e4m3 rounding."""
    n, k = w.shape[-2:]
    pad_n, pad_k = -n % GROUP, -k % GROUP
    padded = torch.nn.functional.pad(w.float(), (0, pad_k, 0, pad_n))
    blocks = padded.unflatten(-1, (-1, GROUP)).unflatten(-3, (-1, GROUP))  # [.., nb, G, kb, G]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    full = scale.repeat_interleave(GROUP, -2).repeat_interleave(GROUP, -1)[..., :n, :k]
    q = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def _check_matmul(
    xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor
) -> tuple[int, int, int]:
    for name, t in (("xq", xq), ("w", w)):
        if t.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be float8_e4m3fn, got {t.dtype}")
    for name, t in (("xs", xs), ("ws", ws)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {t.dtype}")
    if not all(t.is_contiguous() for t in (xq, xs, w, ws)):
        raise ValueError("xq, xs, w and ws must be contiguous")
    num_tokens, k = _check_groups(xq)
    n = w.shape[0]
    expected = {
        "w": (w.shape, (n, k)),
        "xs": (xs.shape, (num_tokens, k // GROUP)),
        "ws": (ws.shape, (triton.cdiv(n, GROUP), k // GROUP)),
    }
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(
                f"{name} has shape {tuple(got)}, expected {want} for xq {tuple(xq.shape)}"
            )
    return num_tokens, k, n


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """`x [T, K]` @ the block-quantized `w [N, K]`.T -> `[T, N]` in x's dtype: x quantized
    per token and 128-group, then the W8A8 kernel."""
    xq, xs = per_token_group_quant_fp8(x)
    return w8a8_block_fp8_matmul(xq, xs, w, ws, x.dtype)


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """Plain-torch `fp8_linear`: the same activation quantization, then dequantize and
    multiply in fp32 (the CPU path of FP8 checkpoints)."""
    xq, xs = per_token_group_quant_fp8_ref(x)
    return w8a8_block_fp8_matmul_ref(xq, xs, w, ws, x.dtype)
