"""The host-memory KV tier's parts: rank 0's index (`tp_engine.core.kv.host_tier`: exact host
block ids, LRU eviction order, chains kept from their start, the copies it asks for), the ranks'
host pool (`rank_worker.kv.copies.HostBlockCopier`: copies exact, in order) and the StepPlan
section the copies travel in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rank_worker.kv.copies import HostBlockCopier
from shm_ipc.block_copies import (
    DEVICE_TIER,
    HOST_TIER,
    BlockCopy,
    decode_block_copies,
    encode_block_copies,
)
from shm_ipc.step_plan import PlanDecodeError, StepPlan
from tp_engine.core.kv.base import LowerTier
from tp_engine.core.kv.block_manager import BlockManager
from tp_engine.core.kv.blocks import LowerHit
from tp_engine.core.kv.host_tier import HostTier
from tp_engine.core.sequence import Sequence


def H(*hashes: int) -> list[LowerHit]:
    """Blocks as the device tier describes them; the host tier reads only their hashes."""
    return [LowerHit(h, None, ()) for h in hashes]


def one(copies: list[BlockCopy]) -> BlockCopy | None:
    """The single copy of a list of copies (None: no copy)."""
    assert len(copies) <= 1, copies
    return copies[0] if copies else None


def copy_pairs(copy) -> list[tuple[int, int]]:
    return list(zip(copy.src_blocks.tolist(), copy.dst_blocks.tolist(), strict=True))


def test_store_then_match_and_load_exact_blocks() -> None:
    tier = HostTier(4)
    down = one(tier.store(H(11, 12, 13), [7, 8, 9]))
    assert (down.src, down.dst) == (DEVICE_TIER, HOST_TIER)
    assert copy_pairs(down) == [(7, 0), (8, 1), (9, 2)]  # device -> host, low ids first
    assert down.src_blocks.dtype == np.int32
    assert tier.match(H(11, 12, 13, 14)) == 3
    assert tier.match(H(12, 13)) == 2 and tier.match(H(99, 11)) == 0  # a chain stops at a miss
    assert (tier.queries, tier.hits) == (8, 5)
    up = one(tier.load(H(11, 12), [3, 4]))
    assert (up.src, up.dst) == (HOST_TIER, DEVICE_TIER)
    assert copy_pairs(up) == [(0, 3), (1, 4)]
    assert one(tier.store(H(11, 12, 13), [7, 8, 9])) is None  # all held: nothing to copy
    tier.check_integrity()
    assert (tier.num_cached_blocks, tier.num_free_blocks, tier.usage) == (3, 1, 0.75)


def test_least_recently_used_is_evicted_first() -> None:
    tier = HostTier(3)
    one(tier.store(H(1, 2, 3), [10, 11, 12]))  # host 0, 1, 2
    one(tier.load(H(1), [5]))  # 1 is now the most recently used: LRU order 2, 3, 1
    tier.unpin()  # its copy up left in a plan
    down = one(tier.store(H(4), [13]))
    assert copy_pairs(down) == [(13, 1)]  # 2's host block, reused
    assert tier.match(H(2)) == 0 and tier.match(H(1)) == 1 and tier.match(H(4)) == 1
    down = one(tier.store(H(5, 6), [14, 15]))  # evicts 3 (host 2), then 1 (host 0)
    assert copy_pairs(down) == [(14, 2), (15, 0)]
    assert tier.match(H(1)) == 0 and tier.match(H(3)) == 0
    tier.check_integrity()


def test_a_chain_longer_than_the_tier_keeps_its_start() -> None:
    tier = HostTier(2)
    one(tier.store(H(9), [1]))
    down = one(tier.store(H(21, 22, 23, 24), [30, 31, 32, 33]))
    # The chain evicts 9 but never its own first blocks; blocks past the tier's size are not
    # stored (they would be unreachable without the ones before them).
    assert copy_pairs(down) == [(30, 1), (31, 0)]
    assert tier.match(H(21, 22, 23)) == 2
    tier.check_integrity()


def test_held_blocks_of_the_chain_being_stored_are_not_evicted() -> None:
    tier = HostTier(2)
    one(tier.store(H(1, 2), [10, 11]))
    one(tier.load(H(2), [3]))  # LRU order: 1, 2
    tier.unpin()
    down = one(tier.store(H(1, 5), [10, 12]))  # 1 is held (and part of this chain): evict 2, not 1
    assert copy_pairs(down) == [(12, 1)]
    assert tier.match(H(1, 5)) == 2 and tier.match(H(2)) == 0
    tier.check_integrity()


def test_reset_forgets_everything_and_frees_the_blocks() -> None:
    tier = HostTier(3)
    one(tier.store(H(1, 2), [4, 5]))
    assert tier.reset() == 2
    assert tier.match(H(1)) == 0 and tier.num_free_blocks == 3
    assert copy_pairs(one(tier.store(H(7), [6]))) == [(6, 1)]  # ids given back are reused
    tier.check_integrity()


def test_refusals() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        HostTier(0)
    tier = HostTier(2)
    with pytest.raises(ValueError, match="2 blocks for 1 device blocks"):
        one(tier.store(H(1, 2), [3]))
    with pytest.raises(KeyError):
        one(tier.load(H(42), [0]))
    # Every member of the interface the device tier consults.
    members = [m for m in dir(LowerTier) if not m.startswith("_")] + ["name", "num_blocks"]
    assert {"match", "load", "store"} <= set(members)
    assert all(hasattr(tier, m) for m in members) and tier.name == "host"


# -- the ranks' half: the host pool and the plan section --------------------------------------


def make_cache(num_blocks: int, num_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A device cache with distinct values in every block: [blocks, block_size, heads, dim]."""
    g = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(num_blocks, 4, 2, 8, generator=g),
            torch.randn(num_blocks, 4, 2, 8, generator=g),
        )
        for _ in range(num_layers)
    ]


