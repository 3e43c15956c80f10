"""Paged attention with the project's Triton kernels (`kernels/`).

Two kernels, chosen per batch from the metadata alone (no device-to-host copy):

- decode-only batch (every sequence has one new token, `max_query_len == 1`): the paged decode
  kernel, one query row per sequence, split-KV over long contexts. This is the batch shape that
  CUDA graphs capture, and the kernel needs nothing from the host but the shapes.
- a mixed batch: the leading decode rows (the scheduler puts running decodes first) go to the
  decode kernel, so a decode over a long context is still split across programs; the remaining
  rows (prefills, chunks after a cached prefix) are one launch of the paged prefill kernel. Both
  write their rows of one output tensor (no copies); their inputs are slices of the step's
  tensors at offsets that change from step to step, which the kernels do not specialise on.
- a batch with no leading decodes: one launch of the prefill kernel (it treats a one-token
  sequence as a query at its last position).

Triton reads the device from the tensors' current device, so the caller must have set it
(`ModelRunner` does). On CPU the kernels run only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

import torch

from kernels.attention_tables import tables
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from rank_worker.attention.kernel_store import KernelStoreBackend
from rank_worker.attention.metadata import AttentionMetadata


class TritonAttentionBackend(KernelStoreBackend):
    """Store with the store_kv kernel; attend with the decode or the prefill kernel."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        # The tile tables are read (and a malformed one refused) now, at start-up, rather than
        # at the first decode step of a serving engine.
        tables()

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.max_query_len == 1:
            # One row per sequence: query [B, num_heads, head_dim].
            return paged_decode_attention(
                query, k_cache, v_cache, meta.seq_lens, meta.block_table, scale,
                kv_scales=kv_scales,
            )  # fmt: skip
        n = meta.num_leading_decodes
        if n == 0:
            return self._prefill(
                query, k_cache, v_cache, meta, meta.query_start_loc, 0, scale, kv_scales
            )
        assert meta.prefill_query_start_loc is not None  # set by prepare_inputs when 0 < n < B
        # [T, num_heads, head_dim]; query may be a strided view (of the QKV projection).
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        paged_decode_attention(
            query[:n], k_cache, v_cache, meta.seq_lens[:n], meta.block_table[:n], scale,
            out=out[:n], kv_scales=kv_scales,
        )  # fmt: skip
        self._prefill(
            query[n:], k_cache, v_cache, meta, meta.prefill_query_start_loc, n, scale,
            kv_scales, out[n:],
        )  # fmt: skip
        return out

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        query_start_loc: torch.Tensor,
        first_seq: int,
        scale: float,
        kv_scales: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The prefill kernel over sequences `first_seq:` (their rows are `query`), into `out`
        when given."""
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            query_start_loc,
            meta.seq_lens[first_seq:],
            meta.block_table[first_seq:],
            meta.max_query_len,
            scale,
            out=out,
            kv_scales=kv_scales,
        )
