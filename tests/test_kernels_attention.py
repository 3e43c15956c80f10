"""Paged prefill and decode attention kernels against their plain-torch references.

Runs natively on a GPU and under Triton's interpreter elsewhere (tests/conftest.py sets
TRITON_INTERPRET=1 before `kernels` is imported). The interpreter executes every program in
numpy, so the default grid below is small and picked to touch every axis once; the `gpu` grid
sweeps the full product at realistic lengths.

Every batch is built so that a kernel reading what it must not changes its answer: block ids
are shuffled (no sequence's pages are contiguous), and every cache slot that holds no token of
the context — spare blocks, the block-table padding that points at one, the tail of each last
page, and the new tokens' slots when they are deliberately left unstored — is NaN.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kernels.decode_attention import (
    MIN_TOKENS_PER_SPLIT,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.store_kv import store_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.gpu

# Kernel vs reference, both computing softmax in fp32 from the same inputs:
# - fp32: only the summation order (online softmax over tiles) and exp2 vs exp differ; observed
#   ~1e-6, and a wrong mask, page or head moves outputs by ~0.1, so 1e-4 separates the two.
# - fp16: the kernel rounds the probabilities to fp16 (11-bit mantissa, 5e-4 relative) for the
#   P @ V product and both round the output: a few fp16 ulps.
# - bf16: the same with 8 mantissa bits (4e-3 relative); the interpreter also truncates instead
#   of rounding to nearest when it casts to bf16, one more ulp (1.6e-2 at magnitudes 2-4).
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache, as the model runner hands it to attention."""

    query: torch.Tensor  # [T, num_heads, head_dim]
    new_k: torch.Tensor  # [T, num_kv_heads, head_dim] this step's K (already stored unless asked)
    new_v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, W] int32, padded with a NaN block
    slot_mapping: torch.Tensor  # [T] int64 slots of the new tokens
    max_query_len: int
    scale: float


