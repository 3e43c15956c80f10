"""`BlockCopy`: one batch of KV-block copies between two tiers, as rank 0 decides it and every
rank carries it out.

Rank 0's KV manager (`tp_engine.core.kv`) decides which blocks move where: a full block
evicted from the device pool copied down to host memory, a prefix hit in host memory copied up
into freshly allocated device blocks. Every rank then copies its own shard of those blocks
(`rank_worker.kv_copies.BlockCopier`), before the forward pass that reads them, since each
rank holds the K/V of its own heads. Blocks are named by id within their tier; the tiers by
name ("device" is the paged cache the forward pass reads). Owner: rank 0 builds it; immutable.
It will travel as a StepPlan section (a later issue); this module fixes the value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DEVICE_TIER", "BlockCopy"]

# The tier of the paged cache the forward pass reads (`rank_worker.kv_cache`).
DEVICE_TIER = "device"


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """Copy block `src_blocks[i]` of tier `src` to block `dst_blocks[i]` of tier `dst`, for
    every i, on every rank (all layers, K and V)."""

    src: str
    dst: str
    # [N] int32 block ids within `src` and within `dst`, pairwise.
    src_blocks: np.ndarray
    dst_blocks: np.ndarray

    def __post_init__(self) -> None:
        if self.src_blocks.shape != self.dst_blocks.shape or self.src_blocks.ndim != 1:
            raise ValueError(
                f"a block copy pairs blocks one to one: {self.src_blocks.shape} source ids, "
                f"{self.dst_blocks.shape} destination ids"
            )
        if np.unique(self.dst_blocks).size != self.dst_blocks.size:
            raise ValueError("a block copy writes each destination block once")
