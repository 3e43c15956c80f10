"""Paged attention with the project's Triton kernels (`kernels/`).

Two kernels, chosen per batch from the metadata alone (no device-to-host copy):

- decode-only batch (every sequence has one new token, `max_query_len == 1`): the paged decode
  kernel, one query row per sequence, split-KV over long contexts. This is the batch shape that
  CUDA graphs capture, and the kernel needs nothing from the host but the shapes.
- any other batch (prefills, prefill chunks after a cached prefix, and any decodes scheduled in
  the same step): ONE launch of the paged prefill kernel over the whole batch. That kernel
  already treats a decode as a sequence whose query is its last position, so a mixed batch needs
  no split into two launches and no gather/scatter of rows; the decodes in a mixed step are few
  next to the prefill tokens that fill the step's token budget, so their share of a
  prefill-shaped grid costs little.

Triton reads the device from the tensors' current device, so the caller must have set it
(`ModelRunner` does). On CPU the kernels run only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch

from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv
from rank_worker.attention.backend import AttentionBackend
from rank_worker.attention.metadata import AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    """Store with the store_kv kernel; attend with the decode or the prefill kernel."""

    name = "triton"
    supports_cuda_graphs = True

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # The kernel skips negative slots on the device, so padding rows cost no host sync.
        store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if meta.max_query_len == 1:
            # One row per sequence: query [B, num_heads, head_dim].
            return paged_decode_attention(
                query, k_cache, v_cache, meta.seq_lens, meta.block_table, scale
            )
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.max_query_len,
            scale,
        )