def test_blocks_go_down_and_come_back_up_exactly() -> None:
    cache = make_cache(6)
    before = [(k.clone(), v.clone()) for k, v in cache]
    copier = HostBlockCopier(cache, num_host_blocks=3)
    tier = HostTier(3)
    copier.copy(tier.store(H(101, 102), [4, 1]))  # device 4, 1 -> host 0, 1
    for k, v in cache:  # the device blocks are reused: overwritten
        k[[1, 4]] = 0.0
        v[[1, 4]] = 0.0
    assert tier.match(H(101, 102)) == 2
    copier.copy(tier.load(H(101, 102), [2, 5]))  # host 0, 1 -> device 2, 5
    for (k, v), (k0, v0) in zip(cache, before, strict=True):
        assert torch.equal(k[2], k0[4]) and torch.equal(k[5], k0[1])
        assert torch.equal(v[2], v0[4]) and torch.equal(v[5], v0[1])
        assert torch.equal(k[0], k0[0]) and torch.equal(k[3], k0[3])  # others untouched


def test_a_host_block_being_loaded_is_not_overwritten_before_its_copy_leaves() -> None:
    cache = make_cache(4)
    copier = HostBlockCopier(cache, num_host_blocks=1)
    tier = HostTier(1)
    copier.copy(tier.store(H(7), [0]))  # host 0 holds device 0's values
    old = cache[0][0][0].clone()
    up = tier.load(H(7), [2])
    assert tier.store(H(8), [3]) == []  # the only host block is pinned by the pending load
    copier.copy(up)
    assert torch.equal(cache[0][0][2], old)
    tier.unpin()  # the copy up left in a plan: the block may go now
    down = one(tier.store(H(8), [3]))
    assert copy_pairs(down) == [(3, 0)] and tier.match(H(7)) == 0
    copier.copy([down])
    assert torch.equal(copier.host[0, 0, 0], cache[0][0][3])  # host block 0, layer 0, K


def test_copier_refusals() -> None:
    copier = HostBlockCopier(make_cache(2), num_host_blocks=2)
    with pytest.raises(ValueError, match=r"host block ids \[2\] outside \[0, 2\)"):
        copier.copy([BlockCopy(HOST_TIER, DEVICE_TIER, np.array([2], np.int32), np.array([0]))])
    key = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match="no copier for 'file'"):  # no file tier on this rank
        copier.copy([BlockCopy("file", DEVICE_TIER, np.array([0]), np.array([0]), key)])
    with pytest.raises(ValueError, match="carries file keys exactly when"):
        BlockCopy("file", DEVICE_TIER, np.array([0]), np.array([0]))


