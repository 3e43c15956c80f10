"""FP8 kernels against their plain-torch references, under the Triton interpreter on CPU (and
natively on a GPU, `gpu` marks): activation quantization, the block-scaled W8A8 GEMM, the fused
MoE with fp8 experts, and the fp8 KV cache in store_kv and both attention kernels.

Triton 3.5's interpreter runs `tl.dot` on float8_e4m3fn operands as they are (exact products
into fp32), so the interpreted kernels take the fp8 dot path a GPU takes; only its fp32 -> e4m3
cast is wrong for values that round up across a power of two, which `kernels._fp8_cast` works
around under the interpreter (tested here: quantization must be bit-exact).

Tolerances: quantization is bit-exact (same arithmetic, same order). The GEMMs sum the same
fp32 products in another order: ~1e-6 relative under the interpreter. On a GPU, Hopper's fp8
tensor cores accumulate each 128-wide group's dot with about 14 bits of mantissa before the
kernel adds it into fp32 (DeepSeek-V3's report; seen on an H200: 7e-4 at K = 4096 on outputs of
size ~1), so the GEMMs get `GPU_GEMM_TOL` there, which a wrong scale or group still exceeds
(`test_gpu_gemm_tolerance_catches_a_wrong_scale`). Attention dequantizes the same e4m3 values as
its reference: the kernels' usual fp32 tolerance.
"""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kernels.fp8_gemm import (
    dequantize_block_fp8,
    fp8_linear,
    fp8_linear_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    quantize_block_fp8,
    w8a8_block_fp8_matmul,
    w8a8_block_fp8_matmul_ref,
)
from kernels.fused_moe import fused_moe, fused_moe_ref
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.store_kv import store_kv, store_kv_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
GPU = pytest.mark.gpu
GPU_GEMM_TOL = dict(atol=4e-3, rtol=1e-3)
GEMM_TOL = GPU_GEMM_TOL if DEVICE == "cuda" else dict(atol=1e-5, rtol=1e-5)
MOE_TOL = GPU_GEMM_TOL if DEVICE == "cuda" else dict(atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1, 128), (7, 384), pytest.param((300, 4096), marks=GPU)])
def test_token_group_quant_is_exact(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))
    x[0, :128] = 0.0  # an all-zero group: finite scale, zeros out
    x = x.to(dtype=dtype, device=DEVICE)
    q, s = per_token_group_quant_fp8(x)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x)
    assert q.dtype == FP8 and s.shape == (shape[0], shape[1] // 128)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # The scale maps each group's largest magnitude to e4m3's 448; the zero group stays zero.
    group_max = q.float().abs().view(shape[0], -1, 128).amax(-1)
    assert float(group_max[0, 0]) == 0.0
    assert bool((group_max.flatten()[1:] == 448.0).all())


def test_quantization_refuses_ragged_groups():
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_group_quant_fp8_ref(torch.zeros(2, 100))


@pytest.mark.parametrize(
    ("tokens", "n", "k"),
    [(1, 128, 128), (5, 200, 256), (17, 384, 384), pytest.param(256, 4096, 4096, marks=GPU)],
)
def test_w8a8_gemm_matches_reference(tokens, n, k):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, k, generator=g).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DEVICE)
    wq, ws = quantize_block_fp8(w)
    xq, xs = per_token_group_quant_fp8(x)
    out = w8a8_block_fp8_matmul(xq, xs, wq, ws, torch.float32)
    ref = w8a8_block_fp8_matmul_ref(xq, xs, wq, ws, torch.float32)
    torch.testing.assert_close(out, ref, **GEMM_TOL)
    torch.testing.assert_close(fp8_linear(x, wq, ws), fp8_linear_ref(x, wq, ws), **GEMM_TOL)
    # And the W8A8 product is the unquantized one up to e4m3's resolution (~6% per value,
    # averaging out over k): not a test of the kernel, of the quantization's scale layout.
    exact = x @ w.T
    assert float((ref - exact).norm() / exact.norm()) < 0.05


