"""The ranks' half of KV tiers: carrying out rank 0's `BlockCopy` decisions on this rank's shard.

Rank 0's KV manager decides which blocks move between tiers (`tp_engine.core.kv.base`); each
rank copies its own heads' K/V of those blocks, every layer, before the forward pass that reads
them. A `BlockCopier` per pair of tiers does it: `DeviceBlockCopier` within the device cache
(`rank_worker.kv_cache` layout), `HostBlockCopier` between it and a host pool (pinned on a
GPU), on a side stream that overlaps the copies up with the forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from rank_worker.qwen3 import KVCachePair
from rank_worker.side_stream import ImmediateSideStream, SideStream, side_stream_for
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
    """Copies between the device cache and this rank's host pool of `num_host_blocks` blocks,
    on a side stream (`rank_worker.side_stream`) so that copies up overlap the forward pass of
    the plan that carries them; copies within the device cache go to a `DeviceBlockCopier`.

    The pool holds a block's K and V of every layer in one piece, `[num_host_blocks, layers, 2,
    block_size, num_local_kv_heads, head_dim]` (pinned when the cache is on a GPU), so a block
    crosses the bus in one copy each way; on the device side a step's blocks are gathered or
    scattered per layer. Every layer's cache must then have one shape and dtype.

    Order against the forward passes (`before_forward`, once per plan): copies down run first
    and the plan's forward pass waits for them (it may overwrite those device blocks); copies up
    run after them and only the next plan's forward pass waits for them, unless rank 0 says this
    plan reads them itself (`reads_copies_up`: it scheduled nothing else to overlap with)."""

    tiers = frozenset({DEVICE_TIER, HOST_TIER})

    def __init__(
        self, kv_caches: list[KVCachePair], num_host_blocks: int, stream: SideStream | None = None
    ) -> None:
        if not kv_caches:
            raise ValueError("a host pool needs the device cache's layers")
        first = kv_caches[0][0]
        if any(c.shape != first.shape or c.dtype != first.dtype for p in kv_caches for c in p):
            raise ValueError("a host pool needs every layer's K and V cache in one shape and dtype")
        self.device = DeviceBlockCopier(kv_caches)
        self.num_host_blocks = num_host_blocks
        self.stream: SideStream = stream if stream is not None else ImmediateSideStream()
        # Not zeroed: a host block is read only after a copy down wrote it.
        self.host = torch.empty(
            (num_host_blocks, len(kv_caches), 2, *first.shape[1:]),
            dtype=first.dtype,
            pin_memory=first.is_cuda,
        )
        # The event of the last plan's copies up that no forward pass has waited for yet.
        self._up_pending: object | None = None

    @classmethod
    def of_size(cls, size_gib: float, kv_caches: list[KVCachePair]) -> HostBlockCopier:
        """A pool of `size_gib` GiB beside `kv_caches`, copying on the device's side stream."""
        device = kv_caches[0][0].device
        return cls(kv_caches, host_pool_blocks(size_gib, kv_caches), side_stream_for(device))

    def rebind(self, kv_caches: list[KVCachePair]) -> None:
        """Use `kv_caches` as the device cache from now on (allocated again after a wake); the
        host pool and what it holds stay."""
        if kv_caches is not self.device.kv_caches:
            self.device = DeviceBlockCopier(kv_caches)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """`BlockCopier.copy`: every copy done before the compute stream's next work."""
        self.before_forward(copies, reads_copies_up=True)

    def before_forward(self, copies: Sequence[BlockCopy], reads_copies_up: bool) -> None:
        """Queue one plan's copies (rank 0's order: down, then up) before its forward pass; the
        forward pass waits for the previous plan's copies up, for these copies down, and for
        these copies up too if `reads_copies_up`. ValueError (nothing queued) for a tier this
        copier does not serve or a block id out of range."""
        if self._up_pending is not None:
            self.stream.wait(self._up_pending)
            self._up_pending = None
        for c in copies:
            self._check(c)
        down = [c for c in copies if c.dst == HOST_TIER and c.src_blocks.size]
        up = [c for c in copies if c.dst == DEVICE_TIER and c.src_blocks.size]
        if down:
            self.stream.wait(self.stream.run(lambda: self._copy_down(down)))
        if up:
            done = self.stream.run(lambda: self._copy_up(up))
            if reads_copies_up:
                self.stream.wait(done)
            else:
                self._up_pending = done

    def _check(self, c: BlockCopy) -> None:
        if (c.src, c.dst) not in (
            (HOST_TIER, DEVICE_TIER), (DEVICE_TIER, HOST_TIER), (DEVICE_TIER, DEVICE_TIER)
        ):  # fmt: skip
            raise ValueError(f"no copier for {c.src!r} -> {c.dst!r} on this rank")
        limits = {DEVICE_TIER: self.device.num_blocks, HOST_TIER: self.num_host_blocks}
        _check_ids(c.src_blocks, limits[c.src], c.src)
        _check_ids(c.dst_blocks, limits[c.dst], c.dst)

    def _copy_down(self, copies: list[BlockCopy]) -> None:
        """Device blocks into host blocks: gathered on the device, then one copy per block."""
        kv_caches = self.device.kv_caches
        for c in copies:
            src = torch.as_tensor(c.src_blocks, dtype=torch.long).to(kv_caches[0][0].device)
            staged = torch.stack(
                [torch.stack((k.index_select(0, src), v.index_select(0, src)), 1)
                 for k, v in kv_caches], 1,
            )  # fmt: skip
            for i, host_block in enumerate(c.dst_blocks.tolist()):
                self.host[host_block].copy_(staged[i], non_blocking=True)

    def _copy_up(self, copies: list[BlockCopy]) -> None:
        """Host blocks into device blocks: one copy per block, then scattered per layer."""
        kv_caches = self.device.kv_caches
        device = kv_caches[0][0].device
        for c in copies:
            if c.src == DEVICE_TIER:
                self.device.copy([c])
                continue
            staged = torch.empty((c.src_blocks.size, *self.host.shape[1:]), dtype=self.host.dtype,
                                 device=device)  # fmt: skip
            for i, host_block in enumerate(c.src_blocks.tolist()):
                staged[i].copy_(self.host[host_block], non_blocking=True)
            dst = torch.as_tensor(c.dst_blocks, dtype=torch.long).to(device)
            for layer, (k, v) in enumerate(kv_caches):
                k.index_copy_(0, dst, staged[:, layer, 0])
                v.index_copy_(0, dst, staged[:, layer, 1])