def make_batch(
    lens: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    *,
    seed: int = 0,
    store_new: bool = True,
) -> PagedBatch:
    """`lens`: (cached tokens, new tokens) per sequence; the new tokens are the context's last."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-(c + n) // block_size) for c, n in lens]
    num_blocks = sum(pages) + 2  # two spare blocks, never owned: NaN
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    spare = perm[-1]
    width = max(pages) + 1  # at least one padding column for every sequence
    table = torch.full((len(lens), width), spare, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    new_k, new_v, slots, qsl = [], [], [], [0]
    used = 0
    for i, (cached, new) in enumerate(lens):
        blocks = perm[used : used + pages[i]]
        used += pages[i]
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        seq_slots = [
            blocks[p // block_size] * block_size + p % block_size for p in range(cached + new)
        ]
        k = torch.randn(cached + new, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(cached + new, num_kv_heads, head_dim, generator=gen)
        stored = cached + new if store_new else cached
        k_flat[seq_slots[:stored]] = k[:stored]
        v_flat[seq_slots[:stored]] = v[:stored]
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        slots += seq_slots[cached:]
        qsl.append(qsl[-1] + new)
    num_tokens = qsl[-1]
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen)

    def dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=DEVICE, dtype=dtype if t.is_floating_point() else t.dtype)

    return PagedBatch(
        query=dev(query),
        new_k=dev(torch.cat(new_k)),
        new_v=dev(torch.cat(new_v)),
        k_cache=dev(k_cache),
        v_cache=dev(v_cache),
        query_start_loc=dev(torch.tensor(qsl, dtype=torch.int32)),
        seq_lens=dev(torch.tensor([c + n for c, n in lens], dtype=torch.int32)),
        block_table=dev(table),
        slot_mapping=dev(torch.tensor(slots, dtype=torch.int64)),
        max_query_len=max(n for _, n in lens),
        scale=head_dim**-0.5,
    )


def run_prefill(b: PagedBatch, fn=paged_prefill_attention) -> torch.Tensor:
    return fn(
        b.query, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table,
        b.max_query_len, b.scale,
    )  # fmt: skip


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype == dtype
    assert not out.isnan().any(), "the kernel read a slot outside the context (NaN)"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


# (cached, new) per sequence, every row shape in one batch: a one-token prompt, a prompt of
# exactly one page (16), one just past it, a prefix-cached prompt (cached prefix on a page
# boundary), a later chunk of a chunked prefill (prefix off any boundary), and two decodes.
MIXED = [(0, 1), (0, 16), (0, 17), (32, 9), (13, 20), (40, 1), (5, 1)]
# Longer, for the GPU: several 64-key tiles before the diagonal, and pages of 256 crossed.
MIXED_LONG = [(0, 1), (0, 256), (0, 300), (512, 77), (333, 190), (1000, 1), (17, 1), (0, 129)]

# (dtype, head_dim, group, block_size): each value of every axis at least once on the CPU.
PREFILL_CPU = [
    (torch.float32, 64, 1, 16),
    (torch.float32, 128, 4, 32),
    (torch.float32, 64, 8, 256),
    (torch.float32, 64, 5, 64),  # Qwen3-14B's 40/8 heads: a group that is no power of two
    (torch.float16, 64, 2, 16),
    (torch.float16, 128, 4, 256),
    (torch.bfloat16, 128, 8, 128),
    (torch.bfloat16, 64, 1, 32),
]
PREFILL_GPU = [
    (dtype, head_dim, group, block_size)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for head_dim in (64, 128)
    for group in (1, 2, 4, 5, 8)
    for block_size in (16, 256)
] + [(torch.bfloat16, 128, 8, block_size) for block_size in (32, 64, 128)]


def _ids(case: tuple) -> str:
    dtype, head_dim, group, block_size = case
    return f"{str(dtype).removeprefix('torch.')}-d{head_dim}-g{group}-bs{block_size}"


@pytest.mark.parametrize("case", PREFILL_CPU, ids=_ids)
def test_prefill_mixed_batch(case):
    dtype, head_dim, group, block_size = case
    b = make_batch(MIXED, 2, group, head_dim, block_size, dtype)
    assert_matches(run_prefill(b), run_prefill(b, paged_prefill_attention_ref), dtype)


@GPU
@pytest.mark.parametrize("case", PREFILL_GPU, ids=_ids)
def test_prefill_mixed_batch_gpu(case):
    dtype, head_dim, group, block_size = case
    b = make_batch(MIXED_LONG, 2, group, head_dim, block_size, dtype, seed=1)
    assert_matches(run_prefill(b), run_prefill(b, paged_prefill_attention_ref), dtype)


# One shape per test, so that a failure names the case it breaks.
SCENARIOS = {
    "one_token_prompt": [(0, 1)],
    "prompt_of_one_page": [(0, 16)],
    "prompt_one_past_a_page": [(0, 17)],
    "prefix_cached_on_page_boundary": [(32, 5)],
    "chunk_after_off_boundary_prefix": [(21, 14)],
    "chunk_of_one_token_is_a_decode": [(50, 1)],
    "long_prefix_then_many_tokens": [(70, 40)],
    "lengths_differ_by_one": [(0, 15), (0, 16), (0, 17)],
}


@pytest.mark.parametrize("lens", list(SCENARIOS.values()), ids=list(SCENARIOS))
def test_prefill_scenarios(lens):
    b = make_batch(lens, 2, 2, 64, 16, torch.float32, seed=2)
    assert_matches(run_prefill(b), run_prefill(b, paged_prefill_attention_ref), torch.float32)


def test_prefill_causal_mask_per_token():
    """Each new token's output depends on its own key but on no later key: changing the last
    key of the context must leave every earlier row exactly as it was."""
    b = make_batch([(8, 12)], 1, 2, 64, 16, torch.float32, seed=3)
    before = run_prefill(b)
    last = b.block_table[0, (20 - 1) // 16].long() * 16 + (20 - 1) % 16
    b.k_cache.view(-1, *b.k_cache.shape[2:])[last] += 5.0
    after = run_prefill(b)
    torch.testing.assert_close(after[:-1], before[:-1], atol=0, rtol=0)
    assert (after[-1] - before[-1]).abs().max() > 1e-3


def test_prefill_after_store_kv():
    """The real order of a step: store the new tokens' K/V, then attend over the cache."""
    b = make_batch(MIXED, 2, 4, 64, 16, torch.bfloat16, seed=4, store_new=False)
    store_kv(b.new_k, b.new_v, b.k_cache, b.v_cache, b.slot_mapping)
    assert_matches(run_prefill(b), run_prefill(b, paged_prefill_attention_ref), torch.bfloat16)


def test_prefill_strided_query_and_empty_sequence():
    """A query that is a view into a fused QKV output, and a sequence with no new tokens."""
    b = make_batch([(10, 6), (4, 0), (0, 9)], 2, 2, 64, 16, torch.float32, seed=5)
    qkv = torch.zeros(b.query.shape[0], b.query.shape[1] + 4, 64, device=DEVICE)
    qkv[:, : b.query.shape[1]] = b.query
    view = qkv[:, : b.query.shape[1]]
    assert not view.is_contiguous()
    out = paged_prefill_attention(
        view, b.k_cache, b.v_cache, b.query_start_loc, b.seq_lens, b.block_table,
        b.max_query_len, b.scale,
    )  # fmt: skip
    assert_matches(out, run_prefill(b, paged_prefill_attention_ref), torch.float32)


