"""Rank 0's KV manager: which KV blocks each sequence holds, and the prefix cache.

`base.KVTier` is what the scheduler asks of it; `block_manager.BlockManager` is the device
(GPU) tier, the one implementation today. Further tiers (host memory, then files) add a class
beside it, and a matching `rank_worker.kv.copies.BlockCopier` on the ranks moves the blocks.
"""
