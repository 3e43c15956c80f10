"""KV blocks from this rank's paged cache into a peer's, with Mooncake's transfer engine.

Prefill/decode disaggregation moves a prompt's KV from a prefill server's cache into a decode
server's: rank r of the one writes its heads' K/V straight into rank r of the other (the same
TP size on both sides, so the same heads). This module is the rank's half of that move and
knows nothing of requests: what it gets is two `KVRegion`s (where each side's cache lies) and
two lists of block ids (which blocks of one go to which blocks of the other).

Who owns what. The caller (the rank's disaggregation worker) owns the caches and the block
ids; a `KVTransferEngine` owns one Mooncake engine, the registrations of memory it was given
(kept referenced so that the memory outlives them) and nothing else. The receiving side
registers its cache, then publishes its `session_id` and `KVRegion.to_wire()` (plain ints in a
msgspec message); the sender calls `write_blocks`, which returns once every byte has landed.

Addresses. One rank's cache is ONE contiguous allocation (`rank_worker.kv.cache`):

    [num_layers, 2 (K, V), num_blocks, block_size, num_local_kv_heads, head_dim]

so block b of layer l, K (kv=0) or V (kv=1), starts at

    base_ptr + l * layer_stride + kv * kv_stride + b * block_bytes

and is `block_bytes` long. The two sides may have different `num_blocks` (so different
`layer_stride` and `kv_stride`); they must agree on `num_layers` and `block_bytes` (same model,
TP size, block size and dtype). A run of consecutive block ids on both sides is one transfer of
`count * block_bytes` per layer and per K/V, so a prompt whose blocks are contiguous on both
sides moves in `2 * num_layers` transfers however long it is.

Mooncake facts this relies on (0.3.13, TCP transport; checked on this machine):
- `batch_transfer_sync_write(peer, srcs, dsts, lengths)` returns 0 once all have landed, or
  -1; the peer refuses a destination outside memory it registered (-1, nothing written). The
  GIL is released while it runs. Over TCP a sender's source memory need not be registered;
  the sender registers its cache all the same, since RDMA needs it.
- A batch well past the per-peer queue (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`, default 1024)
  is refused whole (-1, "queue-full rejection"; 2048 in one call passed here, 3584 did not):
  `write` splits into batches of `max_batch`, one after the other.
- A peer that is gone (its port closed) fails fast: under a millisecond before the first
  handshake, about 0.5 to 1 s once a connection had been made (the lane's reconnect backoff).
  A peer that is alive but stuck (stopped, or its host silent) holds a write for 30 s once
  connected (`MC_TCP_PROGRESS_TIMEOUT_SEC`) and for about 60 s in the first handshake
  (`MC_HANDSHAKE_CONNECT_TIMEOUT` does not shorten it): the caller's own liveness check must
  notice a stuck peer sooner. Dropping an engine takes about a second (its threads stop).
- Logging is glog, but Mooncake sets the level itself from `MC_LOG_LEVEL` (INFO, WARNING or
  ERROR, read once when `mooncake.engine` loads; `GLOG_minloglevel` is overridden). This module
  defaults it to WARNING, so warnings and errors stay; Mooncake logs a harmless "Local segment
  descriptor not found" error at every start-up.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

__all__ = [
    "MAX_BATCH",
    "KVRegion",
    "KVTransferEngine",
    "KVTransferError",
    "block_runs",
    "default_protocol",
    "write_descriptors",
]

# Transfers per `batch_transfer_sync_write` call: under Mooncake's TCP queue of 1024 transfers
# per peer (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`), past which it refuses a batch whole rather
# than queueing it. Smaller batches cost no throughput (benchmarks/results/cpu/pd-transfer).
MAX_BATCH = 1000

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class KVRegion:
    """Where one rank's paged KV cache lies in memory, in bytes; what a sender needs to address
    the receiver's blocks (it travels as `to_wire()`)."""

    base_ptr: int  # address of layer 0's K, block 0 (a device address for a GPU cache)
    num_layers: int
    layer_stride: int  # bytes from layer l's K to layer l+1's K
    kv_stride: int  # bytes from a layer's K to its V
    block_bytes: int  # one block of K (or V) of one layer: block_size * heads * head_dim * itemsize
    num_blocks: int  # block ids run 0..num_blocks-1; a write past them is refused here

    @classmethod
    def of_cache(cls, cache: torch.Tensor) -> KVRegion:
        """The region of the project's one-allocation cache
        `[num_layers, 2, num_blocks, block_size, num_local_kv_heads, head_dim]`."""
        if cache.dim() != 6 or cache.shape[1] != 2:
            raise ValueError(
                "a KV cache is [num_layers, 2, num_blocks, block_size, kv_heads, head_dim], "
                f"got shape {tuple(cache.shape)}"
            )
        if not cache.is_contiguous():
            # Strides then no longer describe blocks of `block_bytes` back to back.
            raise ValueError(f"the KV cache must be contiguous, strides {cache.stride()}")
        itemsize = cache.element_size()
        return cls(
            base_ptr=cache.data_ptr(),
            num_layers=cache.shape[0],
            layer_stride=cache.stride(0) * itemsize,
            kv_stride=cache.stride(1) * itemsize,
            block_bytes=cache.stride(2) * itemsize,
            num_blocks=cache.shape[2],
        )

    def to_wire(self) -> dict[str, int]:
        """Plain ints by field name, for a msgspec message."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> KVRegion:
        names = [f.name for f in fields(cls)]
        if sorted(wire) != sorted(names):
            raise ValueError(f"a KVRegion has fields {names}, got {sorted(wire)}")
        bad = {k: v for k, v in wire.items() if not isinstance(v, int) or v < 0}
        if bad:
            raise ValueError(f"KVRegion fields are non-negative ints, got {bad}")
        return cls(**wire)

    @property
    def nbytes(self) -> int:
        """The whole cache: what the receiver registers."""
        return self.num_layers * self.layer_stride


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(src_start, dst_start, count)` runs of pairs consecutive on both sides, in the order
    given: `block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]`."""
    src = np.asarray(src_blocks, dtype=np.int64).reshape(-1)
    dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    if src.shape != dst.shape:
        raise ValueError(f"{src.size} source blocks for {dst.size} destination blocks")
    if src.size == 0:
        return []
    if src.min() < 0 or dst.min() < 0:
        raise ValueError("block ids are non-negative")
    if np.unique(dst).size != dst.size:
        # Two writes into one block would race, and one of them is a bug upstream.
        raise ValueError("a destination block appears twice")
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), counts.tolist(), strict=True))


