"""Attention of one new token per sequence over its paged context, split along the context.

A decode batch has one query per sequence, so one program per (sequence, KV head) gives a
small batch with a long context too few programs to fill a GPU: a single 32k-token sequence
would run on 8 of 132 SMs. Split-KV ("flash-decoding") cuts each context into `num_splits`
slices:

- stage 1, grid `(B, num_kv_heads, num_splits)`: each program attends the GQA group of its KV
  head (all `GROUP` query heads as rows of one tile, so each K/V tile is read once per group)
  over its slice, and writes the slice's normalised output and log-sum-exp per query head;
- stage 2, grid `(B, num_heads)`: merges the slices, weighting each by `exp(lse - max lse)`.

With `num_splits == 1` stage 1 writes the final output itself and stage 2 is skipped. A
sequence with `seq_len == 0` (a padding row of a CUDA-graph batch) gets zeros, not NaN.

One binary per geometry, whatever the step: the split count is the grid's third dim (a runtime
value, the single-split case a runtime branch), the merge pads splits to `MAX_SPLITS`, and the
ints and pointers that vary from step to step (the block table's row stride, which is the
batch's widest block list; the split count; `seq_lens` / `block_table` slices of a mixed batch)
are excluded from Triton's specialisation, which would otherwise compile new variants while
serving.

Stage 1 has two kernels, and the tile is not fixed: the decode table (`kernels.attention_tables`,
measured on a GPU by `benchmarks/gpu/decode_tiles.py`) maps the batch size, the context bound and
the KV dtype to this module's split kernel or `decode_attention_packed`'s (several KV heads per
program) and to a tile; without an entry, `launch_meta`'s defaults. So a geometry has one binary
per tile its table names (a CUDA graph captures each batch size's choice).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels import decode_attention_packed as packed
from kernels._common import (
    FP8_KV_DTYPE,
    check_device,
    check_float,
    check_index,
    check_kv_cache,
    check_kv_scales,
    check_last_dim_contiguous,
    check_out,
    dequantized,
    dot_options,
    interpreting,
    next_pow2,
    num_sms,
)
from kernels._paged_tile import attend_tile
from kernels.attention_tables import Tile, decode_tile

_LOG2E = 1.4426950408889634
# Below this many context tokens per slice, the partial writes and the merge cost more than the
# extra parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 64


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int) -> int:
    """Slices per context so that stage 1 runs about two waves of programs on `sm_count` SMs.

    One sequence of 32k tokens with 8 KV heads on 132 SMs -> 33 splits; a batch of 64 such
    sequences -> 1. Never cuts slices shorter than `MIN_TOKENS_PER_SPLIT` tokens.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(2 * sm_count, programs)
    by_length = triton.cdiv(max(max_context_len, 1), MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_SPLITS))


