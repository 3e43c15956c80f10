"""The torch paged-attention backend against dense causal attention computed per sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 32
HEAD_DIM = 8


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q `[q_len, H, D]` at the last q_len positions of k/v `[L, KV, D]` -> `[q_len, H, D]`."""
    q_len, num_heads, _ = q.shape
    context, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # query head h uses KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale
    q_pos = torch.arange(context - q_len, context).unsqueeze(1)
    mask = torch.arange(context).unsqueeze(0) > q_pos  # [q_len, L], True = future
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), v)


def _slots(blocks: list[int], positions: range) -> list[int]:
    return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_mixed_batch_matches_dense(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    backend = TorchAttentionBackend()
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    scale = HEAD_DIM**-0.5

    # (context length after the step, new tokens, block ids): a plain prefill, a prefill after a
    # cached prefix (a later chunk), two decodes of different lengths, a one-token prompt.
    seqs = [(9, 9, [5, 17, 2]), (13, 6, [8, 1, 30, 4]), (7, 1, [22, 3]), (12, 1, [9, 10, 11]),
            (1, 1, [0])]  # fmt: skip
    # Full K/V of every sequence; the cached prefix is written straight into the cache.
    full_k = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n, _, _ in seqs]
    full_v = [torch.randn(n, num_kv_heads, HEAD_DIM, generator=gen) for n, _, _ in seqs]
    for (n, q_len, blocks), k, v in zip(seqs, full_k, full_v, strict=True):
        for p, slot in zip(range(n - q_len), _slots(blocks, range(n - q_len)), strict=True):
            k_cache.view(-1, num_kv_heads, HEAD_DIM)[slot] = k[p]
            v_cache.view(-1, num_kv_heads, HEAD_DIM)[slot] = v[p]

    new_k = torch.cat([k[n - q :] for (n, q, _), k in zip(seqs, full_k, strict=True)])
    new_v = torch.cat([v[n - q :] for (n, q, _), v in zip(seqs, full_v, strict=True)])
    slots = [s for n, q, b in seqs for s in _slots(b, range(n - q, n))]
    qsl = np.concatenate([[0], np.cumsum([q for _, q, _ in seqs])]).astype(np.int32)
    query = torch.randn(len(slots), num_heads, HEAD_DIM, generator=gen)
    width = max(len(b) for _, _, b in seqs)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (_, _, b) in enumerate(seqs):
        table[i, : len(b)] = torch.tensor(b)
    seq_lens = np.array([n for n, _, _ in seqs], dtype=np.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.from_numpy(qsl),
        seq_lens=torch.from_numpy(seq_lens),
        block_table=table,
        max_query_len=int(np.diff(qsl).max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
    )
    out = backend.forward(query, new_k, new_v, (k_cache, v_cache), meta, scale)

    for i, (k, v) in enumerate(zip(full_k, full_v, strict=True)):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        ref = dense_reference(query[rows], k, v, scale)
        # fp32 throughout; only the summation order differs.
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


def test_store_writes_only_given_slots() -> None:
    backend = TorchAttentionBackend()
    k_cache = torch.zeros(4, BLOCK_SIZE, 2, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, HEAD_DIM)
    backend.store_kv(key, 2 * key, k_cache, v_cache, torch.tensor([5, -1, 14]))
    written = k_cache.view(-1, 2, HEAD_DIM)[:, 0, 0].nonzero().flatten().tolist()
    assert written == [5, 14]
    assert v_cache.view(-1, 2, HEAD_DIM)[14, 1, 3].item() == 2.0
