"""The ranks' half of KV tiers: carrying out rank 0's `BlockCopy` decisions on this rank's shard.

Rank 0's KV manager decides which blocks move between tiers (`tp_engine.core.kv.base`); each
rank copies its own heads' K/V of those blocks, every layer, before the forward pass that reads
them. A `BlockCopier` per pair of tiers does it: `DeviceBlockCopier` within the device cache
(`rank_worker.kv_cache` layout), `HostBlockCopier` between it and a host pool of the same
layout per block (pinned on a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from rank_worker.qwen3 import KVCachePair
from shm_ipc.block_copies import DEVICE_TIER, HOST_TIER, BlockCopy

__all__ = ["BlockCopier", "DeviceBlockCopier", "HostBlockCopier", "host_pool_blocks"]


class BlockCopier(Protocol):
    """Carries out block copies between the tiers it knows, on this rank."""

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Do `copies` in order (a later copy may read what an earlier one wrote); raise
        ValueError for a tier it does not serve or a block id out of range."""


def _check_ids(ids: np.ndarray, limit: int, tier: str) -> None:
    if ids.size and not (ids.min() >= 0 and ids.max() < limit):
        raise ValueError(f"{tier} block ids {ids.tolist()} outside [0, {limit})")


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
            _check_ids(c.src_blocks, self.num_blocks, c.src)
            _check_ids(c.dst_blocks, self.num_blocks, c.dst)
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


def host_pool_blocks(size_gib: float, kv_caches: list[KVCachePair]) -> int:
    """How many blocks `size_gib` GiB of host memory holds in the device cache's layout (K and
    V of every layer per block); ValueError when not even one."""
    block_bytes = sum(c[0].numel() * c.element_size() for pair in kv_caches for c in pair)
    num_blocks = int(size_gib * (1 << 30)) // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_offloading_size {size_gib} GiB holds no KV block of {block_bytes} bytes"
        )
    return num_blocks


class HostBlockCopier:
    """Copies between the device cache and this rank's host pool: `num_host_blocks` blocks per
    layer for K and for V, each `[block_size, num_local_kv_heads, head_dim]` as in the device
    cache, pinned when the cache is on a GPU (so copies up can be asynchronous). Copies within
    the device cache go to a `DeviceBlockCopier`."""

    tiers = frozenset({DEVICE_TIER, HOST_TIER})

    def __init__(self, kv_caches: list[KVCachePair], num_host_blocks: int) -> None:
        if not kv_caches:
            raise ValueError("a host pool needs the device cache's layers")
        self.device = DeviceBlockCopier(kv_caches)
        self.num_host_blocks = num_host_blocks
        pin = kv_caches[0][0].is_cuda
        # Per layer (k, v), each [num_host_blocks, block_size, num_local_kv_heads, head_dim].
        self.host: list[tuple[torch.Tensor, torch.Tensor]] = [
            tuple(  # type: ignore[misc]
                torch.zeros((num_host_blocks, *c.shape[1:]), dtype=c.dtype, pin_memory=pin)
                for c in pair
            )
            for pair in kv_caches
        ]

    def rebind(self, kv_caches: list[KVCachePair]) -> None:
        """Use `kv_caches` as the device cache from now on (allocated again after a wake); the
        host pool and what it holds stay."""
        if kv_caches is not self.device.kv_caches:
            self.device = DeviceBlockCopier(kv_caches)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        for c in copies:
            if c.src == c.dst == DEVICE_TIER:
                self.device.copy([c])
                continue
            if (c.src, c.dst) not in ((HOST_TIER, DEVICE_TIER), (DEVICE_TIER, HOST_TIER)):
                raise ValueError(f"no copier for {c.src!r} -> {c.dst!r} on this rank")
            limits = {DEVICE_TIER: self.device.num_blocks, HOST_TIER: self.num_host_blocks}
            _check_ids(c.src_blocks, limits[c.src], c.src)
            _check_ids(c.dst_blocks, limits[c.dst], c.dst)
            if not c.src_blocks.size:
                continue
            device = self.device.kv_caches[0][0].device
            on_host = {HOST_TIER: torch.device("cpu"), DEVICE_TIER: device}
            src = torch.as_tensor(c.src_blocks, dtype=torch.long, device=on_host[c.src])
            dst = torch.as_tensor(c.dst_blocks, dtype=torch.long, device=on_host[c.dst])
            for device_pair, host_pair in zip(self.device.kv_caches, self.host, strict=True):
                for device_cache, host_cache in zip(device_pair, host_pair, strict=True):
                    if c.src == HOST_TIER:  # up: the forward pass reads them next
                        rows = host_cache.index_select(0, src).to(device, non_blocking=True)
                        device_cache.index_copy_(0, dst, rows)
                    else:  # down: before the device blocks are reused
                        host_cache.index_copy_(0, dst, device_cache.index_select(0, src).cpu())
