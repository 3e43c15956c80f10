"""Paged attention in plain torch: the reference backend and the CPU path.

Correctness first, and fast enough for CPU tests: decodes and other short queries (a
speculative verify entry, a small chunk: up to `BATCHED_QUERY_MAX` tokens) are attended in one
batched step over contexts padded to the longest; every longer sequence (a prefill, a prefill
chunk, a prefill after a cached prefix) is attended on its own, so no batch is padded to the
longest prompt. Scores and softmax are computed in fp32 whatever the cache dtype. An fp8 cache
stores `K / k_scale` saturated to e4m3's ±448 and is read back times the scale (the same
arithmetic as the kernels and their references).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.store_kv import store_kv_ref
from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata

FP8_KV_DTYPE = torch.float8_e4m3fn
# Sequences computing at most this many tokens (decodes, speculative verify entries, small
# chunks) are attended together, padded to the longest of them; longer ones one by one.
BATCHED_QUERY_MAX = 16


def _scale(kv_scales: torch.Tensor | None, which: int, cache: torch.Tensor) -> torch.Tensor | None:
    """K's (0) or V's (1) scale; an fp8 cache cannot do without."""
    if cache.dtype == FP8_KV_DTYPE and kv_scales is None:
        raise ValueError("an fp8 KV cache needs kv_scales, a [2] float32 (k_scale, v_scale)")
    return None if kv_scales is None else kv_scales[which]


def from_cache(cached: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 values of cache entries."""
    if cached.dtype != FP8_KV_DTYPE:
        return cached.float()
    return cached.float() * scale


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """Read the first `context_len` tokens of each sequence out of the paged cache.

    cache `[num_blocks, block_size, num_kv_heads, head_dim]`, block_table `[n, W]` ->
    `[n, context_len, num_kv_heads, head_dim]`. Rows past a sequence's own length read padding
    blocks; the caller masks them.
    """
    block_size = cache.shape[1]
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, kv_heads, head_dim]
    pos = torch.arange(context_len, device=cache.device)  # [L]
    blocks = block_table.long()[:, pos // block_size]  # [n, L]
    slots = blocks * block_size + pos % block_size  # [n, L]
    return flat[slots]


def _attend_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention for n sequences padded to common lengths.

    q `[n, Q, kv_heads, group, head_dim]`, k/v `[n, L, kv_heads, head_dim]`,
    query_lens/seq_lens `[n]` -> `[n, Q, kv_heads, group, head_dim]` fp32.
    Query row i of sequence s sits at absolute position `seq_len - q_len + i`, and sees keys at
    positions up to and including its own.
    """
    scores = torch.einsum("nqkgd,nlkd->nkgql", q.float(), k.float()) * scale  # [n,kv,g,Q,L]
    q_pos = torch.arange(q.shape[1], device=q.device)  # [Q]
    k_pos = torch.arange(k.shape[1], device=q.device)  # [L]
    # Absolute position of each query row: [n, Q]
    abs_q = (seq_lens - query_lens).unsqueeze(1) + q_pos.unsqueeze(0)
    visible = (k_pos.view(1, 1, -1) <= abs_q.unsqueeze(-1)) & (
        k_pos.view(1, 1, -1) < seq_lens.view(-1, 1, 1)
    )  # [n, Q, L]; every real row sees at least key 0, so no row is all -inf
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nkgql,nlkd->nqkgd", probs, v.float())


class TorchAttentionBackend(AttentionBackend):
    """Reference paged attention (see the module docstring)."""

    name = "torch"

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        # An fp8 cache without scales is refused here with a ValueError (the reference asserts).
        _scale(kv_scales, 0, k_cache)
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, kv_scales)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _, num_heads, head_dim = query.shape  # [T, num_heads, head_dim]
        num_kv_heads = k_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
        group = num_heads // num_kv_heads
        k_scale, v_scale = _scale(kv_scales, 0, k_cache), _scale(kv_scales, 1, v_cache)
        out = torch.empty_like(query)  # [T, num_heads, head_dim]
        qsl = meta.query_start_loc_host
        query_lens = meta.query_lens_host  # [B]
        seq_lens = meta.seq_lens_host  # [B]
        device = query.device

        short = np.flatnonzero(query_lens <= BATCHED_QUERY_MAX)
        if short.size:
            # Decodes and short queries (speculative verify entries, small chunks) in one
            # padded step: query rows padded by repeating each sequence's last one, whose
            # results are dropped.
            lens = query_lens[short]  # [n]
            q_max = int(lens.max())
            offsets = np.arange(q_max)
            tokens = qsl[short][:, None] + np.minimum(offsets, lens[:, None] - 1)  # [n, Q]
            real = offsets < lens[:, None]  # [n, Q]
            idx = torch.from_numpy(short).to(device)
            q = query[torch.from_numpy(tokens.reshape(-1)).to(device)]
            q = q.view(short.size, q_max, num_kv_heads, group, head_dim)  # [n, Q, kv, g, d]
            context = int(seq_lens[short].max())
            table = meta.block_table[idx]  # [n, W]
            k = from_cache(gather_context(k_cache, table, context), k_scale)  # [n, L, kv, d]
            v = from_cache(gather_context(v_cache, table, context), v_scale)
            o = _attend_padded(
                q, k, v, torch.from_numpy(lens.astype(np.int64)).to(device),
                meta.seq_lens[idx].long(), scale,
            )  # [n, Q, kv, g, d]  # fmt: skip
            o = o.reshape(short.size, q_max, num_heads, head_dim)
            out[torch.from_numpy(tokens[real]).to(device)] = o[torch.from_numpy(real)].to(out.dtype)

        for i in np.flatnonzero(query_lens > BATCHED_QUERY_MAX):
            start, end, context = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q = query[start:end].view(1, end - start, num_kv_heads, group, head_dim)
            table = meta.block_table[i : i + 1]  # [1, W]
            k = from_cache(gather_context(k_cache, table, context), k_scale)  # [1, L, kv, d]
            v = from_cache(gather_context(v_cache, table, context), v_scale)
            lens = torch.tensor([end - start], device=device)
            o = _attend_padded(q, k, v, lens, torch.tensor([context], device=device), scale)
            out[start:end] = o.reshape(end - start, num_heads, head_dim).to(out.dtype)
        return out
