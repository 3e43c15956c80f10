"""Rank 0's index of the KV file tier (`--kv-offloading-dir`): blocks kept as files below the
host tier, so that prefixes outlive the host pool and the process.

Keys. The device and host tiers key blocks by the prefix cache's chained hash, which holds only
within one process. A file must be found again by the next process, and never by one with other
weights, so it is named by a key of its own, chained the same way from a root that names the
weights: key(i) = xxh3-128(key(i - 1) | token ids of block i), key(-1) = the namespace
(`namespace`: a fingerprint of the checkpoint's files, the KV layout, the tensor-parallel
size). Only the base model's chains as loaded are keyed: a chain rooted elsewhere (a weight
update's epoch, an adapter, a cache salt: `blocks.prefix_cache_root`) has no key, so the file
tier neither keeps nor finds it. After a weight update nothing new reaches the files and
nothing there is read (the epoch roots every later chain elsewhere).

Data path. Blocks are written through from host memory: a block copied down to the host pool
is also written to its file (a `BlockCopy` host -> file, which every rank runs after the plan's
forward pass, from its own host block, pinned in the host tier until then). A hit is read on
every rank straight into device blocks (file -> device, before the forward pass that reads
it). Before calling a block a hit, rank 0 checks that every rank's file of it exists and, once
per file that this process did not write (a previous run's), reads it whole and compares its
checksum: a truncated or corrupted file is a miss, logged and deleted, never wrong K/V.

Capacity: at most `capacity_bytes` of files (every rank's shards), least recently used
evicted (rank 0 deletes every shard). At start the directory's block files are indexed by
modification time, so a restarted server finds its predecessor's blocks; files of other
namespaces count toward the cap and age out like the rest.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import xxhash

from shm_ipc import kv_files
from shm_ipc.block_copies import DEVICE_TIER, FILE_TIER, HOST_TIER, BlockCopy
from tp_engine.config import EngineConfig
from tp_engine.core.kv.blocks import LowerHit

__all__ = ["FileTier", "checkpoint_fingerprint", "open_file_tier"]

logger = logging.getLogger(__name__)


def checkpoint_fingerprint(model_dir: Path) -> bytes:
    """xxh3-128 over the checkpoint's config and weight files, by name and content (read once,
    at start, only with a file tier)."""
    digest = xxhash.xxh3_128()
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.json"))
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.digest()


class FileTier:
    """A `LowerTier` of block files in `directory`, `shard_bytes` per rank and block."""

    name = FILE_TIER

    def __init__(
        self, directory: Path, capacity_bytes: int, namespace: bytes, shard_bytes: int, world: int
    ) -> None:
        self.directory = directory
        self.namespace = namespace
        self.shard_bytes = shard_bytes
        self.world = world
        self.file_bytes = world * (kv_files.HEADER_BYTES + shard_bytes)  # every rank's shard
        self.num_blocks = capacity_bytes // self.file_bytes
        if self.num_blocks < 1:
            raise ValueError(
                f"a file tier of {capacity_bytes} bytes holds no block of {self.file_bytes} bytes"
            )
        # key -> checked (written by this process, or read whole once), least recent first.
        self._files: OrderedDict[bytes, bool] = OrderedDict()
        # Prefix-cache hash -> key, for the chains keyed so far (a block's parent is keyed
        # before it: the device tier reports every block it commits, in chain order, and a
        # lookup below starts where the device's hits stop), least recent first; bounded, a
        # forgotten key only costs hits.
        self._keys: OrderedDict[int, bytes] = OrderedDict()
        self._max_keys = max(1 << 20, 8 * self.num_blocks)
        # Keys a pending copy reads (loads) or writes (stores): never evicted until `unpin`.
        self._pinned: set[bytes] = set()
        self.queries = self.hits = 0
        self._index_directory()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._files)

    def key_of(self, block: LowerHit) -> bytes | None:
        """The file key of `block`, None if its chain is not the base model's as loaded (or
        its parent's key was forgotten)."""
        key = self._keys.get(block.block_hash)
        if key is not None:
            self._keys.move_to_end(block.block_hash)
            return key
        parent = self.namespace if block.parent_hash is None else self._keys.get(block.parent_hash)
        if parent is None:
            return None
        key = xxhash.xxh3_128_digest(parent + np.asarray(block.token_ids, np.int64).tobytes())
        self._keys[block.block_hash] = key
        if len(self._keys) > self._max_keys:
            self._keys.popitem(last=False)
        return key

    def committed(self, block: LowerHit) -> None:
        """The device tier registered `block` (chain order): key it, so its children can be."""
        self.key_of(block)

    def match(self, blocks: Sequence[LowerHit]) -> int:
        """How many of the leading `blocks` have whole, unchanged files on every rank."""
        count = 0
        for block in blocks:
            key = self.key_of(block)
            if key is None or key not in self._files or not self._usable(key):
                break
            count += 1
        self.queries += len(blocks)
        self.hits += count
        return count

    def load(self, blocks: Sequence[LowerHit], device_blocks: Sequence[int]) -> list[BlockCopy]:
        """The copy of matched `blocks`' files into `device_blocks` (they become the most
        recently used)."""
        keys = [self._keys[block.block_hash] for block in blocks]
        for key in keys:
            self._files.move_to_end(key)
        self._pinned.update(keys)
        return [_file_copy(FILE_TIER, DEVICE_TIER, range(len(keys)), device_blocks, keys)]

    def store(self, blocks: Sequence[LowerHit], host_blocks: Sequence[int]) -> list[BlockCopy]:
        """Write through: the copy of host blocks `host_blocks` (just copied down, holding
        `blocks`) into files, for those keyed and not held yet; held ones become recent."""
        src, keys = [], []
        for block, host_block in zip(blocks, host_blocks, strict=True):
            key = self.key_of(block)
            if key is None:
                break  # the rest of the chain has no key either
            if key in self._files:
                self._files.move_to_end(key)
                continue
            if not self._make_room():
                break
            self._files[key] = True
            self._pinned.add(key)
            src.append(host_block)
            keys.append(key)
        if not keys:
            return []
        return [_file_copy(HOST_TIER, FILE_TIER, src, range(len(keys)), keys)]

    def unpin(self) -> None:
        self._pinned.clear()

    def reset(self) -> int:
        """Delete every block file indexed (a reset of the prefix cache, new weights)."""
        dropped = len(self._files)
        for key in list(self._files):
            self._delete(key)
        self._keys.clear()
        self._pinned.clear()
        return dropped

    # -- internals -------------------------------------------------------------------------------

    def _paths(self, key: bytes) -> list[Path]:
        return [kv_files.block_file(self.directory, key, r, self.world) for r in range(self.world)]

    def _usable(self, key: bytes) -> bool:
        """Every rank's file of `key` is there, and whole and unchanged if not checked yet;
        otherwise the block is dropped (logged when a file is bad)."""
        paths = self._paths(key)
        if self._files[key]:
            if all(path.exists() for path in paths):
                return True
            reason = "missing (a write failed?)"
        else:
            if all(kv_files.check(path, key, self.shard_bytes) for path in paths):
                self._files[key] = True
                return True
            reason = "truncated, corrupted or missing"
        logger.warning("KV file tier: block %s is %s: recomputing it", key.hex(), reason)
        self._delete(key)
        return False

    def _make_room(self) -> bool:
        while len(self._files) >= self.num_blocks:
            victim = next((k for k in self._files if k not in self._pinned), None)
            if victim is None:
                return False
            self._delete(victim)
        return True

    def _delete(self, key: bytes) -> None:
        self._files.pop(key, None)
        for path in self._paths(key):
            path.unlink(missing_ok=True)

    def _index_directory(self) -> None:
        """Index the block files of this world size already in the directory (a previous
        run's), oldest first, unchecked; evict beyond the capacity."""
        found: dict[bytes, list[float]] = {}
        for entry in os.scandir(self.directory):
            parsed = kv_files.parse_name(entry.name)
            if parsed is not None and parsed[2] == self.world:
                found.setdefault(parsed[0], []).append(entry.stat().st_mtime)
        whole = [(max(times), key) for key, times in found.items() if len(times) == self.world]
        for _, key in sorted(whole):
            self._files[key] = False
        while len(self._files) > self.num_blocks:
            self._delete(next(iter(self._files)))


