"""The attention backend interface and the registry of backends.

A backend does two things per layer and step, in this order: store the step's new K/V into the
paged cache, then attend from the step's queries over each sequence's cached context. The order
matters: a sequence's new tokens attend to each other, and they find each other in the cache.
Backends are stateless apart from configuration, so one instance serves every layer.

Cache layout (per layer, K and V alike): `[num_blocks, block_size, num_kv_heads, head_dim]`,
token `i` of a sequence at `cache[block_table[i // block_size], i % block_size]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from rank_worker.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over a `[num_blocks, block_size, num_kv_heads, head_dim]` KV cache."""

    name: str

    @abstractmethod
    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
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
    ) -> torch.Tensor:
        """Store this step's K/V for all tokens, then attend."""
        k_cache, v_cache = kv_cache
        self.store_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        return self.attend(query, k_cache, v_cache, meta, scale)


def get_backend(name: str = "torch") -> AttentionBackend:
    """The backend called `name` ("torch" for now; "triton" and "flash_attn" come later)."""
    if name == "torch":
        from rank_worker.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; available: 'torch'")