def write_descriptors(
    src: KVRegion, dst: KVRegion, src_blocks: Sequence[int], dst_blocks: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """(source addresses, destination addresses, lengths) that copy `src_blocks` of `src` into
    `dst_blocks` of `dst`, every layer, K and V: one entry per layer, per K/V, per run, in that
    order (layer-major, so each side is read and written front to back)."""
    if src.num_layers != dst.num_layers or src.block_bytes != dst.block_bytes:
        raise ValueError(
            f"KV regions differ: source {src.num_layers} layers of {src.block_bytes}-byte "
            f"blocks, destination {dst.num_layers} layers of {dst.block_bytes}-byte blocks"
        )
    runs = np.asarray(block_runs(src_blocks, dst_blocks), dtype=np.int64).reshape(-1, 3)
    if runs.size == 0:
        return [], [], []
    for side, region, column in (("source", src, 0), ("destination", dst, 1)):
        last = int((runs[:, column] + runs[:, 2]).max()) - 1
        if last >= region.num_blocks:
            raise ValueError(f"{side} block {last} is past its {region.num_blocks} blocks")
    layers = np.arange(src.num_layers, dtype=np.int64)[:, None, None]  # [L, 1, 1]
    kv = np.arange(2, dtype=np.int64)[None, :, None]  # [1, 2, 1]

    def addresses(region: KVRegion, starts: np.ndarray) -> list[int]:
        at = (
            region.base_ptr
            + layers * region.layer_stride
            + kv * region.kv_stride
            + starts[None, None, :] * region.block_bytes
        )  # [L, 2, runs]
        return at.reshape(-1).tolist()

    lengths = np.broadcast_to(runs[:, 2] * src.block_bytes, (src.num_layers, 2, len(runs)))
    return addresses(src, runs[:, 0]), addresses(dst, runs[:, 1]), lengths.reshape(-1).tolist()


class KVTransferError(RuntimeError):
    """A write to `peer` failed (Mooncake does not say why beyond its log: refused, gone,
    stuck past its timeout, or a destination outside the memory the peer registered)."""

    def __init__(self, peer: str, message: str) -> None:
        super().__init__(f"KV transfer to {peer} failed: {message}")
        self.peer = peer


def _force_tcp() -> bool:
    return os.environ.get("MC_FORCE_TCP", "").strip().lower() in _TRUE


def default_protocol() -> str:
    """`$MOONCAKE_PROTOCOL`, else tcp; `MC_FORCE_TCP=1` (SGLang's and Mooncake's switch) makes
    it tcp whatever else is asked."""
    return "tcp" if _force_tcp() else os.environ.get("MOONCAKE_PROTOCOL") or "tcp"


def _transfer_engine_class() -> Any:
    # Mooncake reads its log level once, when its extension loads; INFO (its default) logs
    # several lines per engine and per connection.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        hint = (
            "KV transfer needs Mooncake's transfer engine: pip install "
            "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (GPU machines)"
        )
        if "libibverbs" in str(e):
            hint += "; its engine links libibverbs even for TCP: apt-get install libibverbs1"
        raise ImportError(f"{hint} ({e})") from e
    return TransferEngine


