"""KV blocks between two ranks' caches (`rank_worker.kv.kv_transfer`): the descriptor
arithmetic exactly (runs, addresses, refusals; the addresses replayed with memmove against
torch indexing), then Mooncake for real: a receiver process on loopback, this process writing
into it, every byte of the receiver's caches checked, and peers that are not there."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import socket
import sys
import time
import zlib
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import pytest
import torch

from rank_worker.kv.kv_transfer import (
    MAX_BATCH,
    KVRegion,
    KVTransferEngine,
    KVTransferError,
    block_runs,
    default_protocol,
    write_descriptors,
)

SPAWN = mp.get_context("spawn")
HOST = "127.0.0.1"

# name -> (dtype, num_layers, block_size, kv_heads, head_dim, sender's blocks, receiver's
# blocks). "small": bf16, runs and scattered blocks; "many": f32 with tiny blocks, scattered so
# that one write is more than 4096 descriptors (several of `MAX_BATCH`).
CASES = {
    "small": (torch.bfloat16, 3, 16, 2, 32, 64, 96),
    "many": (torch.float32, 12, 4, 2, 4, 256, 384),
}


def make_cache(name: str, side: str, seed: int) -> torch.Tensor:
    """A cache of the project layout `[layers, 2, blocks, block_size, kv_heads, head_dim]`,
    random but reproducible from (name, side, seed) so the receiver can rebuild the sender's."""
    dtype, layers, block_size, heads, head_dim, src_blocks, dst_blocks = CASES[name]
    blocks = src_blocks if side == "src" else dst_blocks
    # crc32, not hash(): str hashes differ between processes.
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {side} {seed}".encode()))
    shape = (layers, 2, blocks, block_size, heads, head_dim)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def block_choice(name: str, seed: int) -> tuple[list[int], list[int]]:
    """Which sender blocks go to which receiver blocks."""
    rng = np.random.default_rng(seed)
    if name == "small":
        # Two runs consecutive on both sides, then ten scattered pairs.
        src = [*range(3, 11), *range(20, 24), *rng.choice(np.arange(30, 64), 10, replace=False)]
        free = np.setdiff1d(np.arange(96), [*range(50, 58), *range(0, 4)])
        dst = [*range(50, 58), *range(0, 4), *rng.choice(free, 10, replace=False)]
    else:
        src = rng.permutation(256)[:200].tolist()
        dst = rng.permutation(384)[:200].tolist()
    return [int(b) for b in src], [int(b) for b in dst]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------ the descriptor arithmetic


def test_block_runs_merge_pairs_consecutive_on_both_sides():
    assert block_runs([4, 5, 6, 9], [0, 1, 2, 3]) == [(4, 0, 3), (9, 3, 1)]
    # Consecutive on one side only: no merge.
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert block_runs([5, 4], [0, 1]) == [(5, 0, 1), (4, 1, 1)]
    assert block_runs(np.arange(100, 164), np.arange(64)) == [(100, 0, 64)]
    assert block_runs([], []) == []
    assert block_runs([7], [3]) == [(7, 3, 1)]


@pytest.mark.parametrize(
    ("src", "dst", "words"),
    [([1, 2], [1], "2 source blocks for 1"), ([1, -2], [0, 1], "non-negative"),
     ([1, 2], [3, 3], "appears twice")],
)  # fmt: skip
def test_block_runs_refuse(src, dst, words):
    with pytest.raises(ValueError, match=words):
        block_runs(src, dst)


def cache(blocks: int, layers: int = 2, dtype: torch.dtype = torch.float32, heads: int = 2):
    return torch.zeros((layers, 2, blocks, 4, heads, 8), dtype=dtype)


def test_region_of_the_project_cache_layout():
    c = cache(10, layers=3, dtype=torch.bfloat16)
    r = KVRegion.of_cache(c)
    block = 4 * 2 * 8 * 2
    assert r == KVRegion(c.data_ptr(), 3, 2 * 10 * block, 10 * block, block, 10)
    assert r.nbytes == c.numel() * 2
    # The layer views the runner holds (`allocate_kv_cache`) start where the region says.
    assert c[2, 1, 7].data_ptr() == r.base_ptr + 2 * r.layer_stride + r.kv_stride + 7 * block
    with pytest.raises(ValueError, match="contiguous"):
        KVRegion.of_cache(c.transpose(3, 4))
    with pytest.raises(ValueError, match="num_layers, 2"):
        KVRegion.of_cache(c[:, 0])


def test_region_on_the_wire():
    r = KVRegion.of_cache(cache(10))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(r.to_wire()))
    assert KVRegion.from_wire(wire) == r
    with pytest.raises(ValueError, match="fields"):
        KVRegion.from_wire({**wire, "extra": 1})
    with pytest.raises(ValueError, match="non-negative ints"):
        KVRegion.from_wire({**wire, "block_bytes": "4"})


