"""The KV manager's interfaces: what the scheduler asks of it (`KVTier`), and what a tier below
the device pool provides (`LowerTier`).

The scheduler sees one `KVTier`: the pool of device blocks that sequences hold, with its prefix
cache. `BlockManager` is that tier for the device (GPU) cache and the one implementation
today. A tier below it (host memory, then files: later issues) is a `LowerTier` the device
tier consults and feeds, not something the scheduler sees: a prefix lookup that misses in the
device pool may hit below (the device tier then allocates device blocks and asks for a copy
up), and a full block the device pool evicts may be copied down first. Those decisions leave
rank 0 as `shm_ipc.block_copies.BlockCopy` values (in a StepPlan section: a later issue),
carried out on every rank by a `rank_worker.kv.copies.BlockCopier` before the forward pass.
Adding a tier is a class beside `BlockManager` and a copier on the ranks; the scheduler, which
sees only `KVTier`, is not edited.

Block accounting (every tier): ids are ints in `[0, num_blocks)`; a block is free, or held by
sequences (ref counted), or cached and unreferenced (reusable, evicted on reuse).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from collections.abc import Sequence as TokenIds
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from shm_ipc.block_copies import BlockCopy
    from tp_engine.core.kv.blocks import KVBlock, LowerHit
    from tp_engine.core.sequence import Sequence

__all__ = ["KVTier", "LowerTier"]


@runtime_checkable
class KVTier(Protocol):
    """The device pool as the scheduler uses it (`BlockManager` is one)."""

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    # Prefix-cache lookups and hits, in blocks, since start (metrics); of them, those that
    # looked in and found blocks in the tiers below.
    prefix_cache_queries: int
    prefix_cache_hits: int
    external_queries: int
    external_hits: int

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (free or cached and unreferenced)."""

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache."""

    @property
    def usage(self) -> float:
        """The fraction of blocks held by sequences (metrics)."""

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""

    def loading(self, seq: Sequence) -> bool:
        """Whether a copy up that the next plan carries writes one of `seq`'s blocks: `seq` may
        not compute in that plan (the copy overlaps its forward pass), unless the plan says it
        reads its own copies up (`ScheduledStep.reads_copies_up`)."""

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock | LowerHit]:
        """The longest run of `seq`'s full blocks already cached (nothing is taken yet): device
        blocks, then blocks found in a tier below (`LowerHit`), which `allocate_slots` gives
        device blocks and copies up."""

    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[KVBlock | LowerHit] | None = None,
        *,
        start: int | None = None,
    ) -> bool:
        """Give `seq` the blocks for `num_new_tokens` more tokens (after `start`, default its
        computed ones), taking `cached_prefix` first; False (nothing taken) if they do not
        fit."""

    def take_blocks(self, count: int) -> list[int] | None:
        """`count` blocks outside any sequence (warm-up, tests), None if they do not fit."""

    def commit_computed_blocks_of(self, seqs: list[Sequence], num_computed: list[int]) -> None:
        """Register the blocks each sequence has filled up to `num_computed` tokens."""

    def free(self, seq: Sequence) -> None:
        """Give back every block `seq` holds (cached ones stay cached, unreferenced)."""

    def free_tail(self, seq: Sequence, keep: int) -> None:
        """Give back `seq`'s blocks after its first `keep` (rejected drafts)."""

    def advance_epoch(self, flush: bool = True) -> int:
        """New weights: nothing cached before is a hit again."""

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block; how many were dropped."""

    def take_copies(self) -> list[BlockCopy]:
        """Block copies between tiers decided since the last call, in the order every rank must
        run them before the next plan's forward pass (the step pipeline sends them)."""

    def copy_in(self, copy: BlockCopy) -> None:
        """Queue a copy up into device blocks a caller holds (a prefill/decode staging pool's):
        it leaves with the next `take_copies`, and those blocks count as loading until then."""

    def check_integrity(
        self, sequences: Iterable[Sequence] = (), num_computed: Iterable[int] | None = None
    ) -> None:
        """Assert the pool's invariants (tests)."""


class LowerTier(Protocol):
    """A tier below the device pool: holds copies of full blocks by their prefix-cache hash
    (`block_manager.hash_block_tokens` chains), in blocks of its own. Blocks are described as
    `LowerHit`s (hash, parent hash, tokens): a tier may key them its own way (files)."""

    # Its name in `BlockCopy.src` / `dst`, and on the ranks.
    name: str
    num_blocks: int

    def match(self, blocks: TokenIds[LowerHit]) -> int:
        """How many of the leading `blocks` this tier (or one below it) holds."""

    def load(self, blocks: TokenIds[LowerHit], device_blocks: TokenIds[int]) -> list[BlockCopy]:
        """The copies up of matched `blocks` into `device_blocks`."""

    def store(self, blocks: TokenIds[LowerHit], device_blocks: TokenIds[int]) -> list[BlockCopy]:
        """Take copies of the full device blocks `device_blocks` (holding `blocks`), evicting
        its own least recently used ones (never one a pending copy reads); the copies down."""

    @property
    def committed(self) -> Callable[[LowerHit], None] | None:
        """Called with each block the device tier registers in its prefix cache (each chain in
        order); None: the tier needs no such call (the device tier's commits are a hot path)."""

    def unpin(self) -> None:
        """The copies decided so far have left in a plan: blocks they read may be evicted."""

    def reset(self) -> int:
        """Forget every block held (`reset_prefix_cache`, new weights); how many."""
