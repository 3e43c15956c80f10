"""The ranks' half of KV tiers: carrying out rank 0's `BlockCopy` decisions on this rank's shard.

Rank 0's KV manager decides which blocks move between tiers (`tp_engine.core.kv.base`); each
rank copies its own heads' K/V of those blocks, every layer, before the forward pass that reads
them. A `BlockCopier` per pair of tiers does it: `DeviceBlockCopier` within the device cache
(`rank_worker.kv.cache` layout), `HostBlockCopier` between it and a host pool (pinned on a
GPU), on a side stream that overlaps the copies up with the forward pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from rank_worker.kv.side_stream import ImmediateSideStream, SideStream, side_stream_for
from rank_worker.models.qwen3 import KVCachePair
from rank_worker.tp import TPInfo
from shm_ipc import kv_files
from shm_ipc.block_copies import (
    DEVICE_TIER,
    FILE_TIER,
    HOST_TIER,
    BlockCopy,
    decode_block_copies,
)
from shm_ipc.step_plan import StepPlan

__all__ = [
    "BlockCopier",
    "BlockFiles",
    "DeviceBlockCopier",
    "HostBlockCopier",
    "PlanCopier",
    "host_pool_blocks",
    "queue_plan_copies",
]

logger = logging.getLogger(__name__)


class PlanCopier(Protocol):
    """What runs a plan's block copies on a rank (`queue_plan_copies`): the host KV tier's
    pool, or a prefill/decode staging pool in front of it (`rank_worker.kv.pd_staging`)."""

    def rebind(self, kv_caches: list[KVCachePair]) -> None: ...

    def before_forward(self, copies: Sequence[BlockCopy], reads_copies_up: bool) -> None: ...

    def after_forward(self) -> None: ...


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
    on a side stream (`rank_worker.kv.side_stream`) so that copies up overlap the forward pass of
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
        self,
        kv_caches: list[KVCachePair],
        num_host_blocks: int,
        stream: SideStream | None = None,
        files: BlockFiles | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("a host pool needs the device cache's layers")
        first = kv_caches[0][0]
        if any(c.shape != first.shape or c.dtype != first.dtype for p in kv_caches for c in p):
            raise ValueError("a host pool needs every layer's K and V cache in one shape and dtype")
        self.device = DeviceBlockCopier(kv_caches)
        self.num_host_blocks = num_host_blocks
        self.stream: SideStream = stream if stream is not None else ImmediateSideStream()
        self.files = files
        # Not zeroed: a host block is read only after a copy down wrote it.
        self.host = torch.empty(
            (num_host_blocks, len(kv_caches), 2, *first.shape[1:]),
            dtype=first.dtype,
            pin_memory=first.is_cuda,
        )
        # The event of the last plan's copies up that no forward pass has waited for yet.
        self._up_pending: object | None = None
        # This plan's writes to files, run after its forward pass once its copies down are done.
        self._writes: list[BlockCopy] = []
        self._down_done: object | None = None

    @classmethod
    def of_size(
        cls, size_gib: float, kv_caches: list[KVCachePair], file_dir: str | None, tp: TPInfo
    ) -> HostBlockCopier:
        """A pool of `size_gib` GiB beside `kv_caches`, copying on the device's side stream,
        with this rank's block files in `file_dir` (None: no file tier)."""
        device = kv_caches[0][0].device
        num_blocks = host_pool_blocks(size_gib, kv_caches)
        files = None if file_dir is None else BlockFiles(Path(file_dir), tp.rank, tp.size)
        return cls(kv_caches, num_blocks, side_stream_for(device), files)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the pool (and in a block file's payload)."""
        return self.host[0].numel() * self.host.element_size()

    def rebind(self, kv_caches: list[KVCachePair]) -> None:
        """Use `kv_caches` as the device cache from now on (allocated again after a wake); the
        host pool and what it holds stay."""
        if kv_caches is not self.device.kv_caches:
            self.device = DeviceBlockCopier(kv_caches)

    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """`BlockCopier.copy`: every copy done before the compute stream's next work."""
        self.before_forward(copies, reads_copies_up=True)
        self.after_forward()

    def before_forward(self, copies: Sequence[BlockCopy], reads_copies_up: bool) -> None:
        """Queue one plan's copies (rank 0's order: down, then up) before its forward pass; the
        forward pass waits for the previous plan's copies up, for these copies down, and for
        these copies up too if `reads_copies_up`. Writes to files wait for `after_forward`.
        ValueError (nothing queued) for a tier this copier does not serve or a block id out of
        range."""
        if self._up_pending is not None:
            self.stream.wait(self._up_pending)
            self._up_pending = None
        for c in copies:
            self._check(c)
        down = [c for c in copies if c.dst == HOST_TIER and c.src_blocks.size]
        up = [c for c in copies if c.dst == DEVICE_TIER and c.src_blocks.size]
        self._writes = [c for c in copies if c.dst == FILE_TIER and c.src_blocks.size]
        if down:
            self._down_done = self.stream.run(lambda: self._copy_down(down))
            self.stream.wait(self._down_done)
        if up:
            done = self.stream.run(lambda: self._copy_up(up))
            if reads_copies_up:
                self.stream.wait(done)
            else:
                self._up_pending = done

    def after_forward(self) -> None:
        """Write this plan's blocks to files from the host pool, once its copies down are done
        (the forward pass is queued by now: on a GPU it runs meanwhile). A write that fails
        (a full disk, a read-only directory) turns this rank's writes off with a warning;
        rank 0 finds the file missing and calls the block a miss."""
        writes, self._writes = self._writes, []
        if not writes or self.files is None:
            return
        if self._down_done is not None:
            self.stream.synchronize(self._down_done)
        for c in writes:
            for host_block, key in zip(c.src_blocks.tolist(), c.keys, strict=True):  # type: ignore[arg-type]
                self.files.write(kv_files.key_bytes(key), self._host_bytes(host_block))

    def _host_bytes(self, host_block: int) -> np.ndarray:
        return self.host[host_block].view(-1).view(torch.uint8).numpy()

    def _check(self, c: BlockCopy) -> None:
        pairs = {(HOST_TIER, DEVICE_TIER), (DEVICE_TIER, HOST_TIER), (DEVICE_TIER, DEVICE_TIER)}
        if self.files is not None:
            pairs |= {(HOST_TIER, FILE_TIER), (FILE_TIER, DEVICE_TIER)}
        if (c.src, c.dst) not in pairs:
            raise ValueError(f"no copier for {c.src!r} -> {c.dst!r} on this rank")
        limits = {DEVICE_TIER: self.device.num_blocks, HOST_TIER: self.num_host_blocks}
        for tier, ids in ((c.src, c.src_blocks), (c.dst, c.dst_blocks)):
            if tier != FILE_TIER:
                _check_ids(ids, limits[tier], tier)

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
        """Host blocks (or block files) into device blocks: one copy per block, then scattered
        per layer."""
        kv_caches = self.device.kv_caches
        device = kv_caches[0][0].device
        for c in copies:
            if c.src == DEVICE_TIER:
                self.device.copy([c])
                continue
            staged = torch.empty((c.src_blocks.size, *self.host.shape[1:]), dtype=self.host.dtype,
                                 device=device)  # fmt: skip
            for i, block in enumerate(self._sources(c)):
                staged[i].copy_(block, non_blocking=True)
            dst = torch.as_tensor(c.dst_blocks, dtype=torch.long).to(device)
            for layer, (k, v) in enumerate(kv_caches):
                k.index_copy_(0, dst, staged[:, layer, 0])
                v.index_copy_(0, dst, staged[:, layer, 1])

    def _sources(self, c: BlockCopy) -> list[torch.Tensor]:
        """The blocks a copy up reads: host blocks, or block files read whole (checked)."""
        if c.src == HOST_TIER:
            return [self.host[b] for b in c.src_blocks.tolist()]
        assert self.files is not None and c.keys is not None
        shape, dtype = self.host.shape[1:], self.host.dtype
        return [
            torch.frombuffer(self.files.read(kv_files.key_bytes(key), self.block_bytes),
                             dtype=torch.uint8).view(dtype).view(shape)
            for key in c.keys
        ]  # fmt: skip


class BlockFiles:
    """This rank's block files in `directory` (`shm_ipc.kv_files`)."""

    def __init__(self, directory: Path, rank: int, world: int) -> None:
        self.directory = directory
        self.rank = rank
        self.world = world
        self.writable = True

    def write(self, key: bytes, payload: np.ndarray) -> None:
        if not self.writable:
            return
        try:
            kv_files.write(self._path(key), key, payload)
        except OSError as exc:
            self.writable = False
            logger.warning(
                "rank %d: KV file tier writes off: %s (%s); blocks already there are still read",
                self.rank, self.directory, exc,
            )  # fmt: skip

    def read(self, key: bytes, num_bytes: int) -> bytearray:
        """The payload of `key`'s file (checked); RuntimeError if it is not whole and
        unchanged (rank 0 checked it before calling it a hit: something changed it since)."""
        path = self._path(key)
        payload = kv_files.read(path, key, num_bytes)
        if payload is None:
            raise RuntimeError(
                f"rank {self.rank}: KV block file {path} changed after rank 0 checked it"
            )
        return bytearray(payload)

    def _path(self, key: bytes) -> Path:
        return kv_files.block_file(self.directory, key, self.rank, self.world)


def queue_plan_copies(
    pool: PlanCopier | None, kv_caches: list[KVCachePair], plan: StepPlan
) -> None:
    """`plan`'s KV block copies between tiers, queued before its forward pass (which waits for
    what it reads: `HostBlockCopier.before_forward`); ValueError for copies on a rank without
    a pool for them."""
    copies, reads_copies_up = decode_block_copies(plan.section("block_copies"))
    if pool is None:
        if copies:
            raise ValueError(f"step {plan.step_id}: block copies, but no host KV tier here")
        return
    pool.rebind(kv_caches)
    pool.before_forward(copies, reads_copies_up)
