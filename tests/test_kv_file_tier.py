"""The KV file tier (`kv_offloading_dir`): block files below the host tier that a restarted
engine on the same checkpoint reads again, and nobody with other weights ever reads.

Rank 0's index (`tp_engine.core.kv.file_tier`): keys chained from the checkpoint's namespace,
capacity and LRU order, bad files as misses. End to end: a second engine on the same directory
serves the first one's prefixes from files with the same greedy tokens (transformers' too); other
weights, or a weight update, find nothing; a corrupted or truncated file is a miss; a directory
that cannot be written turns the tier off and the engine keeps serving.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from shm_ipc import kv_files
from shm_ipc.block_copies import FILE_TIER, HOST_TIER
from tests.tp_cases import hf_greedy
from tp_engine.core.kv.blocks import LowerHit, hash_block_tokens, prefix_cache_root
from tp_engine.core.kv.file_tier import FileTier

SHARD = 64  # payload bytes per rank and block in the index tests


def chain(tokens: list[int], bs: int = 4, root: int | None = None) -> list[LowerHit]:
    """`tokens`' full blocks as the device tier describes them (hash, parent hash, tokens)."""
    blocks, parent = [], root
    for i in range(len(tokens) // bs):
        ids = tuple(tokens[i * bs : (i + 1) * bs])
        h = hash_block_tokens(parent, ids)
        blocks.append(LowerHit(h, parent, ids))
        parent = h
    return blocks


def tier(path: Path, namespace: bytes = b"n" * 16, blocks: int = 8, world: int = 1) -> FileTier:
    capacity = blocks * world * (kv_files.HEADER_BYTES + SHARD)
    path.mkdir(exist_ok=True)
    return FileTier(path, capacity, namespace, SHARD, world)


def write_shards(t: FileTier, copies) -> None:
    """What every rank does with a host -> file copy (payload: the key's first byte, repeated)."""
    for c in copies:
        assert (c.src, c.dst) == (HOST_TIER, FILE_TIER)
        for key_values in c.keys:
            key = kv_files.key_bytes(key_values)
            for rank in range(t.world):
                path = kv_files.block_file(t.directory, key, rank, t.world)
                kv_files.write(path, key, np.full(SHARD, key[0], np.uint8))


def test_keys_chain_from_the_namespace_and_only_for_the_base_models_chains(tmp_path) -> None:
    a, b = tier(tmp_path / "a", b"x" * 16), tier(tmp_path / "b", b"x" * 16)
    other = tier(tmp_path / "c", b"y" * 16)
    blocks = chain(list(range(1, 13)))
    keys = [a.key_of(block) for block in blocks]
    assert keys == [b.key_of(block) for block in blocks]  # another process, the same keys
    assert len(set(keys)) == 3 and all(len(k) == 16 for k in keys)
    assert not set(keys) & {other.key_of(block) for block in blocks}  # other weights
    # A chain rooted elsewhere (a weight update's epoch, an adapter, a salt) has no key.
    for root in (prefix_cache_root(1), prefix_cache_root(0, (("adapter", 3),))):
        assert [a.key_of(block) for block in chain(list(range(1, 13)), root=root)] == [None] * 3


@pytest.fixture
def index_dir(tmp_path) -> Path:
    path = tmp_path / "files"
    path.mkdir()
    return path


def test_stored_blocks_are_found_by_a_new_index_and_loaded_by_key(index_dir) -> None:
    first = tier(index_dir, world=2)
    blocks = chain(list(range(1, 17)))
    writes = first.store(blocks, [5, 6, 7, 8])
    assert [c.src_blocks.tolist() for c in writes] == [[5, 6, 7, 8]]
    write_shards(first, writes)
    assert first.match(blocks) == 4
    # A restart: the directory is indexed (unchecked), then checked on the first hit.
    second = tier(index_dir, world=2)
    assert second.num_cached_blocks == 4
    assert second.match(chain(list(range(1, 13)) + [99, 98, 97, 96])) == 3
    (load,) = second.load(blocks[:2], [10, 11])
    assert (load.src, load.dst, load.dst_blocks.tolist()) == (FILE_TIER, "device", [10, 11])
    assert [kv_files.key_bytes(k) for k in load.keys] == [second.key_of(b) for b in blocks[:2]]
    # Another world size reads other files: nothing.
    assert tier(index_dir, world=1).num_cached_blocks == 0


def test_a_truncated_or_corrupted_file_is_a_miss_logged_and_deleted(index_dir, caplog) -> None:
    t = tier(index_dir)
    blocks = chain(list(range(1, 13)))
    write_shards(t, t.store(blocks, [0, 1, 2]))
    paths = [kv_files.block_file(index_dir, t.key_of(b), 0, 1) for b in blocks]
    data = bytearray(paths[1].read_bytes())
    data[-1] ^= 0xFF
    paths[1].write_bytes(bytes(data))  # a flipped payload byte
    restarted = tier(index_dir)
    with caplog.at_level(logging.WARNING):
        assert restarted.match(blocks) == 1  # the chain stops at the bad block
    assert "truncated, corrupted or missing" in caplog.text and not paths[1].exists()
    paths[0].write_bytes(paths[0].read_bytes()[:-7])  # truncated
    assert tier(index_dir).match(blocks) == 0 and not paths[0].exists()


def test_capacity_evicts_the_least_recently_used_files(index_dir) -> None:
    t = tier(index_dir, blocks=3)
    a, b = chain(list(range(1, 9))), chain(list(range(50, 58)))
    write_shards(t, t.store(a, [0, 1]))
    t.unpin()
    t.match(a)
    t.load(a[:1], [0])  # a[0] most recent: order a[1], a[0]
    t.unpin()
    write_shards(t, t.store(b, [2, 3]))  # room for one more: a[1] goes
    assert t.num_cached_blocks == 3 and t.match(a) == 1 and t.match(b) == 2
    assert len(list(index_dir.glob("*.kvb"))) == 3
    assert t.reset() == 3 and not list(index_dir.glob("*.kvb"))


# -- end to end: engines on one directory ------------------------------------------------------


def run(checkpoint: Path, directory: Path, tp: int = 1, **knobs) -> dict:
    """The multi-turn workload of the host-tier test on an engine with a file tier; its prompts,
    answers, and the file tier's hits (blocks)."""
    from tests.test_host_kv_tier_e2e import conversations, engine

    with engine(checkpoint, tp, 0.001, kv_offloading_dir=str(directory), **knobs) as llm:
        files = llm.engine.core.host_tier.lower
        vocab = llm.engine.vocab_size
        prompts, answers = conversations(llm, vocab)
        llm.engine.core.scheduler.block_manager.check_integrity()
        return {
            "prompts": prompts, "answers": answers, "file_tier": files,
            "file_hits": None if files is None else files.hits,
        }  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tests.test_host_kv_tier_e2e import MAX_MODEL_LEN, SHAPE
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("ckpt"), max_position_embeddings=MAX_MODEL_LEN, **SHAPE
    )


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_restarted_engine_reads_the_first_ones_blocks_from_files(checkpoint, tmp_path, tp):
    from tests.test_host_kv_tier_e2e import OUTPUT_TOKENS

    first = run(checkpoint, tmp_path / "kv", tp)
    assert first["file_hits"] == 0 and list((tmp_path / "kv").glob(f"*.r{tp - 1}-of-{tp}.kvb"))
    second = run(checkpoint, tmp_path / "kv", tp)  # a new engine: empty device and host tiers
    assert second["file_hits"] > 0
    assert second["prompts"] == first["prompts"] and second["answers"] == first["answers"]
    assert first["answers"] == hf_greedy(checkpoint, first["prompts"], OUTPUT_TOKENS)


