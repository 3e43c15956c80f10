"""The attention kernels' candidates against the references: the packed decode kernel
(`kernels.decode_attention_packed`) and the TMA prefill kernel for fresh prompts
(`kernels.prefill_attention_tma`).

Each is forced the way a lease or a user forces it ($TP_ENGINE_DECODE_KERNEL=packed,
$TP_ENGINE_PREFILL_KERNEL=tma) and run through the public wrapper, under Triton's interpreter
here and natively with the `gpu` marker. The batches are `tests.test_kernels_attention`'s: pages
shuffled and every slot outside a context NaN, so a wrong page, head or mask shows.
"""

from __future__ import annotations

import pytest
import torch

from kernels import attention_tables as at
from kernels._common import FP8_KV_DTYPE
from kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from tests.test_kernels_attention import (
    DECODE_LENS,
    DECODE_LENS_LONG,
    DEVICE,
    GPU,
    TOL,
    assert_matches,
    make_batch,
    run_decode,
)


@pytest.fixture
def force(monkeypatch):
    """force(env, kernel): the wrappers take `kernel` from now on (no table planted)."""
    for env in (at.TABLES_ENV, at.DECODE_KERNEL_ENV, at.PREFILL_KERNEL_ENV):
        monkeypatch.delenv(env, raising=False)

    def set_kernel(env: str, kernel: str) -> None:
        monkeypatch.setenv(env, kernel)
        at.reset()

    yield set_kernel
    at.reset()


