"""The attention backend interface (the backends are listed, and chosen, in `selection`).

A backend does two things per layer and step, in this order: store the step's new K/V into the
paged cache, then attend from the step's queries over each sequence's cached context. The order
matters: a sequence's new tokens attend to each other, and they find each other in the cache.
Backends are stateless apart from configuration, so one instance serves every layer.

CUDA graphs. A backend with `supports_cuda_graphs` handles a uniform batch, q new tokens for
every sequence (a decode, q = 1; a speculative verify step, q = 1 + k), with device work alone:
no host synchronisation, no host-to-device copy, and the metadata's host fields used only as
bounds to size work (`max_query_len` = q, `max_seq_len` and `seq_lens_host` = max_model_len),
since a captured graph is replayed with other sequence lengths than it was captured with
(`rank_worker.runner.cuda_graphs`). Padding sequences have seq_len q over a dummy block, so each of
their query rows sees at least one key. How each backend keeps the contract:

- triton: q = 1 takes the decode kernel (device seq_lens and table); q > 1 one launch of the
  paged prefill kernel, whose grid is `(cdiv(max_query_len, BLOCK_M), num_seqs, kv_heads)`
  from the host bound and the tensors' shapes, every length read on the device. A uniform batch
  is never taken for fresh prompts (the graph runner never captures q >= max_model_len, the
  only case where the bounds say so), so the TMA path, which ignores the cache, is not chosen.
- flash_attn: q = 1 `flash_attn_with_kvcache`, q > 1 `flash_attn_varlen_func` with the block
  table, `cu_seqlens_k` summed on the device and the bounds as max_seqlen_q / max_seqlen_k;
  the wrapper reads nothing back (that flash-attn's own host code does not either, for the
  paged varlen path, is not yet checked on a GPU).
- torch: `supports_cuda_graphs` False (it loops on host values). On the padded path run
  eagerly (tests) the bounds are still correct: it gathers max_model_len positions of every
  sequence through its whole (valid) table row and masks with the device seq_lens.

Mixed steps (prompt tokens, alone or beside decodes) are captured too, by token count
(`rank_worker.runner.mixed_graphs`), under the same contract: their host fields are the
capture's (`max_query_len` = the bucket's T, a layout without leading decodes and no fresh
prefill), so triton launches the prefill kernel once over every row, decodes included, and
flash_attn its varlen call; every length is read on the device.

Cache layout (per layer, K and V alike): `[num_blocks, block_size, num_kv_heads, head_dim]`,
token `i` of a sequence at `cache[block_table[i // block_size], i % block_size]`.

FP8 cache (`kv_cache_dtype="fp8"`): the caches are float8_e4m3fn and hold `K / k_scale` and
`V / v_scale`, saturated to ±448; `kv_scales [2]` fp32 `(k_scale, v_scale)` is the layer's
(`Qwen3Attention.kv_scales`). Store quantizes, attend dequantizes as it reads. A cache in the
model dtype ignores `kv_scales`. Which it is follows from the cache's dtype, fixed at start-up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from rank_worker.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over a `[num_blocks, block_size, num_kv_heads, head_dim]` KV cache."""

    name: str
    # Uniform batches (q tokens per sequence) may be captured in a CUDA graph (see the module
    # docstring).
    supports_cuda_graphs: bool = False
    # `forward` may attend a fresh prompt from the step's own K/V rather than the cache (the
    # triton backend's TMA prefill): a layer that stores K/V itself calls `forward` on the
    # steps `attends_fresh_kv` names, `attend` on the others.
    reads_fresh_kv: bool = False

    def may_attend_fresh_kv(
        self, dtype: torch.dtype, head_dim: int, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> bool:
        """Whether `attends_fresh_kv` can say yes this step for queries of `dtype` and
        `head_dim`: a step-wide answer, cheap, so that a layer builds the views
        `attends_fresh_kv` takes only when it can."""
        return self.reads_fresh_kv

    def attends_fresh_kv(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> bool:
        """Whether `forward` attends this step from its own K/V (then the layer must call it)."""
        return False

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Write `key`/`value [T, num_kv_heads, head_dim]` into their slots (slot < 0: skip)."""

    @abstractmethod
    def attend(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of `query [T, num_heads, head_dim]` over each sequence's cached
        context; returns `[T, num_heads, head_dim]`. Query heads map to KV heads in groups of
        `num_heads // num_kv_heads` (GQA)."""

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
        """Store this step's K/V for all tokens, then attend."""
        k_cache, v_cache = kv_cache
        self.store_kv(key, value, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return self.attend(query, k_cache, v_cache, meta, scale, kv_scales)