def test_prefill_rejects_bad_inputs():
    b = make_batch([(0, 4)], 2, 2, 64, 16, torch.float32)
    args = (b.query_start_loc, b.seq_lens, b.block_table, 4, 0.125)
    with pytest.raises(ValueError, match="cannot share"):
        paged_prefill_attention(b.query[:, :3], b.k_cache, b.v_cache, *args)
    with pytest.raises(ValueError, match="cache is"):
        paged_prefill_attention(b.query.half(), b.k_cache, b.v_cache, *args)
    with pytest.raises(ValueError, match="contiguous"):
        paged_prefill_attention(
            b.query, b.k_cache.transpose(1, 2), b.v_cache.transpose(1, 2), *args
        )
    with pytest.raises(ValueError, match="int32"):
        paged_prefill_attention(b.query, b.k_cache, b.v_cache, b.query_start_loc.long(), *args[1:])


# -- decode -----------------------------------------------------------------------------------

# Contexts of 1 token, a page's worth, one past a page, several pages, and a longer one.
DECODE_LENS = [(0, 1), (15, 1), (16, 1), (40, 1), (99, 1)]
DECODE_LENS_LONG = [(0, 1), (255, 1), (256, 1), (1000, 1), (4095, 1), (8191, 1)]

# (dtype, head_dim, group, block_size, num_splits); None = the automatic choice.
DECODE_CPU = [
    (torch.float32, 64, 1, 16, 1),
    (torch.float32, 128, 4, 32, 3),
    (torch.float32, 64, 5, 16, 4),
    (torch.float32, 64, 8, 256, None),
    (torch.float16, 128, 2, 64, 2),
    (torch.float16, 64, 5, 16, 7),
    (torch.bfloat16, 64, 8, 16, 3),
    (torch.bfloat16, 128, 1, 128, None),
]
# On the GPU the automatic choice splits these long contexts (22 ways on an H200), so 1 is
# swept apart, once per dtype and head_dim: each distinct constexpr set costs a compile.
DECODE_GPU = [
    (dtype, head_dim, group, block_size, num_splits)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for head_dim in (64, 128)
    for group in (1, 2, 4, 5, 8)
    for block_size in (16, 256)
    for num_splits in (None, 7)
] + [
    (dtype, head_dim, 8, 16, 1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16)
    for head_dim in (64, 128)
]


def _decode_ids(case: tuple) -> str:
    return f"{_ids(case[:4])}-s{case[4]}"


def run_decode(b: PagedBatch, num_splits: int | None, fn=paged_decode_attention) -> torch.Tensor:
    return fn(b.query, b.k_cache, b.v_cache, b.seq_lens, b.block_table, b.scale, num_splits)


@pytest.mark.parametrize("case", DECODE_CPU, ids=_decode_ids)
def test_decode(case):
    dtype, head_dim, group, block_size, num_splits = case
    b = make_batch(DECODE_LENS, 2, group, head_dim, block_size, dtype, seed=6)
    ref = run_decode(b, None, paged_decode_attention_ref)
    assert_matches(run_decode(b, num_splits), ref, dtype)


@GPU
@pytest.mark.parametrize("case", DECODE_GPU, ids=_decode_ids)
def test_decode_gpu(case):
    dtype, head_dim, group, block_size, num_splits = case
    b = make_batch(DECODE_LENS_LONG, 2, group, head_dim, block_size, dtype, seed=7)
    ref = run_decode(b, None, paged_decode_attention_ref)
    assert_matches(run_decode(b, num_splits), ref, dtype)


def test_decode_agrees_with_prefill_kernel():
    """A decode is a one-token prefill: both kernels must give the same rows."""
    b = make_batch(DECODE_LENS, 2, 4, 64, 16, torch.float32, seed=8)
    torch.testing.assert_close(run_decode(b, 3), run_prefill(b), **TOL[torch.float32])


def test_decode_more_splits_than_tiles_and_an_empty_sequence():
    """Splits that get no keys (short contexts) and a padding sequence with seq_len 0 (as a
    CUDA-graph batch pads with) must weigh nothing and give zeros, never NaN."""
    b = make_batch([(2, 1), (30, 1)], 2, 2, 64, 16, torch.float32, seed=9)
    b.seq_lens[0] = 0
    out = run_decode(b, 8)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert_matches(out, run_decode(b, None, paged_decode_attention_ref), torch.float32)


def test_choose_num_splits():
    # One long sequence must fill the GPU (132 SMs on an H200) ...
    assert choose_num_splits(1, 8, 32768, 132) == 33
    assert choose_num_splits(1, 1, 32768, 132) == 64  # capped
    # ... a full batch needs no splitting, nor does a short context.
    assert choose_num_splits(64, 8, 32768, 132) == 1
    assert choose_num_splits(1, 8, MIN_TOKENS_PER_SPLIT, 132) == 1
    assert choose_num_splits(1, 8, 3 * MIN_TOKENS_PER_SPLIT, 132) == 3
    assert choose_num_splits(0, 8, 0, 132) == 1


