"""Which attention kernel and tile a launch takes: tables measured on a GPU, read at run time.

The decode and prefill wrappers ask this module once per launch, from shapes alone (no device
read, so a CUDA graph captures the choice with its grid):

- decode: (batch bucket, context bucket, KV dtype) -> kernel ("split", `decode_attention`'s
  one KV head per program, or "packed", `decode_attention_packed`'s several KV heads per
  program) and its (block_n, num_warps, num_stages);
- prefill of fresh prompts: (prompt-length bucket, dtype) -> kernel ("paged",
  `prefill_attention`, or "tma", `prefill_attention_tma`) and its tile.

The tables are JSON files written by the lease's sweeps (`benchmarks/gpu/decode_tiles.py`,
`benchmarks/gpu/attention_micro.py`) into `kernels/tuned/` and committed from there:

    {"table": "decode_tiles", "version": 1,
     "capability": [9, 0],        # the GPU's compute capability they were measured on; they
                                  # apply only there (null: anywhere, for planted test tables)
     "head_dim": 128,             # the geometry swept; other head dims keep the defaults
     "batch_buckets": [1, 8, 64, 256], "context_buckets": [1024, 4096, 16384],
     "entries": [{"batch": 256, "context": 1024, "kv_dtype": "bfloat16", "kernel": "split",
                  "block_n": 128, "num_warps": 4, "num_stages": 3}, ...]}

    {"table": "prefill_tiles", "version": 1, "capability": [9, 0], "head_dim": 128,
     "length_buckets": [1024, 4096, 16384],
     "entries": [{"length": 4096, "dtype": "bfloat16", "kernel": "tma", "block_m": 128,
                  "block_n": 128, "num_warps": 8, "num_stages": 3, "warp_specialize": false}]}

A shape takes the nearest bucket in log2 (ties: the larger); a bucket pair with no entry, a
missing file, another head dim or another GPU keeps the kernel's own default (today's choice).
A table that does not parse or whose entries are malformed is REFUSED with a ValueError that
names the file and the fault: a wrong table is a bug in a sweep or in a hand edit, and serving
on silently different tiles would hide it. The triton backend reads both tables when it is
built, so a bad one stops an engine at start-up, not mid-serving.

Environment (read once per process, by `tables()`):
- `TP_ENGINE_ATTENTION_TABLES=DIR`: read `DIR/decode_tiles.json` and `DIR/prefill_tiles.json`
  instead of `kernels/tuned/` (an absent file: no table). Only such an explicit directory is read
  under the Triton interpreter: the committed tables hold GPU tiles, which would turn the CPU
  tests' short contexts into single tiles.
- `TP_ENGINE_DECODE_KERNEL=split|packed`, `TP_ENGINE_PREFILL_KERNEL=paged|tma`: force a
  kernel whatever the table says (its tile: the table's when the entry names that kernel, else
  the kernel's default). For tests and measurements.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TUNED_DIR = Path(__file__).resolve().parent / "tuned"
DECODE_FILE = "decode_tiles.json"
PREFILL_FILE = "prefill_tiles.json"
TABLES_ENV = "TP_ENGINE_ATTENTION_TABLES"
DECODE_KERNEL_ENV = "TP_ENGINE_DECODE_KERNEL"
PREFILL_KERNEL_ENV = "TP_ENGINE_PREFILL_KERNEL"
DECODE_KERNELS = ("split", "packed")
PREFILL_KERNELS = ("paged", "tma")
# The KV-cache dtypes a decode entry can name, and the query dtypes a prefill entry can (fp32
# always takes the exact "ieee" path, never a tuned tile).
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DECODE_KV_DTYPES = ("bfloat16", "float16", "fp8")
_WARPS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Tile:
    """One launch's kernel and tile; a field left None takes the kernel's default."""

    kernel: str
    block_m: int | None = None  # prefill only: query rows per program
    block_n: int | None = None  # key rows per tile (packed decode: key-head rows, see there)
    num_warps: int | None = None
    num_stages: int | None = None
    warp_specialize: bool | None = None  # prefill "tma" only


@dataclass(frozen=True)
class Table:
    """A validated table: `entries` maps a bucket key to its tile."""

    path: str
    kind: str  # "decode_tiles" or "prefill_tiles"
    capability: tuple[int, int] | None
    head_dim: int
    buckets: tuple[tuple[int, ...], ...]  # decode: (batch, context); prefill: (length,)
    entries: dict[tuple, Tile]


def kv_dtype_name(dtype: torch.dtype) -> str | None:
    """The table's name for a cache (decode) or query (prefill) dtype; None: never tuned."""
    if dtype == torch.float8_e4m3fn:
        return "fp8"
    return _DTYPE_NAMES.get(dtype)


