"""The device tier's building blocks: a block of token slots (`KVBlock`), the pool's blocks made
on first use (`LazyBlocks`), the free queue in LRU order (`FreeBlockQueue`), the chained block
hash and its root, and a prefix hit found in a tier below (`LowerHit`). `BlockManager`
(`block_manager`) composes them; the states they move through are tabulated there."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as TokenIds

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


class LowerHit:
    """A block of a prefix found in the tier below (`BlockManager.find_cached_prefix`): its hash
    and the tokens it holds. `allocate_slots` gives it a device block and asks for the copy up."""

    __slots__ = ("block_hash", "parent_hash", "token_ids")

    def __init__(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]):
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.token_ids = token_ids
