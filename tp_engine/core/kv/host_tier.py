"""Rank 0's index of a host-memory KV tier: which full blocks the host pool holds, by prefix-cache
hash, and which to evict (least recently used).

The host pool itself lives on every rank (pinned memory holding that rank's heads); rank 0 only
decides, and its decisions leave as `BlockCopy` values that every rank carries out in order
before the forward pass (`rank_worker.kv.copies`). Keys are the device tier's chained block
hashes (`block_manager.hash_block_tokens`, rooted in the weight epoch and the adapter tags), so a
hit here is exactly a block the device tier would have hit: the same tokens after the same
prefix, under the same weights and adapter.

Ordering within a step: a host block loaded up, or written through to a file, is pinned until
the copies leave rank 0 (`unpin`, when the device tier hands them to a plan), so no store of the
same step overwrites it before the copy has read it.

Accounting (`check_integrity`): every host block is free or holds exactly one hash;
`num_free_blocks + num_cached_blocks == num_blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from shm_ipc.block_copies import DEVICE_TIER, HOST_TIER, BlockCopy
from tp_engine.core.kv.blocks import LowerHit

if TYPE_CHECKING:
    from tp_engine.core.kv.file_tier import FileTier

__all__ = ["HOST_TIER", "HostTier"]


class HostTier:
    """A `LowerTier` of `num_blocks` host blocks, evicting the least recently used; `lower`, a
    file tier written through from it (`file_tier`), continues its lookups."""

    name = HOST_TIER

    def __init__(self, num_blocks: int, lower: FileTier | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.lower = lower
        # hash -> host block id, least recently used first.
        self._blocks: OrderedDict[int, int] = OrderedDict()
        # Never-used ids are handed out low first, then ids given back (LIFO).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Host blocks a pending copy reads (up to the device, or into a file): never evicted
        # until `unpin`.
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

    def match(self, blocks: Sequence[LowerHit]) -> int:
        """How many of the leading `blocks` this tier holds, or the file tier below it after
        this tier's run of hits (a chain is usable only up to its first miss). Counts a
        lookup; changes no recency (`load` does)."""
        count = 0
        for block in blocks:
            if block.block_hash not in self._blocks:
                break
            count += 1
        self.queries += len(blocks)
        self.hits += count
        if self.lower is not None and count < len(blocks):
            count += self.lower.match(blocks[count:])
        return count

    def load(self, blocks: Sequence[LowerHit], device_blocks: Sequence[int]) -> list[BlockCopy]:
        """The copies up of matched `blocks` into `device_blocks`: from host memory, then from
        files for the rest; they become the most recently used. KeyError for a block neither
        holds (call `match` first)."""
        if len(blocks) != len(device_blocks):
            raise ValueError(f"{len(blocks)} blocks for {len(device_blocks)} device blocks")
        src = []
        for block in blocks:
            host_block = self._blocks.get(block.block_hash)
            if host_block is None:
                break
            src.append(host_block)
            self._blocks.move_to_end(block.block_hash)
        self._pinned.update(src)
        copies = [BlockCopy(HOST_TIER, DEVICE_TIER, _ids(src), _ids(device_blocks[: len(src)]))]
        if len(src) < len(blocks):
            if self.lower is None:
                raise KeyError(blocks[len(src)].block_hash)
            copies += self.lower.load(blocks[len(src) :], device_blocks[len(src) :])
        return [c for c in copies if c.src_blocks.size]

    def unpin(self) -> None:
        """The copies decided so far have left in a plan: their host blocks may be evicted
        again (the ranks run them before any later plan's copies down)."""
        self._pinned.clear()
        if self.lower is not None:
            self.lower.unpin()

    @property
    def committed(self) -> Callable[[LowerHit], None] | None:
        """`LowerTier.committed`: the file tier's, if there is one (it keys chains as they
        grow); None without one, so the device tier's commits call nothing."""
        return None if self.lower is None else self.lower.committed

    def store(self, blocks: Sequence[LowerHit], device_blocks: Sequence[int]) -> list[BlockCopy]:
        """Take copies of the full device blocks `device_blocks` (holding `blocks`, a chain's
        order): the copy down of those not held yet (and, with a file tier, their writes
        through to files). Held ones become the most recently used; room is made by evicting
        the least recently used. More blocks than the tier holds: the chain's first ones are
        kept (a later block is unreachable without them)."""
        if len(blocks) != len(device_blocks):
            raise ValueError(f"{len(blocks)} blocks for {len(device_blocks)} device blocks")
        keep = {block.block_hash for block in blocks[: self.num_blocks]}
        src: list[int] = []
        dst: list[int] = []
        stored: list[LowerHit] = []
        for block, device_block in zip(blocks[: self.num_blocks], device_blocks, strict=False):
            if block.block_hash in self._blocks:
                self._blocks.move_to_end(block.block_hash)
                continue
            host_block = self._take_block(keep)
            if host_block is None:
                break
            self._blocks[block.block_hash] = host_block
            src.append(device_block)
            dst.append(host_block)
            stored.append(block)
        if not dst:
            return []
        copies = [BlockCopy(DEVICE_TIER, HOST_TIER, _ids(src), _ids(dst))]
        if self.lower is not None:
            writes = self.lower.store(stored, dst)
            for write in writes:  # read from host memory after the forward pass: keep them
                self._pinned.update(write.src_blocks.tolist())
            copies += writes
        return copies

    def reset(self) -> int:
        """Forget every held block, and the file tier's (weights changed, or
        `reset_prefix_cache`); how many host blocks."""
        dropped = len(self._blocks)
        self._free.extend(self._blocks.values())
        self._blocks.clear()
        self._pinned.clear()
        if self.lower is not None:
            self.lower.reset()
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
