"""Rank 0's index of a host-memory KV tier: which full blocks the host pool holds, by prefix-cache
hash, and which to evict (least recently used).

The host pool itself lives on every rank (pinned memory holding that rank's heads); rank 0 only
decides, and its decisions leave as `BlockCopy` values that every rank carries out in order
before the forward pass (`rank_worker.kv_copies`). Keys are the device tier's chained block
hashes (`block_manager.hash_block_tokens`, rooted in the weight epoch and the adapter tags), so a
hit here is exactly a block the device tier would have hit: the same tokens after the same
prefix, under the same weights and adapter.

Ordering within a step: a host block loaded up is pinned until the copies leave rank 0 (`unpin`,
when the device tier hands them to a plan), so no store of the same step overwrites it before
the copy up has read it.

Accounting (`check_integrity`): every host block is free or holds exactly one hash;
`num_free_blocks + num_cached_blocks == num_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from shm_ipc.block_copies import DEVICE_TIER, HOST_TIER, BlockCopy

__all__ = ["HOST_TIER", "HostTier"]


class HostTier:
    """A `LowerTier` of `num_blocks` host blocks, evicting the least recently used."""

    name = HOST_TIER

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # hash -> host block id, least recently used first.
        self._blocks: OrderedDict[int, int] = OrderedDict()
        # Never-used ids are handed out low first, then ids given back (LIFO).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Host blocks a pending copy up reads: never evicted until `unpin`.
        self._pinned: set[int] = set()
        # Lookups and hits, in blocks, since start (vLLM's external prefix-cache metrics count
        # tokens: multiply by the block size).
        self.queries = 0
        self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)

    @property
    def usage(self) -> float:
        """The fraction of host blocks holding a cached block (a gauge)."""
        return len(self._blocks) / self.num_blocks

    def match(self, block_hashes: Sequence[int]) -> int:
        """How many of the leading `block_hashes` this tier holds (a chain is usable only up to
        its first miss). Counts a lookup; changes no recency (`load` does)."""
        count = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            count += 1
        self.queries += len(block_hashes)
        self.hits += count
        return count

    def load(self, block_hashes: Sequence[int], device_blocks: Sequence[int]) -> BlockCopy:
        """The copy up of the held blocks `block_hashes` into `device_blocks`; they become the
        most recently used. KeyError for a hash this tier does not hold (call `match` first)."""
        if len(block_hashes) != len(device_blocks):
            raise ValueError(f"{len(block_hashes)} hashes for {len(device_blocks)} device blocks")
        src = []
        for h in block_hashes:
            src.append(self._blocks[h])
            self._blocks.move_to_end(h)
        self._pinned.update(src)
        return BlockCopy(HOST_TIER, DEVICE_TIER, _ids(src), _ids(device_blocks))

    def unpin(self) -> None:
        """The copies up decided so far have left in a plan: their host blocks may be evicted
        again (the ranks run them before any later plan's copies down)."""
        self._pinned.clear()

    def store(self, block_hashes: Sequence[int], device_blocks: Sequence[int]) -> BlockCopy | None:
        """Take copies of the full device blocks `device_blocks` (hashes `block_hashes`, a
        chain's order): the copy down of those not held yet, or None when every one is. Held
        ones become the most recently used; room is made by evicting the least recently used.
        More blocks than the tier holds: the chain's first ones are kept (a later block is
        unreachable without them)."""
        if len(block_hashes) != len(device_blocks):
            raise ValueError(f"{len(block_hashes)} hashes for {len(device_blocks)} device blocks")
        src: list[int] = []
        dst: list[int] = []
        for h, device_block in zip(block_hashes[: self.num_blocks], device_blocks, strict=False):
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            host_block = self._take_block(keep=set(block_hashes[: self.num_blocks]))
            if host_block is None:
                break
            self._blocks[h] = host_block
            src.append(device_block)
            dst.append(host_block)
        if not dst:
            return None
        return BlockCopy(DEVICE_TIER, HOST_TIER, _ids(src), _ids(dst))

    def reset(self) -> int:
        """Forget every held block (weights changed, or `reset_prefix_cache`); how many."""
        dropped = len(self._blocks)
        self._free.extend(self._blocks.values())
        self._blocks.clear()
        self._pinned.clear()
        return dropped

    def check_integrity(self) -> None:
        held = list(self._blocks.values())
        assert len(set(held)) == len(held), "a host block holds two hashes"
        assert not set(held) & set(self._free), "a host block is both free and held"
        assert len(held) + len(self._free) == self.num_blocks, "host blocks lost"

    def _take_block(self, keep: set[int]) -> int | None:
        """A free host block, else the least recently used one neither in `keep` (the chain
        being stored) nor pinned; None when there is none."""
        if self._free:
            return self._free.pop()
        for h, host_block in self._blocks.items():
            if h not in keep and host_block not in self._pinned:
                return self._blocks.pop(h)
        return None


def _ids(blocks: Sequence[int]) -> np.ndarray:
    return np.asarray(blocks, dtype=np.int32)
