"""The mixture-of-experts feed-forward of one rank: tokens grouped by expert, two grouped GEMMs.

T tokens, each routed to `top_k` experts, make P = T * top_k (token, expert) pairs, numbered
`pair = t * top_k + j` for the j-th expert of token t. With this rank's E experts' weights
`w13 [E, 2I, H]` (each expert's gate rows, then its up rows) and `w2 [E, H, I]`:

    out[t] = sum over j of  weight[t, j] * w2[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = ids[t, j]

1. `moe_align` (torch, no host sync, so it can be captured in a CUDA graph): the pairs sorted
   by expert, each expert's run padded to a multiple of BLOCK_M rows, so that every BLOCK_M
   consecutive entries of `sorted_ids` belong to one expert, named by `block_expert` (-1 for the
   blocks past the end: the grid is sized for the worst case without reading the device).
2. `_moe_gate_up_kernel`, one program per (block, tile of I): the block's token rows of x are
   gathered once and multiplied by the expert's gate and up tiles (two accumulators, so both
   halves of a column meet in registers), and `silu(gate) * up` is written: `act [P, I]`. This
   is where the fusion pays: the `[P, 2I]` gate/up product is never written nor read back, and
   the activation costs no launch.
3. `_moe_down_kernel`, one program per (block, tile of H): `act` rows times the expert's down
   tile, scaled by the pair's routing weight: `pair_out [P, H]`.
4. The k pairs of each token are summed (torch, fp32 accumulation): `out [T, H]`.

Pairs whose id is -1 (an expert another rank holds, under expert parallelism) are in no block:
their `pair_out` rows are zero and they add nothing. Tile sizes do not depend on T, so one
binary per (model shape, dtype) serves every step; `num_pairs` is not specialised on.

Rounding follows the unfused model in the weights' dtype: the gate and up products, silu, the
product, the down product and the weighted pair output are each rounded to the dtype as eager
torch rounds them; the sum over a token's experts accumulates in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._common import (
    check_device,
    check_float,
    check_index,
    check_last_dim_contiguous,
    dot_options,
    interpreting,
)
from kernels.fp8_gemm import FP8_DTYPE, GROUP, fp8_linear_ref, per_token_group_quant_fp8


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gate_up_kernel(
    act_ptr,  # [P, INTER] out, contiguous: silu(gate) * up of every computed pair
    x_ptr,  # [T, HIDDEN] tokens; row stride stride_xt, last dim dense
    w13_ptr,  # [E, 2 * INTER, HIDDEN] contiguous: rows [0, INTER) gate, [INTER, 2 INTER) up
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32 pair ids grouped by expert; >= num_pairs: pad
    block_expert_ptr,  # [num_blocks] int32 the local expert of each block, -1 = nothing to do
    x_scale_ptr,  # FP8: [T, HIDDEN // 128] fp32 scales of x's token groups (else unused)
    w_scale_ptr,  # FP8: [E, 2 * INTER // 128, HIDDEN // 128] fp32 block scales (else unused)
    num_pairs,  # P = T * TOP_K (varies per step: not specialised on)
    stride_xt,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # x and w13 float8_e4m3fn with 128-group scales; BLOCK_K divides 128
):
    # Grid: (num_blocks, cdiv(INTER, BLOCK_N)).
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of I
    col_ok = n < INTER
    k = tl.arange(0, BLOCK_K)
    # int64: expert * 2 * INTER * HIDDEN passes 2**31 at the largest shapes.
    w_expert = w13_ptr + expert.to(tl.int64) * (2 * INTER * HIDDEN)
    x_rows = x_ptr + token[:, None] * stride_xt  # [BLOCK_M, 1]
    gate_cols = w_expert + n[None, :] * HIDDEN  # [1, BLOCK_N]: column j of the tile is row j of W
    up_cols = gate_cols + INTER * HIDDEN
    # FP8: the scales of each row's token groups and of each column's weight blocks.
    groups = HIDDEN // 128
    x_scales = x_scale_ptr + token * groups  # [BLOCK_M]
    w_scale_expert = w_scale_ptr + expert.to(tl.int64) * (2 * INTER // 128) * groups
    gate_scales = w_scale_expert + (n // 128) * groups  # [BLOCK_N]
    up_scales = w_scale_expert + ((INTER + n) // 128) * groups
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        kk = k0 + k
        k_ok = kk < HIDDEN
        a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & col_ok[None, :]
        b_gate = tl.load(gate_cols + kk[:, None], mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        b_up = tl.load(up_cols + kk[:, None], mask=b_mask, other=0.0)
        if FP8:
            # One K step lies in one group: fp8 dot of the step, then both groups' scales.
            g = k0 // 128
            sa = tl.load(x_scales + g, mask=row_ok, other=0.0)[:, None]  # [BLOCK_M, 1]
            sg = tl.load(gate_scales + g, mask=col_ok, other=0.0)[None, :]  # [1, BLOCK_N]
            su = tl.load(up_scales + g, mask=col_ok, other=0.0)[None, :]
            acc_gate += tl.dot(a, b_gate) * sa * sg
            acc_up += tl.dot(a, b_up) * sa * su
        else:
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b_gate = b_gate.to(tl.float32)
                b_up = b_up.to(tl.float32)
            acc_gate = tl.dot(a, b_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
    out_ty = act_ptr.dtype.element_ty
    gate = acc_gate.to(out_ty).to(tl.float32)
    up = acc_up.to(out_ty).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32) * up
    out_ptrs = act_ptr + pair.to(tl.int64)[:, None] * INTER + n[None, :]
    tl.store(out_ptrs, act.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_down_kernel(
    pair_out_ptr,  # [P, HIDDEN] out, contiguous: weight * (w2[e] @ act) of every computed pair
    act_ptr,  # [P, INTER] contiguous, from _moe_gate_up_kernel
    w2_ptr,  # [E, HIDDEN, INTER] contiguous
    topk_weights_ptr,  # [P] fp32 routing weight of each pair
    sorted_ids_ptr,  # [num_blocks * BLOCK_M] int32, as in _moe_gate_up_kernel
    block_expert_ptr,  # [num_blocks] int32, as in _moe_gate_up_kernel
    act_scale_ptr,  # FP8: [P, INTER // 128] fp32 scales of act's row groups (else unused)
    w_scale_ptr,  # FP8: [E, HIDDEN // 128, INTER // 128] fp32 block scales (else unused)
    num_pairs,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,  # act and w2 float8_e4m3fn with 128-group scales; BLOCK_K divides 128
):
    # Grid: (num_blocks, cdiv(HIDDEN, BLOCK_N)).
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    pair64 = pair.to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns of H
    col_ok = n < HIDDEN
    k = tl.arange(0, BLOCK_K)
    w_cols = w2_ptr + expert.to(tl.int64) * (HIDDEN * INTER) + n[None, :] * INTER
    a_rows = act_ptr + pair64[:, None] * INTER
    groups = INTER // 128
    a_scales = act_scale_ptr + pair64 * groups  # [BLOCK_M]
    w_scales = w_scale_ptr + expert.to(tl.int64) * (HIDDEN // 128) * groups + (n // 128) * groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + k
        k_ok = kk < INTER
        a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            g = k0 // 128
            sa = tl.load(a_scales + g, mask=row_ok, other=0.0)[:, None]  # [BLOCK_M, 1]
            sb = tl.load(w_scales + g, mask=col_ok, other=0.0)[None, :]  # [1, BLOCK_N]
            acc += tl.dot(a, b) * sa * sb
        else:
            if UPCAST_DOT:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_ty = pair_out_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)  # [BLOCK_M] fp32
    y = acc.to(out_ty).to(tl.float32) * weight[:, None]
    out_ptrs = pair_out_ptr + pair64[:, None] * HIDDEN + n[None, :]
    tl.store(out_ptrs, y.to(out_ty), mask=row_ok[:, None] & col_ok[None, :])


def launch_meta(dtype: torch.dtype, interpret: bool, fp8: bool = False) -> dict[str, object]:
    """Constexprs and launch options of both kernels (shared with the sm_90 compile test).

    Independent of the number of tokens, so that one binary serves every step. 16-bit on a GPU:
    64-row blocks (tl.dot on tensor cores wants >= 16; a decode batch fills few rows of an
    expert's block, but the weight tile is read once per block whatever the row count, and
    decode is bound by those reads) by 64 columns by 64 of K, 3 stages: the gate/up kernel
    holds two B tiles, ~72 KiB of shared memory. fp32 ("ieee" dot on the FMA units, the exact
    path for tests) takes small tiles. Interpreter: 16s, so that tiny test shapes span several
    tiles. FP8 experts take the 16-bit tiles whatever the model's dtype: their dot runs on e4m3
    operands, which sm_90 takes only with K >= 32 (an fp32 model's 16-wide K fails to compile).
    Not tuned by GPU timing yet (`benchmarks/gpu/moe_micro.py` measures it).
    """
    if interpret:
        block_m, block_n, block_k, num_warps, num_stages = 16, 16, 16, 4, 1
    elif dtype == torch.float32 and not fp8:
        block_m, block_n, block_k, num_warps, num_stages = 16, 32, 16, 4, 2
    else:
        block_m, block_n, block_k, num_warps, num_stages = 64, 64, 64, 4, 3
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
        **dot_options(dtype, interpret),
    )


def moe_align(
    local_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert, in blocks of `block_m` rows of one expert each.

    `local_ids [T, top_k]` int: this rank's expert of each pair, -1 where another rank holds it.
    Returns `sorted_ids [num_blocks * block_m]` int32 (pair ids, each expert's run in pair
    order and padded with P = T * top_k) and `block_expert [num_blocks]` int32 (-1 past the
    last run). `num_blocks = P // block_m + min(P, num_experts)` bounds the blocks any routing
    needs (each non-empty expert pads at most one block), so it is known without reading the
    device, and every op here is free of host syncs (no bincount, nonzero or item).
    """
    num_pairs = local_ids.numel()
    device = local_ids.device
    num_blocks = num_pairs // block_m + min(num_pairs, num_experts)
    ids = local_ids.reshape(-1).long()
    # Pairs of other ranks form group `num_experts`, sorted last and given no block.
    group = torch.where(ids < 0, num_experts, ids)  # [P]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, group, torch.ones_like(group))  # [E + 1] pairs per expert
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    group_end = torch.cumsum(padded, 0)  # [E] end of each expert's padded run
    # Where each group's run starts: in the padded layout, and among the sorted pairs.
    padded_start = torch.cat([group_end - padded, group_end.new_full((1,), num_blocks * block_m)])
    count_start = torch.cumsum(counts, 0) - counts  # [E + 1]
    order = torch.sort(group, stable=True).indices  # [P] pair ids grouped by expert
    sorted_group = group[order]
    rank_in_group = torch.arange(num_pairs, device=device) - count_start[sorted_group]
    dest = padded_start[sorted_group] + rank_in_group  # [P]; other ranks' pairs land past the end
    sorted_ids = torch.full(
        (num_blocks * block_m + 1,), num_pairs, dtype=torch.int32, device=device
    )
    sorted_ids.scatter_(0, dest.clamp_(max=num_blocks * block_m), order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m  # [num_blocks]
    expert = torch.searchsorted(group_end, block_start, right=True)  # first run ending after it
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return sorted_ids[:-1], block_expert


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
    *,
    all_local: bool = False,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's experts' part of the MoE output: new `[T, H]` in x's dtype.

    x `[T, H]` (last dim dense, any row stride); w13 `[E, 2I, H]` and w2 `[E, H, I]`
    contiguous, x's dtype; topk_weights `[T, top_k]` fp32; local_ids `[T, top_k]` int32/int64,
    this rank's expert of each pair or -1. `all_local`: the caller knows no id is -1 (tensor
    parallel), so every pair's output row is written and needs no zero fill.

    FP8 experts (Qwen3-MoE FP8 checkpoints): w13 and w2 float8_e4m3fn with their 128×128 block
    scales `w13_scale [E, 2I/128, H/128]` and `w2_scale [E, H/128, I/128]` fp32 (H and I
    multiples of 128). x is then quantized per token and 128-column group before the first
    GEMM, and the activation per pair and group before the second (`kernels.fp8_gemm`).
    """
    fp8 = w13_scale is not None
    if fp8 != (w2_scale is not None):
        raise ValueError("give both w13_scale and w2_scale (fp8 experts) or neither")
    check_device(_moe_gate_up_kernel, x, w13, w2, topk_weights, local_ids)
    check_float("x", x)
    for name, t in (("w13", w13), ("w2", w2)):
        want = FP8_DTYPE if fp8 else x.dtype
        if t.dtype != want:
            raise ValueError(f"{name} is {t.dtype}, expected {want}")
    check_last_dim_contiguous("x", x)
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("w13 and w2 must be contiguous")
    check_index("local_ids", local_ids, 2)
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights must be contiguous float32, got {topk_weights.dtype}")
    num_tokens, hidden = x.shape
    num_experts, two_inter, w_hidden = w13.shape
    inter = two_inter // 2
    if w_hidden != hidden or two_inter % 2 or tuple(w2.shape) != (num_experts, hidden, inter):
        raise ValueError(
            f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit x {tuple(x.shape)}: "
            "expected [E, 2I, H] and [E, H, I]"
        )
    if topk_weights.shape != local_ids.shape or local_ids.shape[0] != num_tokens:
        raise ValueError(
            f"topk_weights {tuple(topk_weights.shape)} and local_ids {tuple(local_ids.shape)} "
            f"must both be [T={num_tokens}, top_k]"
        )
    if fp8:
        _check_fp8_scales(w13_scale, w2_scale, num_experts, hidden, inter)
    top_k = local_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or num_experts == 0:
        return torch.zeros((num_tokens, hidden), dtype=x.dtype, device=x.device)
    meta = launch_meta(x.dtype, interpreting(_moe_gate_up_kernel), fp8)
    if fp8:
        # The fp8 dot takes its operands as they are, even under the interpreter (which
        # multiplies e4m3 exactly); only 16-bit operands need the interpreter's upcast.
        meta["UPCAST_DOT"] = False
    block_m = meta["BLOCK_M"]
    sorted_ids, block_expert = moe_align(local_ids, num_experts, block_m)
    num_blocks = block_expert.shape[0]
    if fp8:
        x_in, x_scale = per_token_group_quant_fp8(x)  # [T, H] e4m3, [T, H / 128] fp32
    else:
        x_in, x_scale, w13_scale, w2_scale = x, x, w13, w2  # scale pointers unused
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [P, I]
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, meta["BLOCK_N"]))](
        act, x_in, w13, sorted_ids, block_expert, x_scale, w13_scale, num_pairs, x_in.stride(0),
        HIDDEN=hidden, INTER=inter, TOP_K=top_k, FP8=fp8, **meta,
    )  # fmt: skip
    if fp8:
        # Rows of pairs in no block (another rank's experts) are garbage here; the down
        # kernel never reads them.
        act, act_scale = per_token_group_quant_fp8(act)  # [P, I] e4m3, [P, I / 128] fp32
    else:
        act_scale = act
    # [P, H]; other ranks' pairs are in no block, so their rows must start at zero.
    alloc = torch.empty if all_local else torch.zeros
    pair_out = alloc((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, meta["BLOCK_N"]))](
        pair_out, act, w2, topk_weights, sorted_ids, block_expert, act_scale, w2_scale,
        num_pairs, HIDDEN=hidden, INTER=inter, FP8=fp8, **meta,
    )  # fmt: skip
    return pair_out.view(num_tokens, top_k, hidden).sum(1, dtype=torch.float32).to(x.dtype)


def _check_fp8_scales(
    w13_scale: torch.Tensor, w2_scale: torch.Tensor, num_experts: int, hidden: int, inter: int
) -> None:
    if hidden % GROUP or inter % GROUP:
        raise ValueError(
            f"fp8 experts need hidden ({hidden}) and intermediate ({inter}) sizes that are "
            f"multiples of {GROUP}"
        )
    expected = (
        ("w13_scale", w13_scale, (num_experts, 2 * inter // GROUP, hidden // GROUP)),
        ("w2_scale", w2_scale, (num_experts, hidden // GROUP, inter // GROUP)),
    )
    for name, t, shape in expected:
        if t.dtype != torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
            raise ValueError(
                f"{name} must be contiguous float32 {shape}, got {t.dtype} {tuple(t.shape)}"
            )


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in plain torch, one expert at a time as the eager model computes it (it reads
    which experts are hit on the host). FP8 experts: each GEMM is `fp8_linear_ref` (the
    activations quantized per token and 128-group, then everything dequantized)."""
    num_tokens, hidden = x.shape
    inter = w2.shape[2]
    out = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
    for expert in local_ids.unique().tolist():
        if expert < 0:
            continue
        token, slot = (local_ids == expert).nonzero(as_tuple=True)
        if w13_scale is None or w2_scale is None:
            gate, up = F.linear(x[token], w13[expert]).split(inter, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert])  # [n, H]
        else:
            gate, up = fp8_linear_ref(x[token], w13[expert], w13_scale[expert]).split(inter, -1)
            y = fp8_linear_ref(F.silu(gate) * up, w2[expert], w2_scale[expert])  # [n, H]
        out.index_add_(0, token, (y * topk_weights[token, slot, None]).to(x.dtype).float())
    return out.to(x.dtype)
