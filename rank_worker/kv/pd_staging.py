"""A host staging pool for prefill/decode disaggregation, where a rank's device KV cache cannot
be registered with Mooncake's transfer engine: an RDMA NIC that cannot reach GPU memory, the
engine's CPU wheel on a GPU machine, a registration that fails, or an operator's
`--disaggregation-host-staging on` (the only way it arises on a CPU machine).

The pool has the cache's layout with fewer blocks ("slots"),

    [num_layers, 2 (K, V), num_slots, block_size, num_local_kv_heads, head_dim]

in host memory (pinned beside a GPU cache). Only the pool is registered, and its `KVRegion`
describes it as the cache's would, so a peer addresses slots exactly as it addresses blocks:
neither server knows whether the other stages.

- A prefill rank (the sender) gathers each write order's blocks into slots 0..n-1, at most
  the pool's size at a time, and writes from there (`HostStaging.send`).
- A decode rank (the receiver) is written into slots its rank 0 hands out
  (`tp_engine.server.rank0.disagg.staging`). Once the prefill's status says they are complete,
  rank 0 queues a `BlockCopy` staging → device in the next step plan, which every rank runs on
  its compute stream before that plan's forward pass (`StagingCopier`); when rank 0 has that
  step's tokens, the copy is done on every rank and the slots are free again.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence

import numpy as np
import torch

from rank_worker.kv.copies import PlanCopier
from rank_worker.kv.kv_transfer import KVRegion, KVTransferEngine
from rank_worker.models.qwen3 import KVCachePair
from shm_ipc.block_copies import DEVICE_TIER, STAGING_TIER, BlockCopy

__all__ = ["STAGING_SETTINGS", "HostStaging", "StagingCopier", "staging_reason"]

# `--disaggregation-host-staging`: auto (where the device cache cannot be registered), on, off.
STAGING_SETTINGS = ("auto", "on", "off")
# Mooncake's wheel built without CUDA: its TCP transport copies with memcpy, which cannot read
# or write device memory.
_CPU_WHEEL = "mooncake-transfer-engine-non-cuda"


def staging_reason(setting: str, cache: torch.Tensor) -> str | None:
    """Why this rank must stage through host memory before it tries to register its cache
    (None: register the cache itself; a failed registration under "auto" stages too)."""
    if setting not in STAGING_SETTINGS:
        raise ValueError(f"host staging is one of {STAGING_SETTINGS}, got {setting!r}")
    if setting == "on":
        return "--disaggregation-host-staging on"
    if setting == "auto" and cache.is_cuda and _cpu_wheel_installed():
        return f"Mooncake's CPU wheel ({_CPU_WHEEL}) cannot reach device memory"
    return None


def _cpu_wheel_installed() -> bool:
    try:
        importlib.metadata.distribution(_CPU_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def staging_slots(num_tokens: int, cache: torch.Tensor) -> int:
    """Slots for `num_tokens` tokens, at most the cache's blocks, at least one."""
    block_size, num_blocks = cache.shape[3], cache.shape[2]
    return max(1, min(num_blocks, -(-num_tokens // block_size)))


class HostStaging:
    """The pool beside `cache` (the rank's one-allocation KV cache, `rank_worker.kv.cache`), of
    `num_slots` slots."""

    def __init__(self, cache: torch.Tensor, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a staging pool needs at least one slot, got {num_slots}")
        self.cache = cache
        # Not zeroed: a slot is read only after a transfer or a gather wrote it.
        self.pool = torch.empty(
            (cache.shape[0], 2, num_slots, *cache.shape[3:]),
            dtype=cache.dtype,
            pin_memory=cache.is_cuda,
        )
        self.region = KVRegion.of_cache(self.pool)

    @property
    def num_slots(self) -> int:
        return self.pool.shape[2]

    def send(
        self,
        engine: KVTransferEngine,
        peer_session: str,
        peer_region: KVRegion,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
    ) -> int:
        """Write the cache's `src_blocks` into the peer's `dst_blocks` through the pool, at
        most `num_slots` blocks at a time; the bytes moved. The caller holds `src_blocks`
        (nothing overwrites them meanwhile) and has waited for the work that filled them."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destinations")
        moved = 0
        for start in range(0, len(src_blocks), self.num_slots):
            src = list(src_blocks[start : start + self.num_slots])
            self.gather(src)
            dst = list(dst_blocks[start : start + len(src)])
            moved += engine.write_blocks(
                peer_session, self.region, peer_region, range(len(src)), dst
            )
        return moved

    def gather(self, blocks: Sequence[int]) -> None:
        """Copy the cache's `blocks` (every layer, K and V) into slots 0..len(blocks)-1; the
        slots hold them when it returns."""
        n = len(blocks)
        index = torch.as_tensor(list(blocks), dtype=torch.long, device=self.cache.device)
        if self.cache.is_cuda:
            # Gathered on the device, then one blocking copy across the bus.
            self.pool[:, :, :n].copy_(self.cache.index_select(2, index))
            return
        # Per layer and K/V, straight into the slots: a quarter of the time of one gather of
        # the 6-D cache and a copy (benchmarks/results/cpu/pd-transfer).
        for layer in range(self.cache.shape[0]):
            for kv in range(2):
                torch.index_select(self.cache[layer, kv], 0, index, out=self.pool[layer, kv, :n])


class StagingCopier:
    """A decode rank's plan copies (`PlanCopier`): those from the staging pool into the device
    cache, run on the compute stream before the forward pass (so that the step's tokens mean
    the copy is done); every other copy goes to `inner`, the host KV tier's pool, if any."""

    def __init__(
        self, staging: HostStaging, kv_caches: list[KVCachePair], inner: PlanCopier | None
    ) -> None:
        self.staging = staging
        self.kv_caches = kv_caches
        self.inner = inner

    def rebind(self, kv_caches: list[KVCachePair]) -> None:
        self.kv_caches = kv_caches
        if self.inner is not None:
            self.inner.rebind(kv_caches)

    def before_forward(self, copies: Sequence[BlockCopy], reads_copies_up: bool) -> None:
        """ValueError (nothing copied) for a staging copy that is not into the device cache or
        names a slot or block out of range, or another tier's copy on a rank without it."""
        ours = [c for c in copies if c.src == STAGING_TIER]
        for c in ours:
            self._check(c)
        rest = [c for c in copies if c.src != STAGING_TIER]
        if self.inner is not None:
            self.inner.before_forward(rest, reads_copies_up)
        elif rest:
            raise ValueError(
                f"block copies {rest[0].src!r} -> {rest[0].dst!r}, but no host KV tier"
            )
        for c in ours:
            self._copy_in(c)

    def after_forward(self) -> None:
        if self.inner is not None:
            self.inner.after_forward()

    def _check(self, c: BlockCopy) -> None:
        if c.dst != DEVICE_TIER:
            raise ValueError(f"the staging pool copies into the device cache, not {c.dst!r}")
        num_blocks = self.kv_caches[0][0].shape[0]
        for ids, limit, what in ((c.src_blocks, self.staging.num_slots, "staging slot"),
                                 (c.dst_blocks, num_blocks, "device block")):  # fmt: skip
            if ids.size and not (ids.min() >= 0 and ids.max() < limit):
                raise ValueError(f"{what} ids {ids.tolist()} outside [0, {limit})")

    def _copy_in(self, c: BlockCopy) -> None:
        n = c.src_blocks.size
        if not n:
            return
        device = self.kv_caches[0][0].device
        first = int(c.src_blocks[0])
        if np.array_equal(c.src_blocks, np.arange(first, first + n)):
            staged = self.staging.pool[:, :, first : first + n]  # a run of slots: a view
        else:
            slots = torch.as_tensor(np.asarray(c.src_blocks, dtype=np.int64))
            staged = self.staging.pool.index_select(2, slots)
        staged = staged.to(device)  # [L, 2, n, ...]; on CPU the same tensor
        dst = torch.as_tensor(np.asarray(c.dst_blocks, dtype=np.int64), device=device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, dst, staged[layer, 0])
            v.index_copy_(0, dst, staged[layer, 1])
