"""Paged attention with flash-attn 2 (`pip install flash-attn`), CUDA and fp16/bf16 only.

flash-attn reads the project's cache layout as is: `[num_blocks, block_size, num_kv_heads,
head_dim]` per layer is its paged layout (`page_block_size` = block_size, which must be a
multiple of 256; `selection` refuses other sizes before this module is imported). Its causal
mask is aligned to the bottom-right corner when a sequence has fewer queries than keys, which is
exactly this project's rule that a step's queries are the last `q_len` positions of the context.

- decode-only batch: `flash_attn_with_kvcache`, q `[B, 1, heads, head_dim]`, `cache_seqlens` =
  seq_lens (the new token was stored first, so the cache already holds the whole context). Its
  split heuristic depends on shapes only, so it can be captured in a CUDA graph.
- any other batch: `flash_attn_varlen_func` with `block_table`, `cu_seqlens_q` =
  query_start_loc and `cu_seqlens_k` = the prefix sums of seq_lens (the context lengths).

K/V are stored by the project's Triton `store_kv` kernel (no host sync for padding slots).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rank_worker.attention.kernel_store import KernelStoreBackend
from rank_worker.attention.metadata import AttentionMetadata


class FlashAttnBackend(KernelStoreBackend):
    """Attend with flash-attn 2's paged kernels (see the module docstring)."""

    name = "flash_attn"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        del kv_scales  # selection refuses an fp8 cache for flash-attn 2
        if meta.max_query_len == 1:
            out = self._with_kvcache(
                query.unsqueeze(1),  # [B, 1, heads, head_dim]
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,  # [B] int32
                block_table=meta.block_table,  # [B, W] int32
                softmax_scale=scale,
                causal=True,
            )  # [B, 1, heads, head_dim]
            return out.squeeze(1)
        # [B+1] int32 prefix sums of the context lengths: where each sequence's keys would start
        # if they were packed (flash-attn reads them through block_table instead).
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return self._varlen(
            query,  # [T, heads, head_dim]
            k_cache,
            v_cache,
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_table,
        )  # [T, heads, head_dim]
