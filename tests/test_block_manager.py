"""BlockManager step by step: exact block ids, ref counts, hits and eviction order."""

from __future__ import annotations

import pytest

from tp_engine.core.kv.block_manager import BlockManager, FreeBlockQueue, KVBlock, hash_block_tokens
from tp_engine.core.sequence import Sequence

BS = 4


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit `seq` with whatever prefix is cached and blocks for all its tokens; returns hit ids."""
    hits = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(hits) * BS
    assert bm.allocate_slots(seq, num_new, hits)
    bm.check_integrity()
    return [b.block_id for b in hits]


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend a step computed every token of `seq`."""
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed_blocks(seq)
    bm.check_integrity()


def queue_ids(bm: BlockManager) -> list[int]:
    return [b.block_id for b in bm.free_queue]


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_cnt for b in bm.blocks]


def test_free_queue_is_a_doubly_linked_list_with_o1_removal():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [2, 0, 1, 3]
    assert q.popleft() is blocks[2]
    q.append(blocks[4])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[2])
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[0])


def test_allocation_takes_from_the_head_and_free_goes_in_reverse_order():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = Sequence("a", list(range(1, 11)))  # 10 tokens: 2 full blocks + 2 tokens
    assert admit(bm, a) == []
    assert a.block_table == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0]
    assert queue_ids(bm) == [3, 4]
    compute_all(bm, a)
    assert bm.blocks[0].block_hash is not None and bm.blocks[1].block_hash is not None
    assert bm.blocks[2].block_hash is None  # only 2 of its 4 slots are filled

    bm.free(a)
    bm.check_integrity()
    # Tail first: the partial block 2 holds nothing reusable and goes to the head; then the
    # cached blocks 1 and 0 go to the tail, so the prefix block 0 is evicted last.
    assert queue_ids(bm) == [2, 3, 4, 1, 0]
    assert refs(bm) == [0] * 5
    assert bm.usage == 0.0


def test_least_recently_freed_cached_block_is_evicted_first_and_prefixes_live_longest():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence("a", list(range(1, 13)) + [99])  # blocks 0, 1, 2 full, block 3 partial
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    assert queue_ids(bm) == [3, 2, 1, 0]

    # A new unrelated sequence needing two blocks: first the empty block 3, then the oldest
    # cached block in the queue, block 2 (a's tail), whose hash is evicted.
    b = Sequence("b", [50, 51, 52, 53, 54])
    admit(bm, b)
    assert b.block_table == [3, 2]
    assert bm.blocks[2].block_hash is None
    assert len(bm.cached) == 2  # blocks 0 and 1 survive

    # a's prompt again: the prefix 0, 1 still hits; block 2 had to be recomputed.
    a2 = Sequence("a2", list(range(1, 13)) + [99])
    hits = bm.find_cached_prefix(a2)
    assert [h.block_id for h in hits] == [0, 1]
    bm.free(b)
    assert queue_ids(bm) == [3, 2, 1, 0]
    assert admit(bm, a2) == [0, 1]
    assert a2.block_table == [0, 1, 3, 2]
    assert a2.num_computed_tokens == 8 and a2.num_cached_tokens == 8


def test_hit_on_a_freed_but_cached_block_touches_it_out_of_the_queue():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = Sequence("a", list(range(1, 10)))  # 9 tokens
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    assert queue_ids(bm) == [2, 3, 4, 5, 1, 0]
    b = Sequence("b", list(range(1, 9)) + [77, 78])  # same first two blocks
    assert admit(bm, b) == [0, 1]
    # The hits leave the queue from its middle/tail; b's third block is the head (block 2).
    assert b.block_table == [0, 1, 2]
    assert queue_ids(bm) == [3, 4, 5]
    assert refs(bm) == [1, 1, 1, 0, 0, 0]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (9 + 10, 8)


def test_shared_prefix_is_referenced_once_per_sequence():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", list(range(1, 10)))
    admit(bm, a)
    compute_all(bm, a)
    b = Sequence("b", list(range(1, 9)) + [40])
    assert admit(bm, b) == [0, 1]
    assert refs(bm)[:4] == [2, 2, 1, 1]
    bm.check_integrity([a, b])
    bm.free(a)
    assert refs(bm)[:4] == [1, 1, 0, 1]
    bm.free(b)
    bm.check_integrity()
    assert bm.usage == 0.0


