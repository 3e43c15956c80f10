"""Causal attention of a varlen batch of new tokens over their paged K/V context.

Sequence i's new tokens are query rows `query_start_loc[i] : query_start_loc[i+1]` and are the
LAST `q_len` positions of its `seq_lens[i]`-token context, so new token t sits at absolute
position `seq_len - q_len + t` and sees keys `0 ..= seq_len - q_len + t`. The one rule covers a
plain prefill, a prefill after a cached prefix, a later chunk of a chunked prefill and a decode.
The step's own K/V must already be in the cache (`store_kv` first): every key is read from the
pages, whether computed this step or long ago.

Work split (flash-attention style, online softmax in fp32). One program owns one KV head of one
sequence and `BLOCK_M` consecutive new tokens, and computes ALL the query heads of that KV
head's GQA group at once: its rows are `BLOCK_M x GROUP_PAD` (token-major), so each K/V tile is
read from memory once per group instead of once per query head. Keys are walked in tiles of
`BLOCK_N` positions; a tile may straddle pages, so the physical block of every key is looked up
in the block table (any block_size works, 16 or 256 alike). Tiles wholly below the program's
first query are visible to every row and skip the causal mask; only the diagonal tiles pay it.

One binary per geometry, whatever the step: the block table's row stride (the batch's widest
block list) is not specialised on, nor the alignment of the pointers a mixed batch passes as
slices at a varying offset (the rows after its leading decodes: query, output, seq_lens and
block_table), which Triton would otherwise compile new variants for while serving.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

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
)
from kernels._paged_tile import attend_tile

_LOG2E = 1.4426950408889634


@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=[
        "out_ptr", "q_ptr", "query_start_loc_ptr", "seq_lens_ptr", "block_table_ptr",
    ],
)  # fmt: skip
def _prefill_attention_kernel(
    out_ptr,  # [T, num_heads, head_dim] output; strides stride_ot, stride_oh, 1
    q_ptr,  # [T, num_heads, head_dim] queries; strides stride_qt, stride_qh, 1
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] contiguous
    query_start_loc_ptr,  # [B + 1] int32 prefix sums of new tokens per sequence
    seq_lens_ptr,  # [B] int32 context length after this step (cached + new)
    block_table_ptr,  # [B, W] int32 physical block ids, row stride stride_bt
    kv_scale_ptr,  # [2] fp32 (k_scale, v_scale) of an fp8 cache (KV_FP8; else unused)
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_M: tl.constexpr,  # new tokens per program; ROWS = BLOCK_M * GROUP_PAD
    BLOCK_N: tl.constexpr,  # key positions per tile
    BLOCK_SIZE: tl.constexpr,  # tokens per KV page
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Grid: (cdiv(max_query_len, BLOCK_M), B, num_kv_heads).
    m_block = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    # int64: (q_start + tok) * stride grows with the step's token count.
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # this sequence has fewer new tokens than the longest one
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len + m_block * BLOCK_M  # absolute position of the first row token

    ROWS: tl.constexpr = BLOCK_M * GROUP_PAD
    r = tl.arange(0, ROWS)
    tok = m_block * BLOCK_M + r // GROUP_PAD  # [ROWS] new-token index within the sequence
    g = r % GROUP_PAD  # [ROWS] query head within the group
    head = kv_head * GROUP + g  # [ROWS] query head: the GQA mapping h // GROUP == kv_head
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = first_pos + r // GROUP_PAD  # [ROWS]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q_ptrs = q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_scale = tl.load(kv_scale_ptr)
    v_scale = tl.load(kv_scale_ptr + 1)

    # Keys below first_pos are visible to every row (rows past q_len are junk, never stored).
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start, seq_len, k_cache_ptr, v_cache_ptr, table_row,
            kv_head, qk_scale, k_scale, v_scale, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, False, UPCAST_DOT, DOT_PRECISION, KV_FP8,
        )  # fmt: skip
    # The diagonal: up to the last row's own position, and never past the context.
    causal_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    for start in range(full_end, causal_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(
            acc, m_i, l_i, q, q_pos, start, seq_len, k_cache_ptr, v_cache_ptr, table_row,
            kv_head, qk_scale, k_scale, v_scale, stride_cb, stride_cs, stride_ch,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, BLOCK_D, True, UPCAST_DOT, DOT_PRECISION, KV_FP8,
        )  # fmt: skip

    # Every real row saw key 0, so l_i > 0 there; junk rows are masked out of the store.
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch_meta(
    group: int, head_dim: int, block_size: int, dtype: torch.dtype, interpret: bool
) -> dict[str, object]:
    """The kernel's constexprs and launch options for one geometry (shared with the sm_90
    compile test, so that it compiles exactly what the wrapper launches).

    Tiles were chosen by compiling for sm_90 and reading ptxas's register and spill counts (no
    GPU timing yet): 16-bit inputs at head_dim <= 128 take 128 rows x 64 keys on 8 warps
    (tensor cores, ~175 registers, no spills, ~96 KiB of shared memory for 3 stages); wider
    heads halve both. fp32 runs `tl.dot` in "ieee" precision on the FMA units, whose register
    appetite allows only 16 x 16 tiles without spilling: the exact path for fp32 tests, not a
    fast one. Interpreter: small tiles, so that the short sequences CPU tests can afford still
    span several tiles and run both loops.
    """
    # tl.dot needs K >= 16 on NVIDIA GPUs; tiny test heads are padded (masked) up to it.
    block_d = max(16, next_pow2(head_dim))
    if interpret:
        rows, block_n, num_warps, num_stages = 32, 16, 4, 1
    elif dtype == torch.float32:
        rows, block_n, num_warps, num_stages = 16, 16, 4, 2
    elif block_d > 128:
        rows, block_n, num_warps, num_stages = 64, 32, 4, 2
    else:
        rows, block_n, num_warps, num_stages = 128, 64, 8, 3
    group_pad = next_pow2(group)
    return dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=max(1, rows // group_pad),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=num_warps,
        num_stages=num_stages,
        **dot_options(dtype, interpret),
    )


class PrefillLaunch:
    """`paged_prefill_attention` decided and checked for one geometry: grid, constexprs and
    stride arguments, the step's `query_start_loc`, `seq_lens` and `block_table`. Calling it
    only launches, over the per-layer tensors (`plan_prefill_attention` says which may differ).
    Made once per step by the attention backend and called by every layer."""

    def __init__(
        self,
        grid: tuple[int, int, int] | None,
        meta: dict[str, object],
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        scale: float,
    ) -> None:
        self.grid = grid
        self.fp8 = k_cache.dtype == FP8_KV_DTYPE
        self.meta = dict(meta, KV_FP8=self.fp8)
        self.query_start_loc, self.seq_lens, self.block_table = (
            query_start_loc, seq_lens, block_table,
        )  # fmt: skip
        self.qk_scale = scale * _LOG2E
        # The stride arguments but the output's (read from `out` at each launch).
        self.query_strides = (query.stride(0), query.stride(1))
        self.other_strides = (block_table.stride(0), *k_cache.stride()[:3])

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_scales: torch.Tensor | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Attend into `out` (the query's shape and dtype, last dim dense); returns it."""
        if self.grid is None:
            return out
        out_strides = out.stride()
        _prefill_attention_kernel[self.grid](
            out, query, k_cache, v_cache, self.query_start_loc, self.seq_lens,
            self.block_table, kv_scales if self.fp8 else k_cache, self.qk_scale,
            *self.query_strides, out_strides[0], out_strides[1], *self.other_strides, **self.meta,
        )  # fmt: skip
        return out