@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "block_table_ptr"],
)
def _decode_split_kernel(
    out_ptr,  # [B, num_heads, head_dim] final output (written only when num_splits == 1)
    part_out_ptr,  # [B, num_heads, num_splits, head_dim] fp32 per-slice normalised output
    part_lse_ptr,  # [B, num_heads, num_splits] fp32 per-slice log2-sum-exp2 (-inf: empty)
    q_ptr,  # [B, num_heads, head_dim] queries; strides stride_qb, stride_qh, 1
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    seq_lens_ptr,  # [B] int32 context length including the new token
    block_table_ptr,  # [B, W] int32 physical block ids, row stride stride_bt
    kv_scale_ptr,  # [2] fp32 (k_scale, v_scale) of an fp8 cache (KV_FP8; else unused)
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two, at least 16 (tl.dot's minimum M)
    BLOCK_N: tl.constexpr,  # key positions per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per KV page
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The split count is the grid's third dim, not a constexpr: an automatic choice that varies
    # with batch size and context would otherwise compile a new kernel per value mid-serving.
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Slices are whole tiles, so a tile never straddles two slices and only the context's last
    # tile needs a length mask.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    full_end = tl.minimum(end, (seq_len // BLOCK_N) * BLOCK_N)

    g = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + g  # [BLOCK_H] query heads of this KV head's group
    row_ok = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    q_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (seq_len - 1)  # the new token is the last

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_scale = tl.load(kv_scale_ptr)
    v_scale = tl.load(kv_scale_ptr + 1)
    for tile in range(start, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, table_row,
            kv_head, qk_scale, k_scale, v_scale, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, False, UPCAST_DOT, DOT_PRECISION, KV_FP8,
        )  # fmt: skip
    for tile in range(tl.maximum(start, full_end), end, BLOCK_N):  # the ragged last tile
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, tile, seq_len, k_cache_ptr, v_cache_ptr, table_row,
            kv_head, qk_scale, k_scale, v_scale, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, True, UPCAST_DOT, DOT_PRECISION, KV_FP8,
        )  # fmt: skip

    # An empty slice (short context, or seq_len == 0) has l_i == 0: output 0, lse -inf, so the
    # merge gives it zero weight.
    nonempty = l_i > 0.0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    if num_splits == 1:  # a runtime branch: both cases are one binary
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_H]
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        p_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :]
        tl.store(p_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr,  # [B, num_heads, head_dim] final output; strides stride_ob, stride_oh, 1
    part_out_ptr,  # [B, num_heads, num_splits, head_dim] fp32 per-slice normalised output
    part_lse_ptr,  # [B, num_heads, num_splits] fp32 per-slice log2-sum-exp2 (-inf: empty)
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # MAX_SPLITS rounded up to a power of two (one binary for all)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Grid: (B, num_heads).
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    row = seq.to(tl.int64) * NUM_HEADS + head
    lse = tl.load(part_lse_ptr + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    # All slices empty (seq_len == 0): subtracting a finite 0 keeps exp2 at 0 instead of NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # [SPLITS_PAD]
    o_mask = (s[:, None] < num_splits) & (d[None, :] < HEAD_DIM)
    parts = tl.load(
        part_out_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :],
        mask=o_mask,
        other=0.0,
    )  # [SPLITS_PAD, BLOCK_D]
    w_sum = tl.sum(w, 0)
    o = tl.sum(w[:, None] * parts, 0) / tl.where(w_sum > 0.0, w_sum, 1.0)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def launch_meta(
    group: int,
    num_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    interpret: bool,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> dict[str, object]:
    """Stage 1's constexprs and launch options (shared with the sm_90 compile test, so that it
    compiles exactly what the wrapper launches). `block_n`, `num_warps`, `num_stages`: a tile
    from the decode table (`kernels.attention_tables`), in place of the defaults below.

    Decode is bandwidth bound: 128-key tiles on 8 warps in 3 stages keep the most loads in
    flight. Measured on an H200 (`benchmarks/gpu/decode_tiles.py`, Qwen3-0.6B's heads, bf16;
    benchmarks/results/h200/): faster than the 64-key, 4-warp tile shipped before at every
    shape timed, 21% at 64 x 4k tokens, 5% at 256 x 4k, 3% for one 16k sequence, 0.6% at
    256 x 1k. Wide heads take 32-key tiles; fp32 ("ieee" dot on FMA units) 32-key tiles on 8
    warps to stay clear of spills (both from ptxas's register counts, not timed). The
    interpreter uses 16-key tiles so short CPU-test contexts still span several tiles and
    splits.
    """
    block_d = max(16, next_pow2(head_dim))  # tl.dot's minimum K on NVIDIA GPUs
    if interpret:
        default = 16, 4, 1
    elif dtype == torch.float32:
        default = 32, 8, 2
    elif block_d > 128:
        default = 32, 4, 2
    else:
        default = 128, 8, 3
    return dict(
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),  # tl.dot's minimum M on NVIDIA GPUs
        BLOCK_N=block_n or default[0],
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=num_warps or default[1],
        num_stages=num_stages or default[2],
        **dot_options(dtype, interpret),
    )


class DecodeLaunch:
    """`paged_decode_attention` decided and checked for one geometry: the kernel, its grid,
    constexprs and stride arguments, the split buffers, the step's `seq_lens` and
    `block_table`. Calling it only launches, over the per-layer tensors (`plan_decode_attention`
    says which may differ).

    Made once per step by the attention backend (`rank_worker.attention.triton_plan`) and
    called by every layer: the split buffers are shared by the layers, which is safe because
    each layer's merge reads them before the next layer's stage 1 writes them (one stream, in
    order; a CUDA graph keeps that order).
    """

    def __init__(
        self,
        kernel: Any,  # a @triton.jit function: the split kernel or the packed one
        num_seqs: int,
        heads_dim: int,
        num_splits: int,
        num_heads: int,
        head_dim: int,
        meta: dict[str, object],
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        scale: float,
    ) -> None:
        self.kernel = kernel
        self.num_seqs = num_seqs
        self.num_splits = num_splits
        self.grid = (num_seqs, heads_dim, num_splits)
        self.merge_grid = (num_seqs, num_heads)
        self.fp8 = k_cache.dtype == FP8_KV_DTYPE
        self.meta = dict(meta, KV_FP8=self.fp8)
        self.merge_meta = dict(
            NUM_HEADS=num_heads, SPLITS_PAD=next_pow2(MAX_SPLITS), HEAD_DIM=head_dim,
            BLOCK_D=meta["BLOCK_D"], num_warps=4,
        )  # fmt: skip
        self.seq_lens, self.block_table = seq_lens, block_table
        device = query.device
        if num_splits > 1:
            # [B, num_heads, num_splits, head_dim] / [B, num_heads, num_splits], fp32 whatever
            # the input dtype: the merge must not round each slice's output to 8 mantissa bits.
            shape = (num_seqs, num_heads, num_splits)
            self.part_out = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
            self.part_lse = torch.empty(shape, dtype=torch.float32, device=device)
        else:
            # Unused with one split, but fp32 like the real ones: a pointer's dtype is part of
            # the kernel's specialisation.
            self.part_out = self.part_lse = torch.empty(1, dtype=torch.float32, device=device)
        # The stride arguments but the output's (read from `out` at each launch): the query's
        # row and head strides, the table's row stride, the cache's.
        self.query_strides = (query.stride(0), query.stride(1))
        self.other_strides = (block_table.stride(0), *k_cache.stride()[:3])
        self.qk_scale = scale * _LOG2E

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attend into `out` (the query's shape and dtype, last dim dense); returns it."""
        if self.num_seqs == 0:
            return out
        out_strides = out.stride()
        self.kernel[self.grid](
            out, self.part_out, self.part_lse, query, k_cache, v_cache, self.seq_lens,
            self.block_table, kv_scales if self.fp8 else k_cache, self.qk_scale,
            *self.query_strides, out_strides[0], out_strides[1], *self.other_strides, **self.meta,
        )  # fmt: skip
        if self.num_splits > 1:
            _decode_merge_kernel[self.merge_grid](
                out, self.part_out, self.part_lse, out_strides[0], out_strides[1],
                self.num_splits, **self.merge_meta,
            )  # fmt: skip
        return out


def plan_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
    tile: Tile | None = None,
) -> DecodeLaunch:
    """Every check and decision of `paged_decode_attention` (same arguments, less `out`).

    The launch it returns may be called with other per-layer tensors than the ones it was
    planned with, if they have their layouts (`kernels._common.layout`): `query` (or one whose
    first `num_seqs` rows are laid out as the planned query: the kernel reads rows by program
    id), `k_cache`, `v_cache`, `kv_scales`, and an `out` that `check_out` accepts for the
    query (or whose first rows it does).
    """
    check_device(_decode_split_kernel, query, k_cache, v_cache, seq_lens, block_table)
    check_kv_cache(k_cache, v_cache)
    check_float("query", query)
    if query.dim() != 3:
        raise ValueError(f"query must be [B, num_heads, head_dim], got {tuple(query.shape)}")
    check_last_dim_contiguous("query", query)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    check_kv_scales(k_cache, query.dtype, kv_scales)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    for name, t, ndim in (("seq_lens", seq_lens, 1), ("block_table", block_table, 2)):
        check_index(name, t, ndim, row_stride=name == "block_table")
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    if seq_lens.shape[0] != num_seqs or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"seq_lens {tuple(seq_lens.shape)} and block_table {tuple(block_table.shape)} "
            f"do not match {num_seqs} queries"
        )
    interpret = interpreting(_decode_split_kernel)
    group = num_heads // num_kv_heads
    context_bound = block_table.shape[1] * block_size
    if tile is None:  # the kernel and tile the decode table names for this shape
        tile = decode_tile(
            num_seqs, context_bound, k_cache.dtype, head_dim, query.device, interpret
        )
    tile_args = (tile.block_n, tile.num_warps, tile.num_stages)
    if tile.kernel == "packed":
        kernel = packed._decode_packed_kernel
        heads_dim = packed.grid_heads(group, num_kv_heads)
        meta = packed.launch_meta(
            group, num_heads, head_dim, block_size, query.dtype, interpret, *tile_args
        )
    else:
        kernel = _decode_split_kernel
        heads_dim = num_kv_heads
        meta = launch_meta(
            group, num_heads, head_dim, block_size, query.dtype, interpret, *tile_args
        )
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, heads_dim, context_bound, num_sms(query.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return DecodeLaunch(
        kernel, num_seqs, heads_dim, num_splits, num_heads, head_dim, meta, seq_lens,
        block_table, query, k_cache, scale,
    )  # fmt: skip


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Attention of `query [B, num_heads, head_dim]` (one new token per sequence, already stored
    in the cache) over each sequence's `seq_lens[i]` cached tokens; returns `out`, or a new
    tensor when `out` is None.

    Caches `[num_blocks, block_size, num_kv_heads, head_dim]` contiguous, same dtype as the
    query; seq_lens `[B]` and block_table `[B, W]` int32. `num_splits=None` picks the split
    count from the batch size and `W * block_size`, an upper bound of the longest context read
    from shapes alone: no device sync, and a CUDA graph captured for a fixed W keeps its grid.
    `out`: the query's shape and dtype, last dim dense (e.g. rows of a larger output).
    An fp8 cache (float8_e4m3fn, any query dtype) needs `kv_scales [2]` fp32: `(k_scale,
    v_scale)`, the cache holds `K / k_scale` (`kernels._common.check_kv_scales`).
    `tile`: the kernel and tile to launch instead of the decode table's (the sweep times each).
    Checks and decides on every call; a caller that attends many layers alike plans once
    (`plan_decode_attention`) and calls the launch per layer.
    """
    launch = plan_decode_attention(
        query, k_cache, v_cache, seq_lens, block_table, scale, num_splits, kv_scales, tile
    )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [B, heads, dim]
    else:
        check_out(out, query)
    return launch(query, k_cache, v_cache, kv_scales, out)


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_decode_attention` (no splits): one sequence at a time, fp32 softmax.
    A sequence with `seq_len == 0` gets zeros, as in the kernel."""
    del num_splits  # splitting changes the summation order, not the result
    num_heads = query.shape[1]
    block_size = k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.zeros_like(query)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(seq_len, device=query.device)
        blocks = block_table[i].long()[pos // block_size]
        k = dequantized(k_cache[blocks, pos % block_size], kv_scales, 0)
        v = dequantized(v_cache[blocks, pos % block_size], kv_scales, 1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,khd->hk", query[i].float(), k) * scale  # [heads, seq_len]
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v).to(query.dtype)
    return out