def test_full_prompt_hit_still_computes_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", list(range(1, 9)))  # exactly two full blocks
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)

    same = Sequence("same", list(range(1, 9)))
    # Both blocks are cached, but the last token's logits are needed: only block 0 is reused,
    # and the 4 tokens of block 1 are computed again into a fresh block.
    assert admit(bm, same) == [0]
    assert same.num_computed_tokens == 4
    assert len(same.block_table) == 2 and same.block_table[1] != 1
    bm.free(same)

    longer = Sequence("longer", list(range(1, 9)) + [42])  # one token past two cached blocks
    assert admit(bm, longer) == [0, 1]
    assert longer.num_computed_tokens == 8  # only the last token is left to compute


def test_hash_collision_with_different_tokens_is_refused():
    bm = BlockManager(num_blocks=8, block_size=BS, hash_fn=lambda parent, tokens: 42)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute_all(bm, a)
    # Block 1 hashes to 42 too, but 42 is taken: it stays private rather than overwrite.
    assert bm.cached == {42: bm.blocks[0]} and bm.blocks[1].block_hash is None
    b = Sequence("b", [9, 9, 9, 9, 9])
    assert bm.find_cached_prefix(b) == []  # same hash, different tokens
    c = Sequence("c", [1, 2, 3, 4, 0])
    assert [blk.block_id for blk in bm.find_cached_prefix(c)] == [0]


def test_hash_collision_after_a_different_prefix_is_refused():
    # A hash that ignores the parent: block "5 6 7 8" after "1 2 3 4" and as a first block
    # collide. The stored parent hash tells them apart.
    bm = BlockManager(num_blocks=8, block_size=BS, hash_fn=lambda parent, tokens: tokens[0])
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute_all(bm, a)
    b = Sequence("b", [5, 6, 7, 8, 1])
    assert bm.find_cached_prefix(b) == []


def test_chained_hash_depends_on_the_prefix():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2, 3, 4]) == first
    assert hash_block_tokens(0, [1]) != hash_block_tokens(None, [1])


def test_allocation_failure_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = Sequence("a", list(range(1, 10)))
    admit(bm, a)  # takes all three blocks
    b = Sequence("b", [1, 2])
    before = (queue_ids(bm), refs(bm), bm.prefix_cache_queries)
    assert not bm.allocate_slots(b, 2, [])
    assert (queue_ids(bm), refs(bm), bm.prefix_cache_queries) == before
    assert b.block_table == []


