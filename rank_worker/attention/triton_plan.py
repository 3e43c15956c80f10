"""The triton backend's attention of one step, decided once and launched by every layer.

An eager step calls the backend once per layer (28 times for Qwen3-0.6B) with the same
metadata and tensors laid out alike: the step's queries (a view of a fresh QKV output of one
shape), the layer's caches and fp8 scales (allocated alike for every layer). Everything the
kernels' wrappers check and decide is a function of the metadata and of those layouts: which
kernels take which rows, the grids and tiles, the split count and its buffers, the slices of
the step's tensors. So the first layer of a step plans it (`StepAttention.plan`, every check of
`paged_decode_attention` / `paged_prefill_attention`), the plan is kept in the metadata's
`launches` under the layouts of the per-layer tensors it was planned with
(`plan_key`), and each layer whose tensors have those layouts only allocates its output and
launches. A layer with other layouts (another model's layer on the same metadata: an EAGLE-3
head, a different head count) gets a plan of its own, checked in full.

A mixed batch (leading decodes, then prefills) launches both kernels over the layer's whole
query and output: the decode kernel over the first `n` rows (it reads row `i` for program
`i`), the prefill kernel with the step's own `query_start_loc[n:]`, whose offsets are absolute
rows. So no layer slices its query or its output, and no offsets are rebased.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import cast

import torch

from kernels._common import layout
from kernels.decode_attention import DecodeLaunch, plan_decode_attention
from kernels.prefill_attention import PrefillLaunch, plan_prefill_attention
from rank_worker.attention.metadata import AttentionMetadata


def plan_key(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None,
) -> Hashable:
    """What a step's plan depends on besides the metadata: the per-layer tensors' layouts."""
    scales = None if kv_scales is None else layout(kv_scales)
    return ("attend", layout(query), layout(k_cache), layout(v_cache), scales, scale)


class StepAttention:
    """The launches of one step's attention for one geometry: the decode kernel's over the
    leading decodes (or the whole decode batch), the prefill kernel's over the rest."""

    def __init__(self, launches: tuple[DecodeLaunch | PrefillLaunch, ...]) -> None:
        self.launches = launches

    @classmethod
    def plan(
        cls,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None,
    ) -> StepAttention:
        """Check and decide, for tensors of these layouts over `meta`'s batch."""
        if meta.max_query_len == 1:  # one row per sequence: query [B, num_heads, head_dim]
            decode = plan_decode_attention(
                query, k_cache, v_cache, meta.seq_lens, meta.block_table, scale,
                kv_scales=kv_scales,
            )  # fmt: skip
            return cls((decode,))
        n = meta.num_leading_decodes
        prefill = plan_prefill_attention(
            query, k_cache, v_cache, meta.query_start_loc[n:], meta.seq_lens[n:],
            meta.block_table[n:], meta.max_query_len, scale, kv_scales,
        )  # fmt: skip
        if n == 0:
            return cls((prefill,))
        # The decode rows are planned as the first n rows of the query; the launch gets the
        # whole query, whose first rows those are.
        decode = plan_decode_attention(
            query[:n], k_cache, v_cache, meta.seq_lens[:n], meta.block_table[:n], scale,
            kv_scales=kv_scales,
        )  # fmt: skip
        return cls((decode, prefill))

    def __call__(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_scales: torch.Tensor | None,
    ) -> torch.Tensor:
        """One layer's attention: `[T, num_heads, head_dim]`, a new contiguous tensor."""
        # Contiguous, the query's shape (the query itself is a strided view of the QKV rows).
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        for launch in self.launches:
            launch(query, k_cache, v_cache, kv_scales, out)
        return out


def step_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: torch.Tensor | None,
) -> StepAttention:
    """This step's plan for tensors of these layouts: the one an earlier layer made, or a new
    one (checked in full) kept for the layers after."""
    key = plan_key(query, k_cache, v_cache, scale, kv_scales)
    planned = meta.launches.get(key)
    if planned is None:
        planned = meta.launches[key] = StepAttention.plan(
            query, k_cache, v_cache, meta, scale, kv_scales
        )
    return cast(StepAttention, planned)
