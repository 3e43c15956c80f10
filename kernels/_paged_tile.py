"""The inner step shared by the paged attention kernels: one K/V tile into an online softmax.

Scores live in the log2 domain (the softmax scale is pre-multiplied by log2(e)) so that the
kernels can use `exp2`, which is one instruction on NVIDIA GPUs. The running state is
`(acc, m_i, l_i)`: the unnormalised output, the row max and the row sum of `exp2(s - m_i)`; the
final output of a row is `acc / l_i` (Milakov & Gimelshein 2018, FlashAttention 2022).
"""

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    acc,  # [ROWS, BLOCK_D] fp32 running sum of p @ V
    m_i,  # [ROWS] fp32 running row max of the log2-scaled scores
    l_i,  # [ROWS] fp32 running row sum of exp2(score - m_i)
    q,  # [ROWS, BLOCK_D] queries of the program, in the dot dtype
    q_pos,  # [ROWS] int32 absolute position of each row's token
    start,  # first key position of this tile
    seq_len,
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table_row_ptr,  # [W] this sequence's physical block ids
    kv_head,
    qk_scale,  # softmax scale * log2(e): scores go straight to exp2
    k_scale,  # KV_FP8: fp32 dequantization scale of this layer's K (cache value * k_scale)
    v_scale,  # KV_FP8: the same for V
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,  # False for tiles every row sees whole (no causal or length mask)
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,  # the caches hold float8_e4m3fn: dequantized to q's dtype on load
):
    n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    d = tl.arange(0, BLOCK_D)
    if MASKED:
        n_ok = n < seq_len
        block_ids = tl.load(block_table_row_ptr + n // BLOCK_SIZE, mask=n_ok, other=0)
    else:
        n_ok = n >= 0  # every key of an unmasked tile lies inside the context
        block_ids = tl.load(block_table_row_ptr + n // BLOCK_SIZE)
    # int64 before the multiply: block_id * stride_cb overflows int32 in caches over 2**31 elems.
    kv_off = block_ids.to(tl.int64) * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    kv_mask = n_ok[:, None] & (d[None, :] < HEAD_DIM)
    kv_ptrs = kv_off[:, None] + d[None, :]  # [BLOCK_N, BLOCK_D]
    k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)
    if KV_FP8:
        # Dequantized in registers: the cache's bytes are what is read from memory.
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    if UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, BLOCK_N]
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # m_i starts finite (-1e30), so a row that sees nothing in a tile gives exp2(-inf) = 0, never
    # exp2(-inf - -inf) = NaN.
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i
