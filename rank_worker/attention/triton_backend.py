"""Paged attention with the project's Triton kernels (`kernels/`).

Two kernels, chosen per batch from the metadata alone (no device-to-host copy):

- decode-only batch (every sequence has one new token, `max_query_len == 1`): the paged decode
  kernel, one query row per sequence, split-KV over long contexts. This is the batch shape that
  CUDA graphs capture, and the kernel needs nothing from the host but the shapes.
- a mixed batch: the leading decode rows (the scheduler puts running decodes first) go to the
  decode kernel, so a decode over a long context is still split across programs; the remaining
  rows (prefills, chunks after a cached prefix) are one launch of the paged prefill kernel. Both
  write their rows of one output tensor (no copies), both over the layer's whole query (the
  decode kernel's first rows, the prefill kernel's rows by the step's absolute offsets); the
  step's seq_lens and block table they get as slices at offsets that change from step to step,
  which the kernels do not specialise on.

Which launches, with which grids and tiles, is decided and checked once per step by the first
layer (`triton_plan`); every other layer's `attend` is the launches.
- a batch with no leading decodes: one launch of the prefill kernel (it treats a one-token
  sequence as a query at its last position). A speculative verify step of q tokens in every
  sequence is one, and CUDA graphs capture it too: the grid comes from `max_query_len` (q) and
  the shapes, the lengths from the device.
- a batch whose non-decode sequences are all fresh prompts (no cached prefix, no earlier
  chunk), when the prefill table (`kernels.attention_tables`, or $TP_ENGINE_PREFILL_KERNEL=tma)
  names the "tma" kernel for the longest prompt: those rows attend from the step's own dense
  K/V rows through TMA descriptors (`kernels.prefill_attention_tma`) instead of reading the pages
  back; the leading decodes still take the decode kernel. Hence `forward` is overridden: the
  dense K/V are only there, not in `attend`.

Triton reads the device from the tensors' current device, so the caller must have set it
(`ModelRunner` does). On CPU the kernels run only under `TRITON_INTERPRET=1` (tests).
"""

from __future__ import annotations

from typing import cast

import torch

from kernels.attention_tables import Tile, prefill_tile, tables
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention_tma import (
    fresh_prefill_attention,
    interpreted,
    unusable_reason,
)
from rank_worker.attention.kernel_store import KernelStoreBackend
from rank_worker.attention.metadata import AttentionMetadata
from rank_worker.attention.triton_plan import step_attention


class TritonAttentionBackend(KernelStoreBackend):
    """Store with the store_kv kernel; attend with the decode or the prefill kernel."""

    name = "triton"
    supports_cuda_graphs = True
    reads_fresh_kv = True

    def __init__(self) -> None:
        # The tile tables are read (and a malformed one refused) now, at start-up, rather than
        # at the first decode step of a serving engine.
        tables()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store this step's K/V, then attend: fresh prompts from the dense K/V when the prefill
        table says so (see the module docstring), everything else from the cache."""
        k_cache, v_cache = kv_cache
        tile = self._fresh_prefill_tile(query, key, value, k_cache, meta)
        if tile is None:
            return super().forward(query, key, value, kv_cache, meta, scale, kv_scales)
        self.store_kv(key, value, k_cache, v_cache, meta.slot_mapping, kv_scales)
        n = meta.num_leading_decodes
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, heads, d]
        if n:
            paged_decode_attention(
                query[:n], k_cache, v_cache, meta.seq_lens[:n], meta.block_table[:n], scale,
                out=out[:n], kv_scales=kv_scales,
            )  # fmt: skip
        fresh_prefill_attention(
            query[n:], key[n:], value[n:], _rebased_query_start_loc(meta), meta.max_query_len,
            scale, out=out[n:], tile=tile,
        )  # fmt: skip
        return out

    def attends_fresh_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> bool:
        return self._fresh_prefill_tile(query, key, value, k_cache, meta) is not None

    def may_attend_fresh_kv(
        self, dtype: torch.dtype, head_dim: int, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> bool:
        return _step_fresh_tile(dtype, head_dim, k_cache, meta) is not None

    @staticmethod
    def _fresh_prefill_tile(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> Tile | None:
        """The TMA kernel's tile when it takes this step's prompts, else None: the step's
        choice (`_step_fresh_tile`), then whether descriptors can cover these tensors."""
        tile = _step_fresh_tile(query.dtype, query.shape[-1], k_cache, meta)
        if tile is None or unusable_reason(query, key, value) is not None:
            return None
        return tile

    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The step's plan (`triton_plan`: made and checked by the first layer), launched."""
        return step_attention(query, k_cache, v_cache, meta, scale, kv_scales)(
            query, k_cache, v_cache, kv_scales
        )


def _step_fresh_tile(
    dtype: torch.dtype, head_dim: int, k_cache: torch.Tensor, meta: AttentionMetadata
) -> Tile | None:
    """The TMA kernel's tile if the prefill table gives it this step's fresh prompts, decided
    once per step (the metadata's `launches`). Not with an fp8 cache: the dense K/V are not the
    quantized values the other steps read."""
    if meta.max_query_len == 1 or not meta.fresh_prefill or k_cache.dtype != dtype:
        return None
    key = ("fresh_tile", dtype, head_dim, k_cache.device)
    if key not in meta.launches:
        tile = prefill_tile(meta.max_query_len, dtype, head_dim, k_cache.device, interpreted())
        meta.launches[key] = tile if tile.kernel == "tma" else None
    return cast("Tile | None", meta.launches[key])


def _rebased_query_start_loc(meta: AttentionMetadata) -> torch.Tensor:
    """The offsets of the rows after the leading decodes, from 0: the TMA kernel gets those
    rows as tensors of their own. Computed once per step, on the device (decode rows are one
    token each, so the prefill rows start at token n)."""
    n = meta.num_leading_decodes
    if n == 0:
        return meta.query_start_loc
    key = "rebased_query_start_loc"
    if key not in meta.launches:
        meta.launches[key] = meta.query_start_loc[n:] - n
    return cast(torch.Tensor, meta.launches[key])