def _spied_packed(monkeypatch) -> list:
    import kernels.decode_attention_packed as packed

    calls, real = [], packed.launch_meta
    monkeypatch.setattr(packed, "launch_meta", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


# (dtype, head_dim, group, num_kv_heads, block_size, num_splits): one KV head per program
# (group 16, and a group past 16 rows), Qwen3-0.6B's 8 KV heads of 2 in one program, a group
# of 5, 3 KV heads in a program of 4 (the last one masked), fp16 and bf16.
PACKED_CPU = [
    (torch.float32, 64, 1, 2, 16, 1),
    (torch.float32, 64, 2, 8, 16, None),
    (torch.float32, 128, 5, 2, 32, 3),
    (torch.float16, 64, 3, 3, 16, 2),
    (torch.bfloat16, 64, 8, 2, 16, None),
    (torch.float32, 32, 16, 1, 4, 1),
    (torch.float32, 32, 32, 1, 16, 2),
]
PACKED_GPU = [
    (dtype, 128, group, kv, block_size, splits)
    for dtype in (torch.float32, torch.bfloat16)
    for group, kv in ((2, 8), (4, 8), (5, 2), (8, 1))
    for block_size in (16, 256)
    for splits in (None, 1, 7)
]


def _ids(case: tuple) -> str:
    dtype, d, group, kv, bs, splits = case
    return f"{str(dtype).removeprefix('torch.')}-d{d}-g{group}-kv{kv}-bs{bs}-s{splits}"


def _check_packed(monkeypatch, force, case, lens, seed):
    dtype, head_dim, group, kv_heads, block_size, num_splits = case
    force(at.DECODE_KERNEL_ENV, "packed")
    calls = _spied_packed(monkeypatch)
    b = make_batch(lens, kv_heads, group, head_dim, block_size, dtype, seed=seed)
    ref = run_decode(b, None, paged_decode_attention_ref)
    assert_matches(run_decode(b, num_splits), ref, dtype)
    assert calls, "the packed kernel was not launched"


@pytest.mark.parametrize("case", PACKED_CPU, ids=_ids)
def test_packed_decode(monkeypatch, force, case):
    _check_packed(monkeypatch, force, case, DECODE_LENS, seed=31)


@GPU
@pytest.mark.parametrize("case", PACKED_GPU, ids=_ids)
def test_packed_decode_gpu(monkeypatch, force, case):
    _check_packed(monkeypatch, force, case, DECODE_LENS_LONG, seed=32)


def test_packed_decode_empty_sequence_and_idle_splits(monkeypatch, force):
    """A padding row (seq_len 0) gives zeros, and splits past a short context weigh nothing."""
    force(at.DECODE_KERNEL_ENV, "packed")
    b = make_batch([(2, 1), (30, 1)], 4, 2, 64, 16, torch.float32, seed=33)
    b.seq_lens[0] = 0
    out = run_decode(b, 8)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_matches(out, run_decode(b, None, paged_decode_attention_ref), torch.float32)


def test_packed_decode_reads_an_fp8_cache(monkeypatch, force):
    force(at.DECODE_KERNEL_ENV, "packed")
    g = torch.Generator().manual_seed(34)
    block_size, heads, kv_heads, d = 4, 8, 4, 32
    shape = (16, block_size, kv_heads, d)
    scales = torch.tensor([0.02, 0.03], device=DEVICE)
    k = (torch.randn(shape, generator=g) / 0.02).clamp(-448, 448).to(FP8_KV_DTYPE).to(DEVICE)
    v = (torch.randn(shape, generator=g) / 0.03).clamp(-448, 448).to(FP8_KV_DTYPE).to(DEVICE)
    seq_lens = torch.tensor([5, 13, 1], dtype=torch.int32, device=DEVICE)
    table = torch.randperm(16, generator=g)[:12].view(3, 4).to(torch.int32).to(DEVICE)
    q = torch.randn(3, heads, d, generator=g).to(dtype=torch.bfloat16, device=DEVICE)
    out = paged_decode_attention(q, k, v, seq_lens, table, 0.2, kv_scales=scales)
    ref = paged_decode_attention_ref(q, k, v, seq_lens, table, 0.2, kv_scales=scales)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


# -- the TMA prefill of fresh prompts ---------------------------------------------------------

# Prompts of 1 token, one under, at and past the interpreter's 16-row blocks, and 40 (three
# blocks): every program shape, and tiles that run into the next prompt's rows.
FRESH = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 40)]
FRESH_LONG = [(0, 1), (0, 127), (0, 128), (0, 300), (0, 1000), (0, 64)]
# (dtype, head_dim, group, num_kv_heads)
TMA_CPU = [
    (torch.float32, 32, 1, 2),
    (torch.float32, 64, 4, 2),
    (torch.float32, 16, 5, 2),
    (torch.float16, 32, 2, 2),
    (torch.bfloat16, 64, 8, 1),
]
TMA_GPU = [
    (dtype, head_dim, group, kv)
    for dtype in (torch.float16, torch.bfloat16, torch.float32)
    for head_dim in (64, 128)
    for group, kv in ((1, 4), (2, 8), (4, 2), (8, 1))
]


def _tma_ids(case: tuple) -> str:
    dtype, d, group, kv = case
    return f"{str(dtype).removeprefix('torch.')}-d{d}-g{group}-kv{kv}"


def _check_tma(case, lens, seed):
    from kernels.prefill_attention import paged_prefill_attention_ref
    from kernels.prefill_attention_tma import fresh_prefill_attention
    from tests.test_kernels_attention import run_prefill

    dtype, head_dim, group, kv_heads = case
    b = make_batch(lens, kv_heads, group, head_dim, 16, dtype, seed=seed)
    out = fresh_prefill_attention(
        b.query, b.new_k, b.new_v, b.query_start_loc, b.max_query_len, b.scale
    )
    assert_matches(out, run_prefill(b, paged_prefill_attention_ref), dtype)


@pytest.mark.parametrize("case", TMA_CPU, ids=_tma_ids)
def test_tma_fresh_prefill(case):
    _check_tma(case, FRESH, seed=41)


@GPU
@pytest.mark.parametrize("case", TMA_GPU, ids=_tma_ids)
def test_tma_fresh_prefill_gpu(case):
    _check_tma(case, FRESH_LONG, seed=42)


