"""KV tiers: the scheduler sees the KV manager only through `KVTier`, and the ranks carry out
block copies (`rank_worker.kv.copies`) exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rank_worker.kv.cache import KVCacheSpec, allocate_kv_cache
from rank_worker.kv.copies import DeviceBlockCopier
from shm_ipc.block_copies import DEVICE_TIER, BlockCopy
from tests.control_plane import Stepper, make_scheduler, make_seq
from tp_engine.core.kv.base import KVTier
from tp_engine.core.kv.block_manager import BlockManager
from tp_engine.core.scheduler import Scheduler


class OnlyTheInterface:
    """A `KVTier` that forwards to a `BlockManager` exactly the members `KVTier` declares: a
    scheduler reaching for anything else fails with AttributeError."""

    def __init__(self, inner: BlockManager) -> None:
        self._inner = inner
        self.calls: dict[str, int] = {}
        for name in ("block_size", "num_blocks", "enable_prefix_caching"):
            setattr(self, name, getattr(inner, name))

    def __getattribute__(self, name: str):
        if name.startswith("_") or name in ("calls", "block_size", "num_blocks"):
            return object.__getattribute__(self, name)
        if name == "enable_prefix_caching":
            return object.__getattribute__(self, name)
        if name not in _KV_TIER_MEMBERS:
            raise AttributeError(f"{name!r} is not part of KVTier")
        calls = object.__getattribute__(self, "calls")
        calls[name] = calls.get(name, 0) + 1
        return getattr(object.__getattribute__(self, "_inner"), name)


_KV_TIER_MEMBERS = {name for name in dir(KVTier) if not name.startswith("_")} | set(
    KVTier.__annotations__
)


def test_block_manager_is_a_kv_tier():
    assert isinstance(BlockManager(8, 4, True), KVTier)
    assert {"allocate_slots", "find_cached_prefix", "free", "prefix_cache_hits"} <= _KV_TIER_MEMBERS


def test_the_scheduler_uses_only_the_kv_tier_interface():
    # Prefix hits, chunked prefill and preemption (a pool of 6 blocks), all through KVTier.
    base = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8)
    tier = OnlyTheInterface(base.block_manager)
    sched = Scheduler(base_config(base), tier, eos_token_ids=[0])
    shared = [5, 6, 7, 8, 9, 10, 11, 12]
    for i, extra in enumerate([[1, 2], [3], [4, 4, 4]]):
        sched.add(make_seq(f"r{i}", shared + extra, max_tokens=6))
    done = Stepper(sched).run_to_completion()
    assert len(done) == 3 and all(s.num_output_tokens == 6 for s in done)
    assert sched.num_preemptions > 0
    assert tier.calls["find_cached_prefix"] >= 3 and tier.calls["allocate_slots"] > 3
    assert base.block_manager.prefix_cache_hits > 0


def base_config(sched: Scheduler):
    from tp_engine.config import EngineConfig

    return EngineConfig(
        max_model_len=sched.max_model_len,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        block_size=sched.block_size,
        enable_chunked_prefill=sched.enable_chunked_prefill,
        num_kv_blocks=sched.block_manager.num_blocks,
    )


def device_cache(num_blocks: int = 6) -> list:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, dtype=torch.float32)
    caches = allocate_kv_cache(spec, num_blocks, "cpu")
    gen = torch.Generator().manual_seed(0)
    for k, v in caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    return caches


def copy(src: list[int], dst: list[int]) -> BlockCopy:
    return BlockCopy(DEVICE_TIER, DEVICE_TIER, np.array(src, np.int32), np.array(dst, np.int32))


def test_device_copier_copies_every_layer_k_and_v_reading_sources_first():
    caches = device_cache()
    before = [(k.clone(), v.clone()) for k, v in caches]
    # [0, 1] -> [1, 2] overlaps: block 1 must end up with block 0's old contents, 2 with 1's.
    DeviceBlockCopier(caches).copy([copy([0, 1], [1, 2]), copy([5], [0])])
    for (k, v), (k0, v0) in zip(caches, before, strict=True):
        for cache, old in ((k, k0), (v, v0)):
            torch.testing.assert_close(cache[1], old[0], rtol=0, atol=0)
            torch.testing.assert_close(cache[2], old[1], rtol=0, atol=0)
            torch.testing.assert_close(cache[0], old[5], rtol=0, atol=0)
            torch.testing.assert_close(cache[3:], old[3:], rtol=0, atol=0)  # untouched


def test_block_copies_refuse_what_they_cannot_do():
    copier = DeviceBlockCopier(device_cache(4))
    with pytest.raises(ValueError, match="outside"):
        copier.copy([copy([0], [4])])
    with pytest.raises(ValueError, match="no copier"):
        copier.copy([BlockCopy("host", DEVICE_TIER, np.array([0]), np.array([1]))])
    with pytest.raises(ValueError, match="one to one"):
        copy([0, 1], [2])
    with pytest.raises(ValueError, match="once"):
        copy([0, 1], [2, 2])