def _random_case(seed: int) -> tuple:
    """Geometry off the beaten track: any block size from 1 to 256, head dims that are no power
    of two, groups of 3 and 6, several KV heads, and a random mix of sequence shapes."""
    rng = random.Random(seed)
    lens = [
        (rng.choice([0, rng.randint(0, 80)]), rng.choice([1, rng.randint(1, 60)]))
        for _ in range(rng.randint(1, 5))
    ]
    return (
        lens,
        rng.choice([1, 2, 3]),  # num_kv_heads
        rng.choice([1, 2, 3, 4, 5, 6, 8]),  # group
        rng.choice([16, 32, 80, 128]),  # head_dim
        rng.choice([1, 4, 16, 32, 64, 256]),  # block_size
        rng.choice([torch.float32, torch.float16, torch.bfloat16]),
        rng.choice([None, 1, 2, 5]),  # num_splits
    )


@pytest.mark.parametrize(
    "seed", [*range(4), *(pytest.param(s, marks=GPU) for s in range(100, 120))]
)
def test_random_batches(seed):
    lens, num_kv_heads, group, head_dim, block_size, dtype, num_splits = _random_case(seed)
    b = make_batch(lens, num_kv_heads, group, head_dim, block_size, dtype, seed=seed)
    assert_matches(run_prefill(b), run_prefill(b, paged_prefill_attention_ref), dtype)
    b = make_batch([(c, 1) for c, _ in lens], num_kv_heads, group, head_dim, block_size, dtype)
    ref = run_decode(b, None, paged_decode_attention_ref)
    assert_matches(run_decode(b, num_splits), ref, dtype)


def test_decode_rejects_bad_inputs():
    b = make_batch([(3, 1)], 2, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="num_splits"):
        run_decode(b, 0)
    with pytest.raises(ValueError, match="do not match"):
        paged_decode_attention(
            b.query, b.k_cache, b.v_cache, b.seq_lens[:0], b.block_table, b.scale
        )


# -- block tables as views of a wider table ---------------------------------------------------


def widened(table: torch.Tensor, extra: int = 5) -> torch.Tensor:
    """`table` as the GPU runner hands it over: its columns of a wider table, so the row stride
    is the wide table's (`BlockTables.gather`). The extra columns point at a NaN block."""
    wide = torch.full(
        (table.shape[0], table.shape[1] + extra), int(table[0, -1]), dtype=table.dtype,
        device=table.device,
    )  # fmt: skip
    wide[:, : table.shape[1]] = table
    view = wide[:, : table.shape[1]]
    assert not view.is_contiguous() and view.stride() == (table.shape[1] + extra, 1)
    return view


def test_prefill_and_decode_read_a_strided_block_table():
    """The first native run died here: the kernels take the row stride, but the argument check
    refused any block table that was not contiguous."""
    b = make_batch(MIXED, 2, 2, 64, 16, torch.float32, seed=11)
    ref = run_prefill(b, paged_prefill_attention_ref)
    b.block_table = widened(b.block_table)
    assert_matches(run_prefill(b), ref, torch.float32)

    d = make_batch(DECODE_LENS, 2, 4, 64, 16, torch.float32, seed=12)
    ref = run_decode(d, None, paged_decode_attention_ref)
    d.block_table = widened(d.block_table)
    for num_splits in (1, 3):
        assert_matches(run_decode(d, num_splits), ref, torch.float32)


def test_block_tables_the_kernels_cannot_index_are_refused():
    b = make_batch([(3, 2), (9, 1)], 2, 2, 64, 16, torch.float32)
    column_major = b.block_table.t().contiguous().t()  # last dim not dense
    overlapping = b.block_table[:1].expand(2, -1)  # row stride 0: both rows are one row
    for bad in (column_major, overlapping):
        b.block_table = bad
        with pytest.raises(ValueError, match="block_table must have a dense last dim"):
            run_prefill(b)
        with pytest.raises(ValueError, match="block_table must have a dense last dim"):
            paged_decode_attention(b.query[:2], b.k_cache, b.v_cache, b.seq_lens, bad, b.scale)
    # Other index tensors are indexed flat and stay strictly contiguous.
    b = make_batch([(3, 2), (9, 1)], 2, 2, 64, 16, torch.float32)
    strided_lens = torch.stack([b.seq_lens, b.seq_lens], dim=1)[:, 0]
    with pytest.raises(ValueError, match="seq_lens must be contiguous"):
        paged_prefill_attention(
            b.query, b.k_cache, b.v_cache, b.query_start_loc, strided_lens, b.block_table,
            b.max_query_len, b.scale,
        )  # fmt: skip
