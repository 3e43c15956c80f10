"""The ranks' half of KV tiers: carrying out rank 0's `BlockCopy` decisions on this rank's shard.

Rank 0's KV manager decides which blocks move between tiers (`tp_engine.core.kv.base`); each
rank copies its own heads' K/V of those blocks, every layer, before the forward pass that reads
them. A `BlockCopier` per pair of tiers does it; `DeviceBlockCopier`, within the device cache
(`rank_worker.kv_cache` layout), is the one implementation today: a host-memory tier (a later
issue) adds a copier between the device cache and pinned host blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from rank_worker.qwen3 import KVCachePair
from shm_ipc.block_copies import DEVICE_TIER, BlockCopy

__all__ = ["BlockCopier", "DeviceBlockCopier"]


class BlockCopier(Protocol):
    """Carries out block copies between the tiers it knows, on this rank."""

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Do `copies` in order (a later copy may read what an earlier one wrote); raise
        ValueError for a tier it does not serve or a block id out of range."""


class DeviceBlockCopier:
    """Copies between blocks of the device cache: `kv_caches`, one `(k, v)` pair per layer,
    each `[num_blocks, block_size, num_local_kv_heads, head_dim]`."""

    tiers = frozenset({DEVICE_TIER})

    def __init__(self, kv_caches: list[KVCachePair]) -> None:
        self.kv_caches = kv_caches
        self.num_blocks = kv_caches[0][0].shape[0] if kv_caches else 0

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        for c in copies:
            if c.src not in self.tiers or c.dst not in self.tiers:
                raise ValueError(f"no copier for {c.src!r} -> {c.dst!r} on this rank")
            for ids in (c.src_blocks, c.dst_blocks):
                if ids.size and not (ids.min() >= 0 and ids.max() < self.num_blocks):
                    raise ValueError(f"block ids {ids.tolist()} outside [0, {self.num_blocks})")
            if not c.src_blocks.size:
                continue
            device = self.kv_caches[0][0].device
            src = torch.as_tensor(c.src_blocks, dtype=torch.long, device=device)
            dst = torch.as_tensor(c.dst_blocks, dtype=torch.long, device=device)
            for k_cache, v_cache in self.kv_caches:
                # index_select first: a copy whose sources and destinations overlap reads
                # every source before any is written.
                k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
                v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