def plan_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> PrefillLaunch:
    """Every check and decision of `paged_prefill_attention` (same arguments, less `out`). The
    launch may be called with other per-layer tensors than the planned ones if they have their
    layouts (`kernels._common.layout`): `query`, `k_cache`, `v_cache`, `kv_scales`, and an
    `out` that `check_out` accepts for the query."""
    check_device(
        _prefill_attention_kernel,
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
    )
    check_kv_cache(k_cache, v_cache)
    check_float("query", query)
    if query.dim() != 3:
        raise ValueError(f"query must be [T, num_heads, head_dim], got {tuple(query.shape)}")
    check_last_dim_contiguous("query", query)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_head_dim}")
    check_kv_scales(k_cache, query.dtype, kv_scales)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    for name, t, ndim in (
        ("query_start_loc", query_start_loc, 1),
        ("seq_lens", seq_lens, 1),
        ("block_table", block_table, 2),
    ):
        check_index(name, t, ndim, row_stride=name == "block_table")
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} and block_table "
            f"{tuple(block_table.shape)} do not match {num_seqs} sequences"
        )
    meta = launch_meta(
        num_heads // num_kv_heads,
        head_dim,
        block_size,
        query.dtype,
        interpreting(_prefill_attention_kernel),
    )
    grid = None
    if num_tokens and num_seqs and max_query_len > 0:
        grid = (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_seqs, num_kv_heads)
    return PrefillLaunch(grid, meta, query_start_loc, seq_lens, block_table, query, k_cache, scale)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention for new tokens; returns `out`, or a new `[T, num_heads, head_dim]`
    tensor when `out` is None (the query's shape and dtype, last dim dense).

    query `[T, num_heads, head_dim]` (strided rows allowed, last dim dense); caches
    `[num_blocks, block_size, num_kv_heads, head_dim]` contiguous, same dtype as the query;
    query_start_loc `[B+1]`, seq_lens `[B]`, block_table `[B, W]`, all int32. `max_query_len`
    must be at least the longest `q_len` of the batch (the grid is sized from it without reading
    the device); rows of a sequence beyond it would be left unwritten. An fp8 cache needs
    `kv_scales`, as in `paged_decode_attention`. Checks and decides on every call; a caller
    that attends many layers alike plans once (`plan_prefill_attention`).
    """
    launch = plan_prefill_attention(
        query, k_cache, v_cache, query_start_loc, seq_lens, block_table, max_query_len, scale,
        kv_scales,
    )  # fmt: skip
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, heads, dim]
    else:
        check_out(out, query)
    return launch(query, k_cache, v_cache, kv_scales, out)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: `[length, num_kv_heads, head_dim]`."""
    pos = torch.arange(length, device=cache.device)
    return cache[blocks.long()[pos // cache.shape[1]], pos % cache.shape[1]]


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch `paged_prefill_attention`: one sequence at a time, fp32 softmax."""
    del max_query_len  # the reference reads the lengths themselves
    num_heads = query.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(query)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        q = query[start:end].float()  # [q_len, num_heads, head_dim]
        k = dequantized(_gather(k_cache, block_table[i], seq_len), kv_scales, 0)
        v = dequantized(_gather(v_cache, block_table[i], seq_len), kv_scales, 1)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], -math.inf)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