def test_descriptors_addresses_exactly():
    src, dst = KVRegion.of_cache(cache(8)), KVRegion.of_cache(cache(12))
    srcs, dsts, lengths = write_descriptors(src, dst, [2, 3, 6], [9, 10, 0])
    b = src.block_bytes
    assert len(srcs) == 2 * 2 * 2  # layers x (K, V) x runs
    runs = ((2, 9, 2), (6, 0, 1))  # (src, dst, count)
    expected = [(layer, kv, *run) for layer in range(2) for kv in range(2) for run in runs]
    for i, (layer, kv, s, d, n) in enumerate(expected):
        assert srcs[i] == src.base_ptr + layer * src.layer_stride + kv * src.kv_stride + s * b
        assert dsts[i] == dst.base_ptr + layer * dst.layer_stride + kv * dst.kv_stride + d * b
        assert lengths[i] == n * b
    assert write_descriptors(src, dst, [], []) == ([], [], [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_descriptors_replayed_copy_exactly_the_blocks(dtype):
    """memmove along the descriptors does what torch indexing says, and nothing else."""
    src_cache = torch.randn((3, 2, 40, 4, 2, 8)).to(dtype)
    dst_cache = torch.randn((3, 2, 70, 4, 2, 8)).to(dtype)
    before = dst_cache.clone()
    src_blocks, dst_blocks = [0, 1, 2, 17, 39, 5, 6], [69, 3, 4, 5, 0, 30, 31]
    for s, d, n in zip(*write_descriptors(KVRegion.of_cache(src_cache),
                                          KVRegion.of_cache(dst_cache), src_blocks, dst_blocks),
                       strict=True):  # fmt: skip
        ctypes.memmove(d, s, n)
    expected = before.clone()
    expected[:, :, dst_blocks] = src_cache[:, :, src_blocks]
    assert torch.equal(as_bytes(dst_cache), as_bytes(expected))


def test_descriptors_refuse_mismatched_or_out_of_range():
    two, three = KVRegion.of_cache(cache(8)), KVRegion.of_cache(cache(8, layers=3))
    with pytest.raises(ValueError, match=r"source 2 layers .* destination 3 layers"):
        write_descriptors(two, three, [0], [0])
    wide = KVRegion.of_cache(cache(8, heads=4))
    with pytest.raises(ValueError, match="256-byte blocks, destination 2 layers of 512-byte"):
        write_descriptors(two, wide, [0], [0])
    with pytest.raises(ValueError, match="destination block 8 is past its 8 blocks"):
        write_descriptors(two, two, [0, 1], [7, 8])
    with pytest.raises(ValueError, match="source block 9 is past"):
        write_descriptors(two, two, [9], [0])


def test_protocol_from_the_environment(monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.delenv("MOONCAKE_PROTOCOL", raising=False)
    assert default_protocol() == "tcp"
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    assert default_protocol() == "rdma"
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    assert default_protocol() == "tcp"


def test_a_missing_wheel_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import raises ImportError
    with pytest.raises(ImportError, match="mooncake-transfer-engine-non-cuda"):
        KVTransferEngine(HOST)


# ------------------------------------------------------------------ Mooncake, two processes


def receiver(conn: Connection, seed: int) -> None:
    """Register one cache per case, publish where they are, wait for the sender's word, then
    check every byte: written blocks equal the sender's, all others as they were."""
    caches = {name: make_cache(name, "dst", seed) for name in CASES}
    originals = {name: c.clone() for name, c in caches.items()}
    with KVTransferEngine(HOST) as engine:
        for c in caches.values():
            engine.register(c)
        conn.send(
            (engine.session_id, {n: KVRegion.of_cache(c).to_wire() for n, c in caches.items()})
        )
        if not conn.poll(60):
            conn.send({"": "no word from the sender in 60 s"})
            return
        written: dict[str, tuple[list[int], list[int]]] = conn.recv()
        problems = {}
        for name, (src_blocks, dst_blocks) in written.items():
            expected = originals[name].clone()
            expected[:, :, dst_blocks] = make_cache(name, "src", seed)[:, :, src_blocks]
            differ = (as_bytes(caches[name]) != as_bytes(expected)).flatten(3).any(-1)
            if differ.any():  # [layers, 2, blocks]: which blocks of which layer are wrong
                problems[name] = sorted({int(b) for b in differ.nonzero()[:, 2]})
        conn.send(problems)


@pytest.mark.slow
def test_blocks_land_in_another_process_exactly():
    seed = 7
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=receiver, args=(child, seed), daemon=True)
    proc.start()
    try:
        assert parent.poll(60), "the receiver did not start"
        peer, wires = parent.recv()
        with KVTransferEngine(HOST) as engine:
            written = {}
            for name in CASES:
                src_cache = make_cache(name, "src", seed)
                engine.register(src_cache)
                src, dst = KVRegion.of_cache(src_cache), KVRegion.from_wire(wires[name])
                src_blocks, dst_blocks = block_choice(name, seed)
                num_descriptors = len(write_descriptors(src, dst, src_blocks, dst_blocks)[0])
                if name == "many":
                    assert num_descriptors > 4096 > 4 * MAX_BATCH
                else:
                    assert len(block_runs(src_blocks, dst_blocks)) == 12  # 2 runs + 10 pairs
                moved = engine.write_blocks(peer, src, dst, src_blocks, dst_blocks)
                assert moved == len(src_blocks) * 2 * src.num_layers * src.block_bytes
                written[name] = (src_blocks, dst_blocks)
            parent.send(written)
            assert parent.poll(60), "the receiver did not report"
            assert parent.recv() == {}
            proc.join(30)
            assert proc.exitcode == 0
            # The peer has gone (its engine closed with its process): the next write fails, fast.
            start = time.monotonic()
            with pytest.raises(KVTransferError, match=peer):
                engine.write_blocks(peer, src, dst, [0], [0])
            assert time.monotonic() - start < 5
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def test_a_write_to_no_peer_fails_fast():
    with socket.socket() as s:  # a port that was free a moment ago and is closed now
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    src_cache = cache(4)
    with KVTransferEngine(HOST) as engine:
        engine.register(src_cache)
        region = KVRegion.of_cache(src_cache)
        start = time.monotonic()
        with pytest.raises(KVTransferError, match=f"{HOST}:{port} failed: batch 1 of 1"):
            engine.write_blocks(f"{HOST}:{port}", region, region, [0, 1], [2, 3])
        # Refused at the handshake: well under a millisecond here.
        assert time.monotonic() - start < 3
        engine.close()
        engine.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            engine.write(f"{HOST}:{port}", [], [], [])
