"""Causal attention of fresh prompts (no cached prefix) from the step's own dense K/V, through
TMA descriptors: the Hopper candidate beside `prefill_attention`'s paged kernel.

A fresh prompt's keys are exactly the step's new tokens, which the QKV projection has just
written densely: `key [T, num_kv_heads, head_dim]` rows `query_start_loc[i] : [i+1]` (the
cache holds the same values, stored first). Read from there, a tile of keys is one rectangle of
memory, which Hopper's Tensor Memory Accelerator copies into shared memory by itself from a
descriptor, with no address arithmetic or per-element masks in the program's warps; the paged
cache, with 16-token pages in any order, cannot be read that way (TMA gathers come with
Blackwell). Prefix hits and later chunks of a chunked prefill need paged reads and stay on
`prefill_attention`; so does an fp8 cache (the dense K/V are not the quantized values decode
will read).

As in Triton's tutorial 06 (fused attention) on sm_90: host-side `TensorDescriptor`s for Q, K
and V; one program per (BLOCK_M queries, sequence, query head), K/V of its head's KV head
(`head // GROUP`); keys below the program's first query in an unmasked loop, the diagonal
block in a masked one; `tl.range(..., warp_specialize=WARP_SPECIALIZE)` asks the compiler to
split the loop into producer (TMA) and consumer (tensor-core) warps. What that does on sm_90
depends on the Triton version: 3.9 (this repository's CPU checks) emits the same PTX as without
it at 8 warps and fails in its NVGPUWarpSpecialization pass at 4 warps, so the sweep's
warp-specialized candidates are 8-warp ones and the GPU's Triton (3.6 on the lent machines)
decides, by measurement, whether they are worth anything. The sequences of a step are
concatenated, so a tile may run past its sequence's rows into the next one's (or past T, which
TMA fills with zeros): those keys are masked and those query rows never stored. The output is
written with a masked store, not a TMA store, for the same reason.

Descriptors need 16-byte aligned bases and row strides and a power-of-two head_dim;
`unusable_reason` says when the inputs do not allow them (the backend then takes the paged
kernel). The interpreter runs the kernel (descriptors included), which is how CPU tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels._common import check_index, check_out, dot_options, interpreting
from kernels.attention_tables import Tile

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize_on_alignment=["out_ptr", "query_start_loc_ptr"])
def _fresh_prefill_kernel(
    desc_q,  # descriptor over query [T, num_heads * head_dim], block [BLOCK_M, HEAD_DIM]
    desc_k,  # descriptor over key [T, num_kv_heads * head_dim], block [BLOCK_N, HEAD_DIM]
    desc_v,  # descriptor over value, as desc_k
    out_ptr,  # [T, num_heads, head_dim] output; strides stride_ot, stride_oh, 1
    query_start_loc_ptr,  # [B + 1] int32 prefix sums of the prompts' lengths
    qk_scale,  # softmax scale * log2(e)
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # queries per program
    BLOCK_N: tl.constexpr,  # keys per tile (divides BLOCK_M)
    HEAD_DIM: tl.constexpr,  # a power of two
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    # Grid: (cdiv(max_query_len, BLOCK_M), B, num_heads). The last query block, which attends
    # the most keys, is launched first: the short ones then fill the tail of the wave.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first = m_block * BLOCK_M  # the program's first query = its position (a fresh prompt)
    if first >= q_len:
        return
    kv_col = (head // GROUP) * HEAD_DIM
    q = desc_q.load([q_start + first, head * HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
    if UPCAST_DOT:
        q = q.to(tl.float32)
    pos_m = first + tl.arange(0, BLOCK_M)  # [BLOCK_M] query positions
    offs_n = tl.arange(0, BLOCK_N)

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys below `first` are in the prompt and visible to every row: no mask.
    for start in tl.range(0, first, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([q_start + start, kv_col])  # [BLOCK_N, HEAD_DIM]
        v = desc_v.load([q_start + start, kv_col])
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    # The diagonal block: causal, and never past the prompt (the rows after it are the next
    # prompt's, or TMA's zero fill past T).
    for start in tl.range(first, tl.minimum(first + BLOCK_M, q_len), BLOCK_N):
        k = desc_k.load([q_start + start, kv_col])
        v = desc_v.load([q_start + start, kv_col])
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k.T, input_precision=DOT_PRECISION) * qk_scale
        pos_n = start + offs_n
        visible = (pos_n[None, :] <= pos_m[:, None]) & (pos_n[None, :] < q_len)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # m_i starts finite: a row that sees nothing here gets exp2(-inf) = 0, never NaN.
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every row saw key 0, so l_i > 0; rows past the prompt are not stored.
    out = acc / l_i[:, None]
    d = tl.arange(0, HEAD_DIM)
    o_ptrs = out_ptr + (q_start + pos_m).to(tl.int64)[:, None] * stride_ot + head * stride_oh
    row_ok = pos_m < q_len
    tl.store(o_ptrs + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def launch_meta(
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    interpret: bool,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    warp_specialize: bool | None = None,
) -> dict[str, object]:
    """Constexprs and launch options (shared with the sm_90 compile test); a prefill table's
    tile (`kernels.attention_tables`) replaces the defaults.

    Default on a GPU: 128 queries x 64 keys on 8 warps in 3 stages, no warp specialization
    (shared memory: Q 32 KiB + 3 x (K + V) 16 KiB each = 128 KiB at head_dim 128 bf16; chosen
    from ptxas's counts for sm_90, not timed: the lease's sweep times the others). fp32 runs
    "ieee" dots on the FMA units: 32 x 32. Interpreter: 16 x 16, so short CPU-test prompts span
    several blocks and tiles.
    """
    if interpret:
        default = 16, 16, 4, 1
    elif dtype == torch.float32:
        default = 32, 32, 4, 2
    elif head_dim > 128:
        default = 64, 32, 4, 2
    else:
        default = 128, 64, 8, 3
    return dict(
        GROUP=group,
        BLOCK_M=block_m or default[0],
        BLOCK_N=min(block_n or default[1], block_m or default[0]),
        HEAD_DIM=head_dim,
        num_warps=num_warps or default[2],
        num_stages=num_stages or default[3],
        WARP_SPECIALIZE=bool(warp_specialize),
        **dot_options(dtype, interpret),
    )


def interpreted() -> bool:
    """Whether this kernel runs under the Triton interpreter (as `kernels._common.interpreting`)."""
    return interpreting(_fresh_prefill_kernel)


def unusable_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why descriptors cannot cover these tensors (None: they can). query `[T, H, D]`,
    key/value `[T, KV, D]`, each with its heads dense in a row (a view of the QKV output is)."""
    head_dim = query.shape[-1]
    if head_dim & (head_dim - 1) or head_dim < 16 or head_dim > 256:
        return f"head_dim {head_dim} is not a power of two in [16, 256]"
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[-1] != head_dim:
            return f"{name} must be [T, heads, {head_dim}], got {tuple(t.shape)}"
        if t.stride(2) != 1 or t.stride(1) != head_dim:
            return f"{name}'s heads are not dense in a row (strides {t.stride()})"
        esize = t.element_size()
        if t.data_ptr() % 16 or (t.stride(0) * esize) % 16:
            return f"{name} is not 16-byte aligned (TMA needs aligned bases and row strides)"
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return f"key/value {key.dtype} differ from the query's {query.dtype}"
    return None


