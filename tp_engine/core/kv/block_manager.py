"""The paged KV-cache pool on rank 0: block allocation and the prefix cache.

`BlockManager` is the device tier (`tp_engine.core.kv.base.KVTier`), the pool of blocks the
forward pass reads, and today's one tier.

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

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as TokenIds

from tp_engine.core.sequence import Sequence

HashFn = Callable[[int | None, TokenIds[int]], int]


def hash_block_tokens(parent_hash: int | None, token_ids: TokenIds[int]) -> int:
    """Chained hash of one full block: depends on every token before it through parent_hash
    (None for a first block)."""
    # Python's tuple hash (xxHash's round over the items' hashes, in C): a third of the cost
    # of xxh3 over the ids packed into bytes, given the tuple, which a commit makes for the
    # block anyway (the decode path commits a block for one in block_size sequences every
    # step). Its collisions are as harmless as any hash's: a hit compares the stored ids and
    # the parent's hash exactly. Ints hash alike in every process (only str and bytes hashes
    # are salted), and the hashes never leave rank 0 anyway.
    return hash((parent_hash, tuple(token_ids)))


def prefix_cache_root(epoch: int, tags: tuple[tuple[str, object], ...] = ()) -> int | None:
    """The root of a sequence's hash chain: None for the base model at weight epoch 0 (so those
    hashes are what they always were), else a hash of the epoch and the sequence's tags.

    K/V depends on more than tokens: on the weights that computed it (`epoch`, advanced by every
    weight update) and on an adapter. Rooting the chain there makes blocks of different
    weights or adapters different keys; tags are (namespace, value) pairs, so a user's salt can
    never spell an adapter's id.
    """
    if epoch == 0 and not tags:
        return None
    return hash(("prefix-cache root", ("epoch", epoch), *tags))


class KVBlock:
    """One physical block of `block_size` token slots, plus its free-queue links."""

    __slots__ = ("block_hash", "block_id", "next", "parent_hash", "prev", "ref_cnt", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache.
        self.block_hash: int | None = None
        # What the hash stands for, compared on every hit.
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        # Free-queue neighbours; both None exactly when the block is not in the queue.
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class LazyBlocks:
    """Every block of the pool, indexed by id; each `KVBlock` is made on first access."""

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._made: list[KVBlock] = []

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, block_id: int) -> KVBlock:
        made = self._made
        if block_id < len(made):
            return made[block_id]
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block {block_id} is not in a pool of {self._num_blocks}")
        while len(made) <= block_id:
            made.append(KVBlock(len(made)))
        return made[block_id]

    def __iter__(self) -> Iterator[KVBlock]:
        return (self[block_id] for block_id in range(self._num_blocks))

    def range(self, start: int, stop: int) -> list[KVBlock]:
        """Blocks `start` to `stop - 1`, made in one go where they are new."""
        made = self._made
        if len(made) < stop:
            if stop > self._num_blocks:
                raise IndexError(f"block {stop - 1} is not in a pool of {self._num_blocks}")
            made.extend(map(KVBlock, range(len(made), stop)))
        return made[start:stop]


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, appendleft, popleft and remove.

    `fresh`: a pool whose blocks all start free and unused; they are handed out in id order
    after the empty blocks queued ahead of them and before any cached one, without being
    linked in until they are used and freed.
    """

    def __init__(self, blocks: Iterable[KVBlock] = (), fresh: LazyBlocks | None = None) -> None:
        # Sentinels at both ends remove every empty-list special case.
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)
        self._fresh = fresh
        self._fresh_next = 0
        self._fresh_end = 0 if fresh is None else len(fresh)

    def __len__(self) -> int:
        return self._len + self._fresh_end - self._fresh_next

    def __iter__(self) -> Iterator[KVBlock]:
        """Head to tail: empty blocks, the unused ones, then cached ones (LRU first)."""
        node = self._head.next
        while node is not self._tail and node is not None and node.block_hash is None:
            yield node
            node = node.next
        if self._fresh is not None:
            for block_id in range(self._fresh_next, self._fresh_end):
                yield self._fresh[block_id]
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def popleft(self) -> KVBlock:
        head = self._head.next
        assert head is not None
        if (head is self._tail or head.block_hash is not None) and (
            self._fresh_next < self._fresh_end
        ):
            assert self._fresh is not None
            self._fresh_next += 1
            return self._fresh[self._fresh_next - 1]
        if self._len == 0:
            raise RuntimeError("no free KV block left (the scheduler should have checked)")
        self.remove(head)
        return head

    def popleft_many(self, count: int) -> list[KVBlock]:
        """`count` blocks in `popleft` order (the caller checked there are that many); a run of
        unused blocks is taken in one go."""
        taken: list[KVBlock] = []
        while len(taken) < count:
            head = self._head.next
            assert head is not None
            fresh_left = self._fresh_end - self._fresh_next
            if (head is self._tail or head.block_hash is not None) and fresh_left:
                assert self._fresh is not None
                n = min(count - len(taken), fresh_left)
                taken += self._fresh.range(self._fresh_next, self._fresh_next + n)
                self._fresh_next += n
            else:
                taken.append(self.popleft())
        return taken

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1

    def _insert_after(self, anchor: KVBlock | None, block: KVBlock) -> None:
        if block.prev is not None or block.next is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        assert anchor is not None and anchor.next is not None
        block.prev, block.next = anchor, anchor.next
        anchor.next.prev = block
        anchor.next = block
        self._len += 1


class BlockManager:
    """Allocates KV blocks to sequences and shares full blocks through the prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block_tokens,
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

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
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
        max_blocks = (seq.num_tokens - 1) // self.block_size
        bs = self.block_size
        hits: list[KVBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            block = self.cached.get(hashes[i])
            if (
                block is None
                or block.parent_hash != (hashes[i - 1] if i else seq.cache_root)
                or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs])
            ):
                break
            hits.append(block)
        return hits

    # -- allocation --------------------------------------------------------------------------------

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[KVBlock] | None = None,
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
        # Unreferenced hits sit in the free queue; taking them shrinks what is left to allocate.
        num_touched = sum(1 for block in cached_prefix if block.ref_cnt == 0)
        if num_new_blocks > len(self.free_queue) - num_touched:
            return False

        for block in cached_prefix:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            seq.block_table.append(block.block_id)
        if admitting:
            num_hit_tokens = len(cached_prefix) * self.block_size
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            seq.num_cached_tokens = num_hit_tokens
            seq.num_computed_tokens = num_computed
            seq.num_committed_blocks = len(cached_prefix)
        for _ in range(num_new_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
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
            if block.block_hash is not None:
                self._evict(block)
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
        """Forget every unreferenced cached block; returns how many were dropped."""
        dropped = [block for block in self.cached.values() if block.ref_cnt == 0]
        for block in dropped:
            self._evict(block)
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)
        return len(dropped)

    # -- internals -------------------------------------------------------------------------------

    def _root(self, seq: Sequence) -> None:
        """At admission: chain `seq`'s hashes from the current epoch's root for its tags
        (recomputed, lazily, when that root changed since they were made)."""
        root = prefix_cache_root(self.epoch, seq.cache_tags)
        if seq.cache_root != root:
            seq.block_hashes.clear()
            seq.cache_root = root
        seq.cache_epoch = self.epoch

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
