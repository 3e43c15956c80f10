"""The KV file tier's files: one per block and rank, named by the block's key, checksummed.

Rank 0 decides which blocks the file tier holds (`tp_engine.core.kv.file_tier`) and checks the
files before it calls one a hit; every rank writes and reads its own shard
(`rank_worker.kv.copies`). Both sides use this module, so the name and the layout are defined
once:

    <directory>/<key hex>.r<rank>-of-<world>.kvb

    offset  size  field
    0       8     magic b"TPEKVB01"
    8       16    the block's key (`FileTier` derives it from the checkpoint and the tokens)
    24      8     payload bytes, little-endian
    32      8     xxh3-64 of the payload, little-endian
    40      ...   payload: the rank's K/V of the block, every layer (the host pool's layout)

A file is written to a temporary name and renamed, so a reader sees a whole file or none; a
truncated or corrupted one (a crash of another writer, a full disk, bit rot) fails `check` and
is never read as K/V.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import xxhash

__all__ = ["HEADER_BYTES", "KEY_BYTES", "block_file", "check", "key_values", "read", "write"]

MAGIC = b"TPEKVB01"
KEY_BYTES = 16
_HEADER = struct.Struct("<8s16sQQ")
HEADER_BYTES = _HEADER.size
SUFFIX = ".kvb"


def block_file(directory: Path, key: bytes, rank: int, world: int) -> Path:
    return directory / f"{key.hex()}.r{rank}-of-{world}{SUFFIX}"


def parse_name(name: str) -> tuple[bytes, int, int] | None:
    """(key, rank, world) of a block file's name; None for any other name."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    key_hex, _, shard = stem.partition(".r")
    rank, _, world = shard.partition("-of-")
    try:
        key = bytes.fromhex(key_hex)
        return (key, int(rank), int(world)) if len(key) == KEY_BYTES else None
    except ValueError:
        return None


def key_values(key: bytes) -> np.ndarray:
    """A key as 8 non-negative int32 values (StepPlan sections hold values >= 0), and back
    with `key_bytes`."""
    return np.frombuffer(key, dtype="<u2").astype(np.int32)


def key_bytes(values: np.ndarray) -> bytes:
    return values.astype("<u2").tobytes()


def write(path: Path, key: bytes, payload: np.ndarray) -> None:
    """Write `payload` (a contiguous uint8 array) as `path`, atomically; OSError as raised."""
    data = payload.tobytes()
    header = _HEADER.pack(MAGIC, key, len(data), xxhash.xxh3_64_intdigest(data))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read(path: Path, key: bytes, num_bytes: int) -> np.ndarray | None:
    """The payload of `path` if it is a whole, unchanged block file of `key` holding
    `num_bytes` bytes; None otherwise (missing, truncated, corrupted, another key)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES + num_bytes + 1)
    except OSError:
        return None
    if len(raw) != HEADER_BYTES + num_bytes:
        return None
    magic, stored_key, size, checksum = _HEADER.unpack_from(raw)
    payload = np.frombuffer(raw, dtype=np.uint8, offset=HEADER_BYTES)
    if magic != MAGIC or stored_key != key or size != num_bytes:
        return None
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    return payload


def check(path: Path, key: bytes, num_bytes: int) -> bool:
    """Whether `path` is a whole, unchanged block file of `key` (`read` without keeping it)."""
    return read(path, key, num_bytes) is not None