class KVTransferEngine:
    """One rank's Mooncake engine: registers memory, writes blocks into a peer's.

    `host` is the address peers reach this rank at; the engine listens on a port of its own
    choosing (P2P handshake: no metadata server), and `session_id` is what a peer writes to.
    """

    def __init__(
        self,
        host: str,
        protocol: str | None = None,
        device_name: str = "",
        *,
        max_batch: int = MAX_BATCH,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        # An operator's MC_FORCE_TCP overrides the caller's protocol too.
        self.protocol = "tcp" if _force_tcp() else protocol or default_protocol()
        self.max_batch = max_batch
        self._engine: Any = _transfer_engine_class()()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", self.protocol, device_name)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake's transfer engine did not start on {host} "
                f"(protocol {self.protocol!r}, device {device_name!r}): initialize returned {rc}"
            )
        self._session_id = f"{host}:{self._engine.get_rpc_port()}"
        # data_ptr -> the tensor: registered memory must outlive its registration.
        self._registered: dict[int, torch.Tensor] = {}

    @property
    def session_id(self) -> str:
        return self._session_id

    def _live_engine(self) -> Any:
        if self._engine is None:
            raise RuntimeError(f"the KV transfer engine {self._session_id} is closed")
        return self._engine

    def register(self, tensor: torch.Tensor) -> None:
        """Let peers write into (and this engine read from) `tensor`'s memory; a tensor
        already registered is left as it is."""
        engine = self._live_engine()
        if not tensor.is_contiguous():
            raise ValueError("only contiguous memory can be registered")
        ptr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        if ptr in self._registered:
            return
        rc = engine.register_memory(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake refused to register {nbytes} bytes at {ptr:#x}: {rc}")
        self._registered[ptr] = tensor

    def write(
        self, peer_session: str, srcs: Sequence[int], dsts: Sequence[int], lengths: Sequence[int]
    ) -> None:
        """Copy `lengths[i]` bytes from local `srcs[i]` to the peer's `dsts[i]`, all of them,
        in batches of `max_batch`; returns once everything has landed."""
        engine = self._live_engine()
        if not len(srcs) == len(dsts) == len(lengths):
            raise ValueError(
                f"{len(srcs)} sources, {len(dsts)} destinations, {len(lengths)} lengths"
            )
        num_batches = -(-len(srcs) // self.max_batch)
        for i in range(num_batches):
            part = slice(i * self.max_batch, (i + 1) * self.max_batch)
            batch_lengths = list(lengths[part])
            rc = engine.batch_transfer_sync_write(
                peer_session, list(srcs[part]), list(dsts[part]), batch_lengths
            )
            if rc < 0:
                raise KVTransferError(
                    peer_session,
                    f"batch {i + 1} of {num_batches} ({len(batch_lengths)} transfers, "
                    f"{sum(batch_lengths)} bytes) returned {rc}",
                )

    def write_blocks(
        self,
        peer_session: str,
        src_region: KVRegion,
        dst_region: KVRegion,
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
    ) -> int:
        """Copy blocks `src_blocks` of this rank's cache into `dst_blocks` of the peer's, every
        layer, K and V; the bytes moved."""
        srcs, dsts, lengths = write_descriptors(src_region, dst_region, src_blocks, dst_blocks)
        self.write(peer_session, srcs, dsts, lengths)
        return sum(lengths)

    def close(self) -> None:
        """Unregister everything and drop the engine (its port closes); idempotent."""
        if self._engine is None:
            return
        for ptr in list(self._registered):
            self._engine.unregister_memory(ptr)
            del self._registered[ptr]
        self._engine = None

    def __enter__(self) -> KVTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