def test_block_copies_travel_in_a_plan_section() -> None:
    copies = [
        BlockCopy(HOST_TIER, DEVICE_TIER, np.array([0, 1], np.int32), np.array([5, 6], np.int32)),
        BlockCopy(DEVICE_TIER, HOST_TIER, np.array([3], np.int32), np.array([1], np.int32)),
    ]
    values = encode_block_copies(copies, reads_copies_up=True)
    assert values.tolist() == [1, 1, 0, 2, 0, 1, 5, 6, 0, 1, 1, 3, 1]
    assert encode_block_copies(copies).tolist()[0] == 0
    plan = StepPlan.exit(5).with_sections(block_copies=values)
    decoded, reads_up = decode_block_copies(StepPlan.decode(plan.encode()).section("block_copies"))
    assert reads_up
    assert [(c.src, c.dst, c.src_blocks.tolist(), c.dst_blocks.tolist()) for c in decoded] == [
        ("host", "device", [0, 1], [5, 6]),
        ("device", "host", [3], [1]),
    ]
    assert encode_block_copies([]).size == 0
    with pytest.raises(ValueError, match="unknown tier id 9"):
        decode_block_copies(np.array([0, 9, 0, 0], np.int32))
    with pytest.raises(ValueError, match="runs past the section"):
        decode_block_copies(np.array([0, 1, 0, 2, 0, 1, 5], np.int32))
    with pytest.raises(ValueError, match="flags must be 0 or 1, got 2"):
        decode_block_copies(np.array([2, 1, 0, 0], np.int32))
    assert decode_block_copies(np.zeros(0, np.int32)) == ([], False)
    with pytest.raises(PlanDecodeError, match="block_copies below 0"):
        StepPlan.decode(
            StepPlan.exit(5).with_sections(block_copies=np.array([-1], np.int32)).encode()
        )


# -- the device tier with a host tier below it -------------------------------------------------

BS = 4


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` with its cached prefix (device and below); returns the prefix's blocks."""
    hits = bm.find_cached_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - len(hits) * BS, hits)
    bm.check_integrity()
    return len(hits)


def finish(bm: BlockManager, seq: Sequence) -> None:
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed_blocks(seq)
    bm.free(seq)
    bm.check_integrity()


def test_evicted_blocks_go_down_and_a_later_prefix_comes_back_up() -> None:
    host = HostTier(8)
    bm = BlockManager(4, BS, lower=host)
    a = Sequence("a", list(range(1, 14)))  # 13 tokens: 3 full blocks + 1
    assert admit(bm, a) == 0
    table_a = list(a.block_table)  # [0, 1, 2, 3]
    finish(bm, a)  # blocks 0, 1, 2 cached (3 held the last token: not full)
    assert bm.take_copies() == []
    b = Sequence("b", list(range(100, 116)))  # 16 tokens: needs all 4 blocks
    assert admit(bm, b) == 0
    down = bm.take_copies()  # a's three cached blocks were evicted: copied down first
    assert [(c.src, c.dst) for c in down] == [(DEVICE_TIER, HOST_TIER)] * 3
    assert sorted(int(c.src_blocks[0]) for c in down) == sorted(table_a[:3])
    finish(bm, b)
    a2 = Sequence("a2", list(range(1, 14)))  # a's prompt again
    assert admit(bm, a2) == 3  # every full block, found below
    copies = bm.take_copies()
    up = [c for c in copies if c.src == HOST_TIER]
    assert len(up) == 1 and up[0].dst_blocks.tolist() == a2.block_table[:3]
    downs = [c for c in copies if c.src == DEVICE_TIER]
    assert copies[: len(downs)] == downs  # down copies run first
    assert (bm.prefix_cache_hits, bm.external_hits) == (0, 12)
    assert bm.external_queries == 13 + 16 + 13 and bm.prefix_cache_queries == 13 + 16 + 13
    assert a2.num_computed_tokens == 12 and a2.num_cached_tokens == 12
    # The loaded blocks are cached on the device again: a third request hits them there.
    finish(bm, a2)
    a3 = Sequence("a3", list(range(1, 14)))
    assert admit(bm, a3) == 3 and bm.prefix_cache_hits == 12
    assert [c.src for c in bm.take_copies()] == []


def test_reset_and_new_weights_reach_the_tier_below() -> None:
    host = HostTier(8)
    bm = BlockManager(3, BS, lower=host)
    a = Sequence("a", list(range(1, 10)))  # 2 full blocks + 1
    admit(bm, a)
    finish(bm, a)
    b = Sequence("b", list(range(50, 62)))  # 3 blocks: evicts a's cached ones, copied down
    admit(bm, b)
    finish(bm, b)
    assert host.num_cached_blocks >= 1
    bm.reset_prefix_cache()
    assert host.num_cached_blocks == 0
    bm.take_copies()
    c = Sequence("c", list(range(60, 64)) + [1])
    admit(bm, c)
    finish(bm, c)
    bm.advance_epoch()  # new weights: nothing below is a hit (roots differ) and it is emptied
    assert host.num_cached_blocks == 0


def test_without_prefix_caching_there_is_no_tier_below() -> None:
    bm = BlockManager(2, BS, enable_prefix_caching=False, lower=HostTier(4))
    assert bm.lower is None