def test_tma_fresh_prefill_reads_views_of_the_qkv_rows():
    """As the layer hands them over: q, k and v are column slices of one [T, (H + 2KV) * D]
    projection output, so their row stride is the whole QKV row's."""
    from kernels.prefill_attention import paged_prefill_attention_ref
    from kernels.prefill_attention_tma import fresh_prefill_attention
    from tests.test_kernels_attention import run_prefill

    b = make_batch(FRESH, 2, 2, 32, 16, torch.float32, seed=43)
    t, h, kv, d = b.query.shape[0], 4, 2, 32
    qkv = torch.cat([x.reshape(t, -1) for x in (b.query, b.new_k, b.new_v)], dim=1)
    q, k, v = qkv.split([h * d, kv * d, kv * d], dim=1)
    q, k, v = q.view(t, h, d), k.view(t, kv, d), v.view(t, kv, d)
    assert not q.is_contiguous() and k.stride(0) == (h + 2 * kv) * d
    out = fresh_prefill_attention(q, k, v, b.query_start_loc, b.max_query_len, b.scale)
    assert_matches(out, run_prefill(b, paged_prefill_attention_ref), torch.float32)


def test_tma_unusable_inputs_say_why():
    from kernels.prefill_attention_tma import fresh_prefill_attention, unusable_reason

    q, k = torch.zeros(4, 2, 80), torch.zeros(4, 1, 80)
    assert "power of two" in unusable_reason(q, k, k)
    q, k = torch.zeros(4, 2, 32), torch.zeros(4, 1, 32)
    assert unusable_reason(q, k, k) is None
    assert "aligned" in unusable_reason(torch.zeros(4 * 64 + 1)[1:].view(4, 2, 32), k, k)
    assert "dense" in unusable_reason(torch.zeros(4, 32, 2).transpose(1, 2), k, k)
    with pytest.raises(ValueError, match="power of two"):
        qsl = torch.tensor([0, 4], dtype=torch.int32)
        fresh_prefill_attention(torch.zeros(4, 2, 80), *[torch.zeros(4, 1, 80)] * 2, qsl, 4, 1.0)


# -- the triton backend's choice ----------------------------------------------------------------

# Two running decodes, then fresh prompts (a one-token prompt among them): the TMA kernel's
# case. The backend tests' "mixed" and "prefix_cached" steps have prompts with cached prefixes.
FRESH_STEP = [(7, 1), (40, 1), (9, 9), (20, 20), (1, 1)]


@pytest.mark.parametrize(
    ("lens", "takes_tma"),
    [(FRESH_STEP, True), ([(9, 9), (23, 23)], True), ("mixed", False), ("prefix_cached", False),
     ("decode_only", False)],
    ids=["decodes_then_fresh", "fresh_only", "mixed", "prefix_cached", "decode_only"],
)  # fmt: skip
def test_backend_takes_the_tma_kernel_for_fresh_prompts_only(monkeypatch, force, lens, takes_tma):
    from rank_worker.attention import triton_backend
    from rank_worker.attention.selection import get_backend
    from tests.test_attention_backends import CASES, TOLERANCES, make_case, run_backend

    force(at.PREFILL_KERNEL_ENV, "tma")
    calls, real = [], triton_backend.fresh_prefill_attention
    monkeypatch.setattr(
        triton_backend, "fresh_prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    lens = CASES[lens] if isinstance(lens, str) else lens
    case = make_case(lens, 4, 2, 16, 4, torch.float32, DEVICE)
    out, k_cache, v_cache = run_backend(get_backend("triton"), case)
    ref, k_ref, v_ref = run_backend(get_backend("torch"), case)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # stored all the same
    torch.testing.assert_close(out, ref, **TOLERANCES[torch.float32])
    assert calls == ([1] if takes_tma else [])