@pytest.mark.slow
def test_other_weights_or_a_weight_update_read_nothing_and_bad_files_are_misses(
    checkpoint, tmp_path, caplog
) -> None:
    from tests.test_host_kv_tier_e2e import MAX_MODEL_LEN, SHAPE, conversations, engine
    from tp_engine.testing import build_random_qwen3

    directory = tmp_path / "kv"
    first = run(checkpoint, directory)
    # Other weights (same shapes, another seed) on the same directory: no file is theirs.
    other = build_random_qwen3(
        tmp_path / "other", max_position_embeddings=MAX_MODEL_LEN, **{**SHAPE, "seed": 2}
    )
    assert run(other, directory)["file_hits"] == 0
    # The same weights pushed again (a weight update; the cache not flushed): nothing that
    # was computed before the update is read, from files or anywhere.
    with engine(checkpoint, 1, 0.001, kv_offloading_dir=str(directory)) as llm:
        llm.update_weights_from_disk(str(checkpoint), flush_cache=False)
        _, answers = conversations(llm, llm.engine.vocab_size)
        assert llm.engine.core.host_tier.lower.hits == 0
    assert answers == first["answers"]
    # Corrupt one block file and truncate another: misses, logged, recomputed exactly.
    files = sorted(directory.glob("*.kvb"))
    assert len(files) >= 2
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0xFF
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="tp_engine.core.kv.file_tier"):
        again = run(checkpoint, directory)
    assert again["answers"] == first["answers"]
    assert "truncated, corrupted or missing" in caplog.text


@pytest.mark.slow
def test_a_directory_that_cannot_be_written_turns_the_tier_off(checkpoint, tmp_path, caplog):
    from tests.test_host_kv_tier_e2e import conversations, engine

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.WARNING):
        off = run(checkpoint, not_a_dir)
    assert off["file_tier"] is None and "KV file tier off" in caplog.text
    # Writes that start failing while the engine runs (the directory gone: as a full disk or
    # a read-only remount would): a warning, misses, and the same tokens.
    directory = tmp_path / "kv"
    caplog.clear()
    with engine(checkpoint, 1, 0.001, kv_offloading_dir=str(directory)) as llm:
        shutil.rmtree(directory)
        with caplog.at_level(logging.WARNING):
            _, answers = conversations(llm, llm.engine.vocab_size)
    assert answers == off["answers"] and "KV file tier writes off" in caplog.text
