"""Temporary stand-in (the helper's module replaces it)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch


class KVTransferError(RuntimeError):
    pass


@dataclass(frozen=True)
class KVRegion:
    base_ptr: int
    num_layers: int
    layer_stride: int
    kv_stride: int
    block_bytes: int

    @classmethod
    def of_cache(cls, cache: torch.Tensor) -> KVRegion:
        item = cache.element_size()
        return cls(cache.data_ptr(), cache.shape[0], cache.stride(0) * item, cache.stride(1) * item,
                   cache.stride(2) * item)


def block_runs(src, dst):
    src = np.asarray(src, dtype=np.int64); dst = np.asarray(dst, dtype=np.int64)
    if src.size == 0:
        return []
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate([[0], brk]); ends = np.concatenate([brk, [src.size]])
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends)]


def write_descriptors(src: KVRegion, dst: KVRegion, src_blocks, dst_blocks):
    if src.num_layers != dst.num_layers or src.block_bytes != dst.block_bytes:
        raise ValueError(f"{src} vs {dst}")
    srcs, dsts, lens = [], [], []
    runs = block_runs(src_blocks, dst_blocks)
    for layer in range(src.num_layers):
        for kv in range(2):
            for s, d, n in runs:
                srcs.append(src.base_ptr + layer * src.layer_stride + kv * src.kv_stride + s * src.block_bytes)
                dsts.append(dst.base_ptr + layer * dst.layer_stride + kv * dst.kv_stride + d * dst.block_bytes)
                lens.append(n * src.block_bytes)
    return srcs, dsts, lens


class KVTransferEngine:
    def __init__(self, host: str, protocol: str | None = None, device_name: str = "", max_batch: int = 1000):
        from mooncake.engine import TransferEngine
        self._engine = TransferEngine()
        protocol = protocol or os.environ.get("MOONCAKE_PROTOCOL", "tcp")
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise RuntimeError(f"mooncake initialize returned {rc}")
        self.session_id = f"{host}:{self._engine.get_rpc_port()}"
        self.max_batch = max_batch
        self._held = []

    def register(self, tensor: torch.Tensor) -> None:
        rc = self._engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self._held.append(tensor)

    def write(self, peer, srcs, dsts, lens):
        for i in range(0, len(srcs), self.max_batch):
            rc = self._engine.batch_transfer_sync_write(peer, srcs[i:i+self.max_batch], dsts[i:i+self.max_batch], lens[i:i+self.max_batch])
            if rc < 0:
                raise KVTransferError(f"write to {peer} failed ({rc})")

    def write_blocks(self, peer, src_region, dst_region, src_blocks, dst_blocks) -> int:
        srcs, dsts, lens = write_descriptors(src_region, dst_region, src_blocks, dst_blocks)
        self.write(peer, srcs, dsts, lens)
        return sum(lens)

    def close(self) -> None:
        for t in self._held:
            self._engine.unregister_memory(t.data_ptr())
        self._held = []