def test_gpu_gemm_tolerance_catches_a_wrong_scale():
    """The GPU's looser tolerance still fails a kernel that reads one block's scale wrong (a
    neighbouring weight block's, or an activation group's neighbour), at the GPU test's shape."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4096, generator=g)
    w = torch.randn(4096, 4096, generator=g) / 4096**0.5
    wq, ws = quantize_block_fp8(w)
    xq, xs = per_token_group_quant_fp8_ref(x)
    ref = w8a8_block_fp8_matmul_ref(xq, xs, wq, ws, torch.float32)
    ws_wrong = ws.clone()
    ws_wrong[3, 7] = ws[3, 8]
    xs_wrong = xs.clone()
    xs_wrong[5, 2] = xs[5, 3]
    for args in ((xq, xs, wq, ws_wrong), (xq, xs_wrong, wq, ws)):
        wrong = w8a8_block_fp8_matmul_ref(*args, torch.float32)
        assert not torch.allclose(wrong, ref, **GPU_GEMM_TOL)


def test_block_quantization_round_trip_with_partial_blocks():
    w = torch.randn(200, 300)
    q, s = quantize_block_fp8(w)
    assert s.shape == (2, 3)
    assert float(((dequantize_block_fp8(q, s) - w).abs() / w.abs().clamp(min=1e-3)).median()) < 0.05


def test_w8a8_gemm_checks_shapes():
    xq = torch.zeros(2, 256, dtype=FP8)
    with pytest.raises(ValueError, match="ws has shape"):
        w8a8_block_fp8_matmul_ref(
            xq, torch.ones(2, 2), torch.zeros(128, 256, dtype=FP8), torch.ones(1, 3), torch.float32
        )
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        w8a8_block_fp8_matmul_ref(
            xq.float(), torch.ones(2, 2), torch.zeros(128, 256), torch.ones(1, 2), torch.float32
        )


@pytest.mark.parametrize("ep", [False, True], ids=["all_local", "expert_parallel"])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 128, 128), (9, 6, 3, 256, 128), pytest.param(64, 128, 8, 2048, 768, marks=GPU)],
)
def test_fused_moe_fp8_matches_reference(tokens, experts, top_k, hidden, inter, ep):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE)
    w13, s13 = quantize_block_fp8(
        torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    )
    w2, s2 = quantize_block_fp8(torch.randn(experts, hidden, inter, generator=g) / inter**0.5)
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    if ep:  # this rank holds the first half of the experts
        ids = torch.where(ids < experts // 2, ids, -1)
    args = (x, w13.to(DEVICE), w2.to(DEVICE), weights.contiguous().to(DEVICE), ids.to(DEVICE))
    scales = dict(w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE))
    out = fused_moe(*args, all_local=not ep, **scales)
    ref = fused_moe_ref(*args, **scales)
    torch.testing.assert_close(out, ref, **MOE_TOL)


def test_fused_moe_fp8_refuses_mismatched_scales():
    x = torch.zeros(1, 128)
    w13, w2 = torch.zeros(2, 256, 128, dtype=FP8), torch.zeros(2, 128, 128, dtype=FP8)
    ids, weights = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
    with pytest.raises(ValueError, match="w13_scale must be"):
        fused_moe(
            x, w13, w2, weights, ids, w13_scale=torch.ones(2, 1, 1), w2_scale=torch.ones(2, 1, 1)
        )
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=torch.ones(2, 2, 1))


def _fp8_cache(num_blocks, block_size, kv_heads, head_dim):
    return [
        torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=FP8, device=DEVICE)
        for _ in range(2)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_kv_fp8_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    key = (8 * torch.randn(6, 2, 32, generator=g)).to(dtype=dtype, device=DEVICE)
    value = (8 * torch.randn(6, 2, 32, generator=g)).to(dtype=dtype, device=DEVICE)
    slots = torch.tensor([0, 5, -1, 17, 3, 30], dtype=torch.int32, device=DEVICE)
    scales = torch.tensor([0.01, 2.0], device=DEVICE)  # K saturates past 448 * 0.01 = 4.48
    k, v = _fp8_cache(4, 8, 2, 32)
    k_ref, v_ref = _fp8_cache(4, 8, 2, 32)
    store_kv(key, value, k, v, slots, scales)
    store_kv_ref(key, value, k_ref, v_ref, slots, scales)
    assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))
    assert float(k.float().abs().max()) == 448.0  # saturated, not NaN
    assert not k.float().isnan().any()
    with pytest.raises(ValueError, match="kv_scales"):
        store_kv(key, value, k, v, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_attention_reads_fp8_cache(dtype):
    """Decode and prefill kernels over an fp8 cache against their references (which
    dequantize the same bytes)."""
    g = torch.Generator().manual_seed(4)
    block_size, heads, kv_heads, d = 4, 4, 2, 32
    k, v = _fp8_cache(16, block_size, kv_heads, d)
    scales = torch.tensor([0.02, 0.03], device=DEVICE)
    k.copy_((torch.randn(k.shape, generator=g) / 0.02).clamp(-448, 448).to(FP8))
    v.copy_((torch.randn(v.shape, generator=g) / 0.03).clamp(-448, 448).to(FP8))
    seq_lens = torch.tensor([5, 13, 1], dtype=torch.int32, device=DEVICE)
    table = torch.randperm(16, generator=g)[:12].view(3, 4).to(torch.int32).to(DEVICE)
    q = torch.randn(3, heads, d, generator=g).to(dtype=dtype, device=DEVICE)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    out = paged_decode_attention(q, k, v, seq_lens, table, 0.2, kv_scales=scales)
    ref = paged_decode_attention_ref(q, k, v, seq_lens, table, 0.2, kv_scales=scales)
    torch.testing.assert_close(out, ref, **tol)
    qsl = torch.tensor([0, 2, 9, 10], dtype=torch.int32, device=DEVICE)
    qp = torch.randn(10, heads, d, generator=g).to(dtype=dtype, device=DEVICE)
    out = paged_prefill_attention(qp, k, v, qsl, seq_lens, table, 7, 0.2, kv_scales=scales)
    ref = paged_prefill_attention_ref(qp, k, v, qsl, seq_lens, table, 7, 0.2, kv_scales=scales)
    torch.testing.assert_close(out, ref, **tol)
    # Without the scales the values would be 30-50x off: the kernels must apply them.
    wrong = paged_decode_attention_ref(q, k, v, seq_lens, table, 0.2, kv_scales=torch.ones(2))
    assert not torch.allclose(
        wrong.float(),
        paged_decode_attention_ref(q, k, v, seq_lens, table, 0.2, kv_scales=scales).float(),
        atol=1e-2,
    )