def nearest_bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The bucket nearest to `value` in log2 (ties go to the larger bucket)."""
    x = math.log2(max(int(value), 1))
    return min(buckets, key=lambda b: (abs(math.log2(b) - x), -b))


def _fail(path: str, message: str) -> ValueError:
    return ValueError(
        f"attention table {path}: {message} (fix or delete the file; ${TABLES_ENV} names "
        "another directory)"
    )


def _int(path: str, entry: dict, key: str, allowed: tuple[int, ...] | None = None) -> int:
    value = entry.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _fail(path, f"entry {entry}: {key!r} must be a positive integer")
    if allowed is not None and value not in allowed:
        raise _fail(path, f"entry {entry}: {key!r} must be one of {allowed}")
    return value


def _pow2(path: str, entry: dict, key: str, lo: int, hi: int) -> int:
    value = _int(path, entry, key)
    if value & (value - 1) or not lo <= value <= hi:
        raise _fail(path, f"entry {entry}: {key!r} must be a power of two in [{lo}, {hi}]")
    return value


def _buckets(path: str, raw: dict, key: str) -> tuple[int, ...]:
    values = raw.get(key)
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)
        or sorted(set(values)) != values
    ):
        raise _fail(path, f"{key!r} must be a non-empty increasing list of positive integers")
    return tuple(values)


def _tile(path: str, entry: dict, kernels: tuple[str, ...], prefill: bool) -> Tile:
    kernel = entry.get("kernel")
    if kernel not in kernels:
        raise _fail(path, f"entry {entry}: 'kernel' must be one of {kernels}")
    ws = entry.get("warp_specialize", False)
    if not isinstance(ws, bool):
        raise _fail(path, f"entry {entry}: 'warp_specialize' must be true or false")
    return Tile(
        kernel=kernel,
        block_m=_pow2(path, entry, "block_m", 16, 256) if prefill else None,
        block_n=_pow2(path, entry, "block_n", 16, 256),
        num_warps=_int(path, entry, "num_warps", _WARPS),
        num_stages=_int(path, entry, "num_stages", tuple(range(1, 9))),
        warp_specialize=ws if prefill else None,
    )


def parse_table(raw: Any, path: str, kind: str) -> Table:
    """Validate a table's JSON value; raises ValueError naming `path` and the fault."""
    if not isinstance(raw, dict) or raw.get("table") != kind:
        raise _fail(path, f"not a {kind} table (its 'table' field must be {kind!r})")
    if raw.get("version") != 1:
        raise _fail(path, f"unknown version {raw.get('version')!r} (this runtime reads 1)")
    cap = raw.get("capability")
    if cap is not None and not (
        isinstance(cap, list) and len(cap) == 2 and all(isinstance(c, int) for c in cap)
    ):
        raise _fail(path, "'capability' must be [major, minor] or null")
    head_dim = raw.get("head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise _fail(path, "'head_dim' must be a positive integer")
    if not isinstance(raw.get("entries"), list):
        raise _fail(path, "'entries' must be a list")
    prefill = kind == "prefill_tiles"
    if prefill:
        buckets = (_buckets(path, raw, "length_buckets"),)
        fields, dtypes, kernels = ("length",), tuple(_DTYPE_NAMES.values()), PREFILL_KERNELS
        dtype_key = "dtype"
    else:
        buckets = (_buckets(path, raw, "batch_buckets"), _buckets(path, raw, "context_buckets"))
        fields, dtypes, kernels = ("batch", "context"), _DECODE_KV_DTYPES, DECODE_KERNELS
        dtype_key = "kv_dtype"
    entries: dict[tuple, Tile] = {}
    for entry in raw["entries"]:
        if not isinstance(entry, dict):
            raise _fail(path, f"entry {entry!r} is not an object")
        key = []
        for field, allowed in zip(fields, buckets, strict=True):
            if entry.get(field) not in allowed:
                raise _fail(path, f"entry {entry}: {field!r} must be one of {allowed}")
            key.append(entry[field])
        if entry.get(dtype_key) not in dtypes:
            raise _fail(path, f"entry {entry}: {dtype_key!r} must be one of {dtypes}")
        key.append(entry[dtype_key])
        if tuple(key) in entries:
            raise _fail(path, f"two entries for {tuple(key)}")
        entries[tuple(key)] = _tile(path, entry, kernels, prefill)
    return Table(path, kind, tuple(cap) if cap else None, head_dim, buckets, entries)


def load_table(path: Path, kind: str) -> Table | None:
    """The table at `path`, validated; None when there is no such file."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(str(path), f"not JSON ({exc})") from None
    return parse_table(raw, str(path), kind)


@dataclass(frozen=True)
class Tables:
    """What this process reads: the two tables (or None) and the forced kernels."""

    decode: Table | None
    prefill: Table | None
    force_decode: str | None
    force_prefill: str | None
    # The committed tables are for GPUs; under the interpreter only an explicit directory counts.
    explicit: bool


def _forced(env: str, allowed: tuple[str, ...]) -> str | None:
    value = os.environ.get(env, "").strip()
    if not value:
        return None
    if value not in allowed:
        raise ValueError(f"${env}={value!r}: must be one of {allowed}")
    return value


@functools.cache
def tables() -> Tables:
    """The tables and forced kernels of this process (environment read once; `reset()` for
    tests that change it)."""
    explicit_dir = os.environ.get(TABLES_ENV, "").strip()
    folder = Path(explicit_dir) if explicit_dir else TUNED_DIR
    return Tables(
        decode=load_table(folder / DECODE_FILE, "decode_tiles"),
        prefill=load_table(folder / PREFILL_FILE, "prefill_tiles"),
        force_decode=_forced(DECODE_KERNEL_ENV, DECODE_KERNELS),
        force_prefill=_forced(PREFILL_KERNEL_ENV, PREFILL_KERNELS),
        explicit=bool(explicit_dir),
    )


def reset() -> None:
    """Forget what `tables()` read (tests that plant a table or force a kernel)."""
    tables.cache_clear()


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def _applies(
    table: Table | None, t: Tables, head_dim: int, device: torch.device, interpret: bool
) -> bool:
    if table is None or table.head_dim != head_dim:
        return False
    if interpret:
        return t.explicit
    if table.capability is None:
        return True
    index = device.index if device.index is not None else 0
    return device.type == "cuda" and _capability(index) == table.capability


def _lookup(table: Table, values: tuple[int, ...], dtype_name: str) -> Tile | None:
    key = tuple(nearest_bucket(v, b) for v, b in zip(values, table.buckets, strict=True))
    return table.entries.get((*key, dtype_name))


def _choose(table, forced, default, values, dtype, head_dim, device, interpret) -> Tile:
    t = tables()
    name = kv_dtype_name(dtype)
    tile = None
    if name is not None and _applies(table, t, head_dim, device, interpret):
        tile = _lookup(table, values, name)
    if forced is not None and (tile is None or tile.kernel != forced):
        return Tile(forced)
    return tile or Tile(default)


def decode_tile(
    num_seqs: int,
    context_bound: int,
    kv_dtype: torch.dtype,
    head_dim: int,
    device: torch.device,
    interpret: bool,
) -> Tile:
    """The decode kernel and tile for `num_seqs` sequences whose contexts are at most
    `context_bound` tokens, over a cache of `kv_dtype`."""
    t = tables()
    return _choose(
        t.decode, t.force_decode, "split", (num_seqs, context_bound), kv_dtype, head_dim,
        device, interpret,
    )  # fmt: skip


def prefill_tile(
    max_query_len: int, dtype: torch.dtype, head_dim: int, device: torch.device, interpret: bool
) -> Tile:
    """The kernel and tile for the fresh prompts of a step (the longest `max_query_len`)."""
    t = tables()
    return _choose(
        t.prefill, t.force_prefill, "paged", (max_query_len,), dtype, head_dim, device, interpret
    )