def test_touched_hits_count_against_free_blocks():
    # 4 blocks; a's two full blocks cached and free, plus two empty ones. A sequence reusing the
    # two cached blocks and needing three more must fail: the hits are not allocatable.
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence("a", list(range(1, 10)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = Sequence("b", list(range(1, 9)) + list(range(20, 29)))  # 17 tokens = 5 blocks
    hits = bm.find_cached_prefix(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert not bm.allocate_slots(b, b.num_tokens - 8, hits)
    bm.check_integrity()
    assert bm.allocate_slots(b, 4, hits)  # a chunk that fits: 2 hits + 1 new block
    assert b.block_table == [0, 1, 2]


def test_prefix_caching_off_never_hits_or_registers():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = Sequence("a", list(range(1, 10)))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.cached == {}
    bm.free(a)
    assert admit(bm, Sequence("b", list(range(1, 10)))) == []
    assert bm.prefix_cache_hits == 0


def test_reset_prefix_cache_drops_only_unreferenced_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = Sequence("a", list(range(1, 10)))
    b = Sequence("b", list(range(30, 39)))
    for seq in (a, b):
        admit(bm, seq)
        compute_all(bm, seq)
    bm.free(a)
    assert len(bm.cached) == 4
    assert bm.reset_prefix_cache() == 2  # a's two blocks; b still holds its own
    bm.check_integrity([b])
    assert set(bm.cached.values()) == {bm.blocks[i] for i in b.block_table[:2]}
    assert bm.find_cached_prefix(Sequence("a2", list(range(1, 10)))) == []
    # Dropped blocks are empty again, at the head of the queue.
    assert set(queue_ids(bm)[:2]) == {0, 1}
    assert all(bm.blocks[i].block_hash is None for i in queue_ids(bm))


def test_integrity_check_catches_a_broken_invariant():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = Sequence("a", [1, 2, 3])
    admit(bm, a)
    bm.blocks[a.block_table[0]].ref_cnt = 0  # corrupt: ref 0 but not in the queue
    with pytest.raises(AssertionError, match="ref_cnt == 0"):
        bm.check_integrity()


def test_a_huge_pool_makes_its_blocks_only_when_used():
    # A tiny model on a large GPU: millions of blocks. None exists as an object before it is
    # used, and they are handed out in the same order as from a fully built queue.
    # (No check_integrity here: it visits, and so makes, every block.)
    bm = BlockManager(num_blocks=10_000_000, block_size=BS)
    assert bm.num_free_blocks == 10_000_000 and bm.blocks._made == []
    a = Sequence("a", list(range(1, 11)))  # 3 blocks
    assert bm.allocate_slots(a, a.num_tokens, [])
    assert a.block_table == [0, 1, 2] and len(bm.blocks._made) == 3
    bm.free(a)  # unhashed: back at the head, ahead of the unused ids
    b = Sequence("b", list(range(1, 10)))
    assert bm.allocate_slots(b, b.num_tokens, [])
    assert b.block_table == [0, 1, 2] and bm.num_free_blocks == 10_000_000 - 3
    c = Sequence("c", list(range(1, 6)))
    assert bm.allocate_slots(c, c.num_tokens, [])
    assert c.block_table == [3, 4] and len(bm.blocks._made) == 5
    assert bm.usage == 5 / 10_000_000


def test_a_new_weight_epoch_never_hits_kv_of_the_old_weights():
    """After `advance_epoch` (new weights) the same prompt gets no hit, even on blocks a running
    sequence still holds, and that sequence (kept across the update) registers nothing more:
    its later blocks attend to K/V of the old weights. A sequence admitted afterwards shares
    with later ones as before."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    kept = Sequence("kept", prompt)
    admit(bm, kept)
    compute_all(bm, kept)
    assert admit(bm, Sequence("same-epoch", prompt)) == kept.block_table[:3]

    assert bm.advance_epoch(flush=False) == 1
    fresh = Sequence("fresh", prompt)
    assert admit(bm, fresh) == []  # the kept blocks are still cached, under epoch 0's chain
    kept.token_ids += [99, 98, 97]  # 16 tokens: a 4th full block, computed after the update
    assert bm.allocate_slots(kept, 3, start=13)
    before = dict(bm.cached)
    compute_all(bm, kept)
    assert bm.cached == before  # nothing of the kept sequence is registered under any epoch

    compute_all(bm, fresh)
    assert admit(bm, Sequence("later", prompt)) == fresh.block_table[:3]


def test_epoch_zero_base_hashes_are_the_plain_chain():
    """The root is None for the base model at epoch 0: hashes are what they were before
    roots existed, so nothing cached or tested changes."""
    bm = BlockManager(num_blocks=4, block_size=BS)
    seq = Sequence("a", list(range(1, 9)))
    admit(bm, seq)
    compute_all(bm, seq)
    first = hash_block_tokens(None, (1, 2, 3, 4))
    assert seq.cache_root is None
    assert seq.block_hashes == [first, hash_block_tokens(first, (5, 6, 7, 8))]


def test_cache_tags_separate_chains():
    """Sequences with different tags (an adapter's load id) share no block; equal tags do."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(1, 10))
    base, a1, a1_again, a2 = (Sequence(n, prompt) for n in ("base", "a1", "a1b", "a2"))
    a1.cache_tags = a1_again.cache_tags = (("adapter", 1),)
    a2.cache_tags = (("adapter", 2),)
    for seq in (base, a1):
        admit(bm, seq)
        compute_all(bm, seq)
    assert admit(bm, a2) == []
    assert admit(bm, a1_again) == a1.block_table[:2]


def test_advance_epoch_flushes_unreferenced_blocks():
    bm = BlockManager(num_blocks=8, block_size=BS)
    seq = Sequence("a", list(range(1, 10)))
    admit(bm, seq)
    compute_all(bm, seq)
    bm.free(seq)
    assert len(bm.cached) == 2
    bm.advance_epoch()
    assert bm.cached == {} and bm.num_free_blocks == 8
    bm.check_integrity()