def _file_copy(
    src: str, dst: str, src_ids: Iterable[int], dst_ids: Iterable[int], keys: list[bytes]
) -> BlockCopy:
    return BlockCopy(
        src, dst,
        np.fromiter(src_ids, np.int32), np.fromiter(dst_ids, np.int32),
        np.stack([kv_files.key_values(key) for key in keys]),
    )  # fmt: skip


def open_file_tier(
    config: EngineConfig, model_dir: Path, shard_bytes: int, layout: str
) -> FileTier | None:
    """The file tier `config` asks for (`kv_offloading_dir`), or None with a warning when the
    directory cannot be written (read-only, full, not a directory): the server runs without
    it. `shard_bytes`: one rank's bytes per block; `layout`: the ranks' host-pool layout
    (shape, dtype), part of the namespace with the checkpoint's fingerprint."""
    assert config.kv_offloading_dir is not None
    path = Path(config.kv_offloading_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}"
        probe.write_bytes(b"\0" * 4096)
        probe.unlink()
    except OSError as exc:
        logger.warning("KV file tier off: %s cannot be written (%s)", path, exc)
        return None
    world = config.tensor_parallel_size
    namespace = xxhash.xxh3_128_digest(
        checkpoint_fingerprint(model_dir)
        + repr((layout, config.block_size, world, config.hf_overrides)).encode()
    )
    capacity = int(config.kv_offloading_dir_size * (1 << 30))
    tier = FileTier(path, capacity, namespace, shard_bytes, world)
    logger.info(
        "KV file tier in %s: %d blocks at most, %d found from earlier runs",
        path, tier.num_blocks, tier.num_cached_blocks,
    )  # fmt: skip
    return tier
