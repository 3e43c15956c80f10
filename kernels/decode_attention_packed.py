"""Decode attention's second stage-1 kernel: several KV heads per program ("packed").

`decode_attention._decode_split_kernel` gives each program one KV head and its GQA group as the
rows of a `tl.dot`, padded to 16 rows (the tensor cores' minimum M): with Qwen3-0.6B's groups of
2, 14 of every 16 rows are padding, and 256 sequences x 8 KV heads make 2,048 short programs
whose start-up and epilogue are paid per head. This kernel fills the padding with the groups of
the next KV heads instead: a program owns `KV_PER` consecutive KV heads of one sequence, whose
`KV_PER * GROUP` query heads are consecutive (head h belongs to KV head h // GROUP) and form the
rows of one tile, e.g. all 8 KV heads (16 query heads) of Qwen3-0.6B in one program.

Each tile loads `BLOCK_N` keys of all `KV_PER` heads: for one key those heads' vectors are
adjacent in the cache (`[.., slot, kv_head, head_dim]`), so a key's load is one run of
`KV_PER * head_dim` elements (2 KiB for 8 bf16 heads of 128) instead of 256 bytes. The tile's
columns are (key, head) pairs, key-major; the score of row r against column c is kept only when
c's head is r's own KV head (a block-diagonal mask), so every row still attends exactly its own
head's keys and the dot's extra products land in rows that were padding before.

Everything else is the split kernel's: the same split-KV slices (whole tiles, runtime count),
the same partial layout, so `decode_attention._decode_merge_kernel` merges both; the same
log2-domain online softmax; an fp8 cache is dequantized on load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import dot_options, next_pow2

# Tensor cores multiply at least 16 rows: the query rows a program fills before padding.
MIN_DOT_ROWS = 16


@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=["seq_lens_ptr", "block_table_ptr"],
)
def _decode_packed_kernel(
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
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    KV_PER: tl.constexpr,  # KV heads per program (a power of two)
    BLOCK_H: tl.constexpr,  # KV_PER * GROUP rows padded to a power of two, at least 16
    BLOCK_N: tl.constexpr,  # keys per tile; the tile has BLOCK_N * KV_PER (key, head) columns
    BLOCK_SIZE: tl.constexpr,  # tokens per KV page
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    # Grid: (B, cdiv(num_kv_heads, KV_PER), num_splits).
    seq = tl.program_id(0)
    kv_base = tl.program_id(1) * KV_PER
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Slices of whole tiles, as in the split kernel (the merge relies on the same partition).
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    r = tl.arange(0, BLOCK_H)
    head = kv_base * GROUP + r  # [BLOCK_H] query heads of the program's KV heads, consecutive
    row_ok = (r < KV_PER * GROUP) & (head < NUM_HEADS)
    row_kv = r // GROUP  # [BLOCK_H] each row's KV head, 0..KV_PER-1 within the program
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    COLS: tl.constexpr = BLOCK_N * KV_PER
    c = tl.arange(0, COLS)
    c_key = c // KV_PER  # [COLS] key within the tile (key-major: a key's heads are adjacent)
    c_kv = c % KV_PER  # [COLS] KV head within the program
    col_head_ok = kv_base + c_kv < NUM_KV_HEADS  # the last program of an odd head count
    own_head = row_kv[:, None] == c_kv[None, :]  # [BLOCK_H, COLS] the block-diagonal mask

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_scale = tl.load(kv_scale_ptr)
    v_scale = tl.load(kv_scale_ptr + 1)
    for tile in range(start, end, BLOCK_N):
        n = tile + c_key  # [COLS] key positions
        in_ctx = n < end
        n_ok = in_ctx & col_head_ok
        block_ids = tl.load(table_row + n // BLOCK_SIZE, mask=in_ctx, other=0)
        # int64 before the multiply: block_id * stride_cb overflows int32 in large caches.
        kv_off = (
            block_ids.to(tl.int64) * stride_cb
            + (n % BLOCK_SIZE) * stride_cs
            + (kv_base + c_kv) * stride_ch
        )
        kv_ptrs = kv_off[:, None] + d[None, :]  # [COLS, BLOCK_D]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, COLS]
        s = tl.where(own_head & n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # m_i starts finite, so a row that sees nothing in a tile gets exp2(-inf) = 0, not NaN.
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    if num_splits == 1:
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_row = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits + split  # [BLOCK_H]
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)
        p_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + d[None, :]
        tl.store(p_ptrs, o, mask=row_ok[:, None] & d_ok[None, :])


def kv_heads_per_program(group: int, num_kv_heads: int) -> int:
    """KV heads one program takes: as many groups as fit in the tensor cores' 16 rows (a power of
    two, at least 1), never more than the rank has."""
    per = 1
    while 2 * per * group <= MIN_DOT_ROWS and per < num_kv_heads:
        per *= 2
    return per


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
    """The packed kernel's constexprs and launch options (shared with the sm_90 compile test).

    `block_n` here counts (key, head) rows of a tile, as `decode_attention.launch_meta`'s counts
    keys: 128 rows by default (16 keys of 8 heads for Qwen3-0.6B), the split kernel's K/V tile
    size, on 8 warps in 3 stages: 72.5 KiB of shared memory compiled for sm_90 at head_dim 128,
    the split kernel's default tile's figure (not timed: the lease's sweep times it against the
    others). fp32: 32 rows, as the split kernel. The interpreter: 32 rows, so short CPU-test
    contexts span several tiles.
    """
    num_kv_heads = num_heads // group
    kv_per = kv_heads_per_program(group, num_kv_heads)
    block_d = max(16, next_pow2(head_dim))
    if interpret:
        rows, warps, stages = 32, 4, 1
    elif dtype == torch.float32:
        rows, warps, stages = 32, 8, 2
    elif block_d > 128:
        rows, warps, stages = 32, 4, 2
    else:
        rows, warps, stages = 128, 8, 3
    rows = block_n or rows
    return dict(
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        KV_PER=kv_per,
        BLOCK_H=max(MIN_DOT_ROWS, next_pow2(kv_per * group)),
        BLOCK_N=max(1, rows // kv_per),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
        **dot_options(dtype, interpret),
    )


def grid_heads(group: int, num_kv_heads: int) -> int:
    """Programs per sequence and split: the grid's second dim."""
    return triton.cdiv(num_kv_heads, kv_heads_per_program(group, num_kv_heads))
