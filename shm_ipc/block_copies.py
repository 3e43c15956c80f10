"""`BlockCopy`: one batch of KV-block copies between two tiers, as rank 0 decides it and every
rank carries it out.

Rank 0's KV manager (`tp_engine.core.kv`) decides which blocks move where: a full block
evicted from the device pool copied down to host memory, a prefix hit in host memory copied up
into freshly allocated device blocks. Every rank then copies its own shard of those blocks
(`rank_worker.kv.copies.BlockCopier`), before the forward pass that reads them, since each
rank holds the K/V of its own heads. Blocks are named by id within their tier; the tiers by
name ("device" is the paged cache the forward pass reads). Owner: rank 0 builds it; immutable.
It travels in the StepPlan's `block_copies` section (`encode_block_copies` /
`decode_block_copies`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "DEVICE_TIER",
    "FILE_TIER",
    "HOST_TIER",
    "STAGING_TIER",
    "TIER_IDS",
    "BlockCopy",
    "decode_block_copies",
    "encode_block_copies",
]

# The tier of the paged cache the forward pass reads (`rank_worker.kv.cache`).
DEVICE_TIER = "device"
# Pinned host memory on every rank, the same layout per block (`rank_worker.kv.copies`).
HOST_TIER = "host"
# Files, one per block and rank (`shm_ipc.kv_files`): named by key, so a copy names its file
# blocks by key (`BlockCopy.keys`) and their ids are only positions.
FILE_TIER = "file"
# A prefill/decode decode rank's host staging pool (`rank_worker.kv.pd_staging`): where a
# prefill writes a prompt's pages when the device cache cannot be registered for transfers.
STAGING_TIER = "staging"
# A file key on the wire: 16 bytes as 8 values (`kv_files.key_values`).
KEY_VALUES = 8


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """Copy block `src_blocks[i]` of tier `src` to block `dst_blocks[i]` of tier `dst`, for
    every i, on every rank (all layers, K and V)."""

    src: str
    dst: str
    # [N] int32 block ids within `src` and within `dst`, pairwise.
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    # [N, KEY_VALUES] int32: the file keys of the file side (`kv_files.key_values`), when
    # `src` or `dst` is the file tier; None otherwise.
    keys: np.ndarray | None = None

    def __post_init__(self) -> None:
        if (FILE_TIER in (self.src, self.dst)) != (self.keys is not None):
            raise ValueError("a block copy carries file keys exactly when a side is the file tier")
        if self.keys is not None and self.keys.shape != (self.src_blocks.size, KEY_VALUES):
            raise ValueError(
                f"file keys of shape {self.keys.shape} for {self.src_blocks.size} blocks"
            )
        if self.src_blocks.shape != self.dst_blocks.shape or self.src_blocks.ndim != 1:
            raise ValueError(
                f"a block copy pairs blocks one to one: {self.src_blocks.shape} source ids, "
                f"{self.dst_blocks.shape} destination ids"
            )
        if np.unique(self.dst_blocks).size != self.dst_blocks.size:
            raise ValueError("a block copy writes each destination block once")


# Tier names on the wire (the `block_copies` StepPlan section); never renumbered.
TIER_IDS = {DEVICE_TIER: 0, HOST_TIER: 1, FILE_TIER: 2, STAGING_TIER: 3}
_TIER_NAMES = {wire_id: name for name, wire_id in TIER_IDS.items()}


def encode_block_copies(copies: list[BlockCopy], reads_copies_up: bool = False) -> np.ndarray:
    """`copies` as the int32 values of the StepPlan's `block_copies` section: a flags value (1:
    this plan's forward pass reads blocks its own copies up write, so it waits for them; 0: only
    later plans read them, and the copies up overlap this forward pass), then per copy `src tier,
    dst tier, N, src_blocks[N], dst_blocks[N]` and, with the file tier on a side, its keys
    `[N * KEY_VALUES]`, in order. An empty list is an empty array (the
    plan then carries no section)."""
    parts: list[np.ndarray] = [np.array([int(reads_copies_up)], np.int32)]
    for c in copies:
        header = np.array([TIER_IDS[c.src], TIER_IDS[c.dst], c.src_blocks.size], np.int32)
        parts += [header, c.src_blocks.astype(np.int32), c.dst_blocks.astype(np.int32)]
        if c.keys is not None:
            parts.append(c.keys.astype(np.int32).ravel())
    return np.concatenate(parts) if copies else np.zeros(0, np.int32)


def decode_block_copies(values: np.ndarray) -> tuple[list[BlockCopy], bool]:
    """The copies of a `block_copies` section and its flag (`encode_block_copies`); ValueError
    naming what is wrong (a bad flag, an unknown tier, a count that runs past the section, a
    destination written twice). An empty section: no copies."""
    if not values.size:
        return [], False
    if int(values[0]) not in (0, 1):
        raise ValueError(f"block_copies: flags must be 0 or 1, got {int(values[0])}")
    copies = []
    i = 1
    while i < values.size:
        if i + 3 > values.size:
            raise ValueError(f"block_copies: a copy's header runs past the section at {i}")
        src, dst, count = (int(v) for v in values[i : i + 3])
        if src not in _TIER_NAMES or dst not in _TIER_NAMES:
            raise ValueError(
                f"block_copies: unknown tier id {src if src not in _TIER_NAMES else dst}"
            )
        end = i + 3 + 2 * count
        if count < 0 or end > values.size:
            raise ValueError(f"block_copies: a copy of {count} blocks runs past the section")
        src_blocks, dst_blocks = values[i + 3 : i + 3 + count], values[i + 3 + count : end]
        keys = None
        if TIER_IDS[FILE_TIER] in (src, dst):
            i, end = end, end + KEY_VALUES * count
            if end > values.size:
                raise ValueError(
                    f"block_copies: the keys of {count} file blocks run past the section"
                )
            keys = values[i:end].reshape(count, KEY_VALUES)
        copies.append(BlockCopy(_TIER_NAMES[src], _TIER_NAMES[dst], src_blocks, dst_blocks, keys))
        i = end
    return copies, bool(values[0])