def fresh_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Causal attention of fresh prompts: sequence i is rows `query_start_loc[i] : [i+1]` of
    query `[T, num_heads, head_dim]` and of key/value `[T, num_kv_heads, head_dim]` (no cached
    prefix: its keys are its own rows). `max_query_len`: at least the longest prompt. Returns
    `out` (or a new tensor). `tile`: a `kernels.attention_tables.Tile` instead of the defaults.
    """
    reason = unusable_reason(query, key, value)
    if reason is not None:
        raise ValueError(f"fresh_prefill_attention: {reason}")
    devices = {t.device for t in (query, key, value, query_start_loc)}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {devices}")
    interpret = interpreting(_fresh_prefill_kernel)
    if query.device.type != "cuda" and not interpret:
        raise ValueError("fresh_prefill_attention needs CUDA tensors (or TRITON_INTERPRET=1)")
    check_index("query_start_loc", query_start_loc, 1)
    if query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32, got {query_start_loc.dtype}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_heads % num_kv_heads or key.shape != value.shape or key.shape[0] != num_tokens:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit key {tuple(key.shape)} / value "
            f"{tuple(value.shape)}"
        )
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    else:
        check_out(out, query)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs <= 0 or max_query_len <= 0:
        return out
    fields = ("block_m", "block_n", "num_warps", "num_stages", "warp_specialize")
    tile_args = [getattr(tile, f) if tile is not None else None for f in fields]
    meta = launch_meta(num_heads // num_kv_heads, head_dim, query.dtype, interpret, *tile_args)

    def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
        # [T, heads * head_dim] with the row stride of the (possibly wider) QKV rows.
        shape = [t.shape[0], t.shape[1] * head_dim]
        return TensorDescriptor(t, shape, [t.stride(0), 1], [rows, head_dim])

    grid = (triton.cdiv(max_query_len, meta["BLOCK_M"]), num_seqs, num_heads)
    _fresh_prefill_kernel[grid](
        descriptor(query, meta["BLOCK_M"]),
        descriptor(key, meta["BLOCK_N"]),
        descriptor(value, meta["BLOCK_N"]),
        out,
        query_start_loc,
        scale * _LOG2E,
        out.stride(0),
        out.stride(1),
        **meta,
    )
    return out
