"""The paged KV-cache pool on rank 0: block allocation and the prefix cache.

`BlockManager` is the device tier (`tp_engine.core.kv.base.KVTier`), the pool of blocks the
forward pass reads. With a tier below it (`lower`, a `LowerTier`: host memory), a cached block
it evicts to reuse is copied down first, and a prefix lookup goes on below where the device's
hits stop: those hits get fresh device blocks and a copy up. The copies leave through
`take_copies` (down copies first: a device block is read before a copy up overwrites it) in
the next plan; every rank runs the copies down before that plan's forward pass and the copies up
beside it, so a sequence whose blocks are being loaded (`loading`) computes from the plan after.

Rank 0 alone owns this bookkeeping; the ranks only see the resulting block ids in the StepPlan.
Every block is in exactly one state:

    state               ref_cnt  block_hash  in free queue   reached by
    free and empty      0        None        yes (head end)  start; freeing an unhashed block
    owned               >= 1     None        no              allocation
    full and cached     >= 1     set         no              a full block registered / a hit
    cached, unreferenced 0       set         yes (LRU order) freeing a cached block

Invariant: ref_cnt == 0 <=> the block is in the free queue. The free queue hands out empty
blocks before cached ones, and cached ones least recently freed first; taking a cached block
from it evicts its hash entry. Blocks never used yet are not queue nodes but a range of ids
between the empty and the cached ones, and their `KVBlock` objects are made on first use: a
small model on a large GPU has millions of blocks, which would otherwise cost seconds and a
gigabyte of Python objects at start-up. A prefix hit on an unreferenced cached block takes it back out of
the queue ("touch") wherever it is, which is why the queue is a doubly linked list.

Full blocks are registered under a chained hash, hash(i) = hash((hash(i - 1), tokens of block
i)) (Python's tuple hash), so equal tokens after different prefixes never match. A hit also
compares the stored token ids and parent hash, so a hash collision cannot hand out wrong K/V.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from tp_engine.core.kv.blocks import (
    FreeBlockQueue,
    HashFn,
    KVBlock,
    LazyBlocks,
    LowerHit,
    hash_block_tokens,
    prefix_cache_root,
)
from tp_engine.core.sequence import Sequence

if TYPE_CHECKING:
    from shm_ipc.block_copies import BlockCopy
    from tp_engine.core.kv.base import LowerTier


class BlockManager:
    """Allocates KV blocks to sequences and shares full blocks through the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
        lower: LowerTier | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        self.blocks = LazyBlocks(num_blocks)
        self.free_queue = FreeBlockQueue(fresh=self.blocks)
        self.cached: dict[int, KVBlock] = {}
        # Prefix-cache counters in tokens, counted once per successful admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # The weights' epoch, advanced by every weight update (`advance_epoch`): part of every
        # hash chain's root, so K/V of other weights is never a hit.
        self.epoch = 0
        # The tier below (host memory), consulted on a miss and fed on eviction; its hits, in
        # tokens, counted as vLLM's external prefix cache (queries: the tokens past the
        # device's hits that were looked up below).
        self.lower = lower if enable_prefix_caching else None
        self.external_queries = 0
        self.external_hits = 0
        # Copies decided since the last `take_copies`: down (evictions) and up (hits below).
        self._down: list[BlockCopy] = []
        self._up: list[BlockCopy] = []
        # Device blocks those copies up write: not readable before the plan after theirs.
        self._loading: set[int] = set()

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take: empty ones and evictable cached ones."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return (self.num_blocks - len(self.free_queue)) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or not)."""
        return len(self.cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def loading(self, seq: Sequence) -> bool:
        """Whether a copy up not yet taken (`take_copies`) writes one of `seq`'s blocks: the
        plan that carries it overlaps the copy with its forward pass, so only later plans may
        read those blocks."""
        return bool(self._loading) and not self._loading.isdisjoint(seq.block_table)

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock | LowerHit]:
        """Longest run of cached blocks holding a prefix of `seq`, never covering its last token.

        The last token is always left to compute because its logits are needed; at block
        granularity that means a fully cached prompt of k full blocks reuses only k - 1. A
        sequence that must compute its whole prompt (`reads_prefix_cache`: prompt logprobs) gets
        no hit.
        """
        self._root(seq)
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        hashes = self._block_hashes(seq)
        max_blocks = min((seq.num_tokens - 1) // self.block_size, len(hashes))
        bs = self.block_size
        hits: list[KVBlock | LowerHit] = []
        for i in range(max_blocks):
            block = self.cached.get(hashes[i])
            if (
                block is None
                or block.parent_hash != (hashes[i - 1] if i else seq.cache_root)
                or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs])
            ):
                break
            hits.append(block)
        if self.lower is not None and len(hits) < max_blocks:
            below = [
                LowerHit(
                    hashes[i], hashes[i - 1] if i else seq.cache_root,
                    tuple(seq.token_ids[i * bs : (i + 1) * bs]),
                )
                for i in range(len(hits), max_blocks)
            ]  # fmt: skip
            hits += below[: self.lower.match(below)]
        return hits

    # -- allocation --------------------------------------------------------------------------------

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[KVBlock | LowerHit] | None = None,
        *,
        start: int | None = None,
    ) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens from position `start` (where its
        next scheduled token starts: a running sequence's comes from its batch row, which owns
        its counters; None: the sequence's own, it is not running); False (nothing changed) if
        short.

        `cached_prefix` is passed at admission only (from `find_cached_prefix`, possibly empty):
        its blocks gain a reference, its tokens count as computed, and the prefix-cache counters
        record the query.
        """
        if start is None:
            start = seq.num_computed_tokens + seq.num_inflight_tokens
        admitting = cached_prefix is not None
        if not admitting:
            # The common case, a running sequence: often its last block has room already.
            num_needed = -(-(start + num_new_tokens) // self.block_size)
            if num_needed <= len(seq.block_table):
                return True
        cached_prefix = cached_prefix or []
        if admitting and seq.block_table:
            raise ValueError(f"{seq.seq_id}: admission needs an empty block table")
        num_computed = start + len(cached_prefix) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(0, num_needed - len(seq.block_table) - len(cached_prefix))
        # Device hits first, then hits below (`find_cached_prefix`'s order), which need device
        # blocks of their own, like new ones.
        device_hits = [block for block in cached_prefix if isinstance(block, KVBlock)]
        lower_hits = cached_prefix[len(device_hits) :]
        # Unreferenced hits sit in the free queue; taking them shrinks what is left to allocate.
        num_touched = sum(1 for block in device_hits if block.ref_cnt == 0)
        if num_new_blocks + len(lower_hits) > len(self.free_queue) - num_touched:
            return False

        for block in device_hits:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            seq.block_table.append(block.block_id)
        if lower_hits:
            self._load(lower_hits, seq)  # type: ignore[arg-type]
        if admitting:
            num_hit_tokens = len(cached_prefix) * self.block_size
            num_device_tokens = len(device_hits) * self.block_size
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_device_tokens
            if self.lower is not None:
                self.external_queries += seq.num_tokens - num_device_tokens
                self.external_hits += num_hit_tokens - num_device_tokens
            seq.num_cached_tokens = num_hit_tokens
            seq.num_computed_tokens = num_computed
            seq.num_committed_blocks = len(cached_prefix)
        for _ in range(num_new_blocks):
            block = self._reuse(self.free_queue.popleft())
            block.ref_cnt = 1
            seq.block_table.append(block.block_id)
        return True

    def take_blocks(self, count: int) -> list[int] | None:
        """`count` blocks for sequences that each grow by one block (the decode path; the
        caller appends them to the block tables); None, and nothing taken, if fewer are free."""
        if count > len(self.free_queue):
            return None
        taken = self.free_queue.popleft_many(count)
        for block in taken:
            self._reuse(block)
            block.ref_cnt = 1
        return [block.block_id for block in taken]

    def commit_computed_blocks(self, seq: Sequence, num_computed: int | None = None) -> None:
        """Register the blocks of `seq` that became full of computed K/V in the prefix cache
        (`num_computed`: its computed tokens, when the caller has them at hand).

        Called after a step, so a registered block always holds K/V that has been written.
        """
        if not self.enable_prefix_caching:
            return
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        self.commit_computed_blocks_of([seq], [num_computed])

    def commit_computed_blocks_of(self, seqs: list[Sequence], num_computed: list[int]) -> None:
        """`commit_computed_blocks` for several sequences (`num_computed[i]` each): the decode
        path, where a step fills one block in about every `block_size`-th running sequence.

        One loop with `_block_hashes` inlined: this runs for a sixteenth of the batch every
        step, so its per-sequence overhead shows at a thousand sequences.
        """
        if not self.enable_prefix_caching:
            return
        bs, cached, hash_fn, epoch = self.block_size, self.cached, self._hash_fn, self.epoch
        made = self.blocks._made  # a block in a block table was made when it was handed out
        # A file tier below keys chains as they grow (`LowerTier.committed`).
        committed = self.lower.committed if self.lower is not None else None
        for seq, computed in zip(seqs, num_computed, strict=True):
            first, num_full = seq.num_committed_blocks, computed // bs
            # A sequence admitted under other weights (kept running across an update) holds
            # their K/V, and every later block of it attends to that K/V: none of it is shared.
            if num_full <= first or seq.cache_epoch != epoch:
                continue
            # Committed blocks have their hashes already (first <= len(hashes)).
            hashes, tokens, table = seq.block_hashes, seq.token_ids, seq.block_table
            for i in range(first, num_full):
                parent = hashes[i - 1] if i else seq.cache_root
                # One copy of the block's ids, for the hash (which takes a tuple as it is) and
                # for the block.
                block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
                if i == len(hashes):
                    hashes.append(hash_fn(parent, block_tokens))
                block_hash, block = hashes[i], made[table[i]]
                # Already registered (a prefix hit), or another block holds this hash (the same
                # prefix computed twice, or a collision): this one stays private to the sequence.
                if block.block_hash is None and block_hash not in cached:
                    block.block_hash = block_hash
                    block.parent_hash = parent
                    block.token_ids = block_tokens
                    cached[block_hash] = block
                    if committed is not None:
                        committed(LowerHit(block_hash, parent, block_tokens))
            seq.num_committed_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop the references of `seq`, tail block first.

        Reverse order puts a sequence's last blocks nearer the eviction end than its first ones,
        so a shared prefix outlives the suffixes that hang off it. Unhashed blocks hold nothing
        reusable and go to the head, to be handed out before any cached block is evicted.
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)
        seq.block_table = []
        seq.num_committed_blocks = 0

    def free_tail(self, seq: Sequence, keep: int) -> None:
        """Give back the blocks of running `seq` after its first `keep`: positions it reserved
        (speculative drafts) and will not use. They were never committed (their tokens were
        never all computed), so they go to the head of the free queue."""
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            assert block.block_hash is None, f"{block}: a reserved block was committed"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.appendleft(block)
        del seq.block_table[keep:]

    def advance_epoch(self, flush: bool = True) -> int:
        """New weights: K/V computed before now is never a hit again. Later admissions chain
        from the new epoch's root; sequences admitted before commit nothing more. `flush`
        also frees the unreferenced cached blocks at once (their hashes could never match
        again; without it they age out of the free queue). Returns the new epoch."""
        self.epoch += 1
        if flush:
            self.reset_prefix_cache()
        return self.epoch

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block, and everything the tier below holds; returns
        how many device blocks were dropped."""
        dropped = [block for block in self.cached.values() if block.ref_cnt == 0]
        for block in dropped:
            self._evict(block)
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        if self.lower is not None:
            self.lower.reset()
        return len(dropped)

    def copy_in(self, copy: BlockCopy) -> None:
        self._up.append(copy)
        self._loading.update(copy.dst_blocks.tolist())

    def take_copies(self) -> list[BlockCopy]:
        """The block copies decided since the last call, in the order the ranks must run them:
        down (evicted blocks, read before anything overwrites them), then up (hits below)."""
        if not (self._down or self._up):
            return []  # every step asks; most have nothing to copy
        copies, self._down, self._up = self._down + self._up, [], []
        self._loading.clear()
        if self.lower is not None:
            self.lower.unpin()  # the plan that carries these copies reads them before others
        return copies

    # -- internals -------------------------------------------------------------------------------

    def _root(self, seq: Sequence) -> None:
        """At admission: chain `seq`'s hashes from the current epoch's root for its tags
        (recomputed, lazily, when that root changed since they were made)."""
        root = prefix_cache_root(self.epoch, seq.cache_tags)
        if seq.cache_root != root:
            seq.block_hashes.clear()
            seq.cache_root = root
        seq.cache_epoch = self.epoch

    def _reuse(self, block: KVBlock) -> KVBlock:
        """`block`, taken from the free queue for new K/V: a cached one is evicted, and copied
        down first where there is a tier below."""
        if block.block_hash is not None:
            if self.lower is not None:
                self._down += self.lower.store([_described(block)], [block.block_id])
            self._evict(block)
        return block

    def _load(self, hits: list[LowerHit], seq: Sequence) -> None:
        """Give `seq` a device block for each hit below and ask for the copies up. The blocks are
        registered in the prefix cache at once (the copy up runs before any forward pass that
        could read them), unless the device caches that hash already (then they stay private).
        The hits are loaded (pinned below) before the device blocks they displace are stored,
        so those stores can never evict what is about to be read."""
        assert self.lower is not None
        blocks = [self.free_queue.popleft() for _ in hits]
        displaced = [(_described(block), block.block_id) for block in blocks if block.block_hash]
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
        self._up += self.lower.load(hits, [block.block_id for block in blocks])
        self._loading.update(block.block_id for block in blocks)
        for described, block_id in displaced:
            self._down += self.lower.store([described], [block_id])
        for hit, block in zip(hits, blocks, strict=True):
            block.ref_cnt = 1
            if hit.block_hash not in self.cached:
                block.block_hash, block.parent_hash, block.token_ids = (
                    hit.block_hash, hit.parent_hash, hit.token_ids
                )  # fmt: skip
                self.cached[hit.block_hash] = block
            seq.block_table.append(block.block_id)

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None

    def _block_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of every full block of the sequence's tokens, extended incrementally.

        They depend on the tokens only (never on where the K/V lives), so they survive
        preemption and are computed once per block over the sequence's life.
        """
        hashes = seq.block_hashes
        bs = self.block_size
        for i in range(len(hashes), seq.num_tokens // bs):
            parent = hashes[i - 1] if i else seq.cache_root
            hashes.append(self._hash_fn(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    # -- checking ----------------------------------------------------------------------------------

    def check_integrity(
        self, sequences: Iterable[Sequence] = (), num_computed: Iterable[int] | None = None
    ) -> None:
        """Raise AssertionError if any invariant is broken; cheap enough for every test step.

        With `sequences` (every sequence holding blocks), also checks that each block's ref_cnt
        equals the number of block tables that hold it, and that each sequence has blocks for
        its computed tokens (`num_computed`, one per sequence: running sequences' are their
        batch rows'; None: the sequences' own, none of them running).
        """
        in_queue = list(self.free_queue)
        assert len(in_queue) == len(self.free_queue), "free queue length out of sync"
        queued_ids = {block.block_id for block in in_queue}
        assert len(queued_ids) == len(in_queue), "a block is twice in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref_cnt"
            assert (block.ref_cnt == 0) == (block.block_id in queued_ids), (
                f"{block}: ref_cnt == 0 must hold exactly when the block is in the free queue"
            )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} hashed but not cached"
                assert block.token_ids is not None and len(block.token_ids) == self.block_size
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"cache entry {block_hash:#x} points at {block}"
        num_used = sum(1 for block in self.blocks if block.ref_cnt > 0)
        assert num_used + len(in_queue) == self.num_blocks, "free + used != total"
        seen_cached = False
        for block in in_queue:
            seen_cached |= block.block_hash is not None
            assert not (seen_cached and block.block_hash is None), (
                "an empty block sits behind a cached one in the free queue"
            )

        sequences = list(sequences)
        if sequences:
            refs = [0] * self.num_blocks
            if num_computed is None:
                num_computed = [seq.num_computed_tokens for seq in sequences]
            for seq, computed in zip(sequences, num_computed, strict=True):
                assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} repeats a block"
                assert len(seq.block_table) >= self.blocks_needed(computed), (
                    f"{seq} has fewer blocks than computed tokens"
                )
                for block_id in seq.block_table:
                    refs[block_id] += 1
            for block in self.blocks:
                assert block.ref_cnt == refs[block.block_id], (
                    f"{block}: ref_cnt {block.ref_cnt} but held by {refs[block.block_id]} tables"
                )


def _described(block: KVBlock) -> LowerHit:
    """A cached device block as the tiers below know blocks: hash, parent hash, tokens."""
    assert block.block_hash is not None and block.token_ids is not None
    return LowerHit(block.block_hash, block.parent_hash, block.token_ids)
