"""Rank 0's host-tier index (`tp_engine.core.kv.host_tier`): exact host block ids, LRU eviction
order, chains kept from their start, and the copies it asks of the ranks."""

from __future__ import annotations

import numpy as np
import pytest

from shm_ipc.block_copies import DEVICE_TIER
from tp_engine.core.kv.base import LowerTier
from tp_engine.core.kv.host_tier import HOST_TIER, HostTier


def copy_pairs(copy) -> list[tuple[int, int]]:
    return list(zip(copy.src_blocks.tolist(), copy.dst_blocks.tolist(), strict=True))


def test_store_then_match_and_load_exact_blocks() -> None:
    tier = HostTier(4)
    down = tier.store([11, 12, 13], [7, 8, 9])
    assert (down.src, down.dst) == (DEVICE_TIER, HOST_TIER)
    assert copy_pairs(down) == [(7, 0), (8, 1), (9, 2)]  # device -> host, low ids first
    assert down.src_blocks.dtype == np.int32
    assert tier.match([11, 12, 13, 14]) == 3
    assert tier.match([12, 13]) == 2 and tier.match([99, 11]) == 0  # a chain stops at a miss
    assert (tier.queries, tier.hits) == (8, 5)
    up = tier.load([11, 12], [3, 4])
    assert (up.src, up.dst) == (HOST_TIER, DEVICE_TIER)
    assert copy_pairs(up) == [(0, 3), (1, 4)]
    assert tier.store([11, 12, 13], [7, 8, 9]) is None  # all held: nothing to copy
    tier.check_integrity()
    assert (tier.num_cached_blocks, tier.num_free_blocks, tier.usage) == (3, 1, 0.75)


def test_least_recently_used_is_evicted_first() -> None:
    tier = HostTier(3)
    tier.store([1, 2, 3], [10, 11, 12])  # host 0, 1, 2
    tier.load([1], [5])  # 1 is now the most recently used: LRU order 2, 3, 1
    down = tier.store([4], [13])
    assert copy_pairs(down) == [(13, 1)]  # 2's host block, reused
    assert tier.match([2]) == 0 and tier.match([1]) == 1 and tier.match([4]) == 1
    down = tier.store([5, 6], [14, 15])  # evicts 3 (host 2), then 1 (host 0)
    assert copy_pairs(down) == [(14, 2), (15, 0)]
    assert tier.match([1]) == 0 and tier.match([3]) == 0
    tier.check_integrity()


def test_a_chain_longer_than_the_tier_keeps_its_start() -> None:
    tier = HostTier(2)
    tier.store([9], [1])
    down = tier.store([21, 22, 23, 24], [30, 31, 32, 33])
    # The chain evicts 9 but never its own first blocks; blocks past the tier's size are not
    # stored (they would be unreachable without the ones before them).
    assert copy_pairs(down) == [(30, 1), (31, 0)]
    assert tier.match([21, 22, 23]) == 2
    tier.check_integrity()


def test_held_blocks_of_the_chain_being_stored_are_not_evicted() -> None:
    tier = HostTier(2)
    tier.store([1, 2], [10, 11])
    tier.load([2], [3])  # LRU order: 1, 2
    down = tier.store([1, 5], [10, 12])  # 1 is held (and part of this chain): evict 2, not 1
    assert copy_pairs(down) == [(12, 1)]
    assert tier.match([1, 5]) == 2 and tier.match([2]) == 0
    tier.check_integrity()


def test_reset_forgets_everything_and_frees_the_blocks() -> None:
    tier = HostTier(3)
    tier.store([1, 2], [4, 5])
    assert tier.reset() == 2
    assert tier.match([1]) == 0 and tier.num_free_blocks == 3
    assert copy_pairs(tier.store([7], [6])) == [(6, 1)]  # ids given back are reused
    tier.check_integrity()


def test_refusals() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(0)
    tier = HostTier(2)
    with pytest.raises(ValueError, match="2 hashes for 1 device blocks"):
        tier.store([1, 2], [3])
    with pytest.raises(KeyError):
        tier.load([42], [0])
    # Every member of the interface the device tier consults.
    members = [m for m in dir(LowerTier) if not m.startswith("_")] + ["name", "num_blocks"]
    assert {"match", "load", "store"} <= set(members)
    assert all(hasattr(tier, m) for m in members) and tier.name == "host"
