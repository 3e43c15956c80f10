"""The attention tile tables (`kernels.attention_tables`): validation, lookup, and the runtime
taking a planted table's tile.

A planted table lives in a temporary directory named by $TP_ENGINE_ATTENTION_TABLES (which the
interpreter honours, unlike the committed GPU tables), and what the decode wrapper launches is
read by spying on the `launch_meta` functions whose result it passes to the kernel.
"""

from __future__ import annotations

import json

import pytest
import torch

import kernels.decode_attention as decode
import kernels.decode_attention_packed as packed
from kernels import attention_tables as at
from kernels.attention_tables import Tile
from tests.test_kernels_attention import DECODE_LENS, assert_matches, make_batch, run_decode

COMMITTED = at.TUNED_DIR / at.DECODE_FILE
CPU = torch.device("cpu")


@pytest.fixture
def tables_env(monkeypatch, tmp_path):
    """Plant tables in a fresh directory; `tables()` re-reads the environment."""
    for env in (at.TABLES_ENV, at.DECODE_KERNEL_ENV, at.PREFILL_KERNEL_ENV):
        monkeypatch.delenv(env, raising=False)
    at.reset()

    def plant(decode_table=None, prefill_table=None, **env):
        monkeypatch.setenv(at.TABLES_ENV, str(tmp_path))
        for name, table in ((at.DECODE_FILE, decode_table), (at.PREFILL_FILE, prefill_table)):
            if table is not None:
                text = table if isinstance(table, str) else json.dumps(table)
                (tmp_path / name).write_text(text)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        at.reset()
        return tmp_path

    yield plant
    at.reset()


def decode_table(entries, head_dim=64, capability=None, **extra):
    return {
        "table": "decode_tiles", "version": 1, "capability": capability, "head_dim": head_dim,
        "batch_buckets": [1, 8], "context_buckets": [16, 128], "entries": entries, **extra,
    }  # fmt: skip


def entry(batch, context, kernel, block_n, warps=4, stages=1, kv_dtype="float16"):
    return dict(batch=batch, context=context, kv_dtype=kv_dtype, kernel=kernel, block_n=block_n,
                num_warps=warps, num_stages=stages)  # fmt: skip


def test_committed_table_is_valid_and_holds_the_measured_tiles():
    table = at.load_table(COMMITTED, "decode_tiles")
    assert table is not None and table.capability == (9, 0) and table.head_dim == 128
    # The 2026-11-27 H200 sweep: (128, 4, 3) fastest at 256 sequences, (128, 8, 3) for one long one.
    assert table.entries[(256, 1024, "bfloat16")] == Tile("split", None, 128, 4, 3)
    assert table.entries[(1, 16384, "bfloat16")] == Tile("split", None, 128, 8, 3)


def test_nearest_bucket_in_log2():
    buckets = (1, 8, 64, 256)
    assert [at.nearest_bucket(v, buckets) for v in (0, 1, 2, 3, 5, 9, 100, 181, 1000)] == [
        1, 1, 1, 8, 8, 8, 64, 256, 256,
    ]  # fmt: skip
    assert at.nearest_bucket(4, (2, 8)) == 8  # a tie goes to the larger


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.update(table="prefill_tiles"), "not a decode_tiles table"),
        (lambda t: t.update(version=2), "unknown version 2"),
        (lambda t: t.update(capability="sm90"), "'capability' must be"),
        (lambda t: t.update(batch_buckets=[8, 1]), "'batch_buckets' must be"),
        (lambda t: t["entries"][0].update(batch=4), "'batch' must be one of"),
        (lambda t: t["entries"][0].update(kernel="fast"), "'kernel' must be one of"),
        (lambda t: t["entries"][0].update(block_n=48), "'block_n' must be a power of two"),
        (lambda t: t["entries"][0].update(num_warps=3), "'num_warps' must be one of"),
        (lambda t: t["entries"][0].update(kv_dtype="float32"), "'kv_dtype' must be one of"),
        (lambda t: t["entries"].append(dict(t["entries"][0])), "two entries for"),
    ],
)
def test_malformed_tables_are_refused_naming_file_and_fault(tables_env, mutate, message):
    table = decode_table([entry(8, 128, "split", 32)])
    mutate(table)
    folder = tables_env(table)
    with pytest.raises(ValueError, match=message) as info:
        at.tables()
    assert str(folder / at.DECODE_FILE) in str(info.value)


def test_a_table_that_is_not_json_is_refused_and_stops_the_backend_at_start_up(tables_env):
    from rank_worker.attention.selection import get_backend

    tables_env("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        get_backend("triton")


def test_lookup_falls_back_to_todays_choice(tables_env):
    tables_env(decode_table([entry(8, 128, "packed", 16)]))
    choose = at.decode_tile
    assert choose(6, 100, torch.float16, 64, CPU, True) == Tile("packed", None, 16, 4, 1)
    assert choose(1, 100, torch.float16, 64, CPU, True) == Tile("split")  # no (1, 128) entry
    assert choose(6, 100, torch.bfloat16, 64, CPU, True) == Tile("split")  # other KV dtype
    assert choose(6, 100, torch.float16, 128, CPU, True) == Tile("split")  # other head_dim
    assert choose(6, 100, torch.float32, 64, CPU, True) == Tile("split")  # fp32: never tuned


def test_committed_table_is_not_read_under_the_interpreter(tables_env, monkeypatch):
    at.reset()  # no $TP_ENGINE_ATTENTION_TABLES: kernels/tuned/
    assert at.tables().decode is not None
    assert at.decode_tile(256, 1024, torch.bfloat16, 128, CPU, True) == Tile("split")


def test_forced_kernels(tables_env):
    tables_env(decode_table([entry(8, 128, "packed", 16)]), **{at.DECODE_KERNEL_ENV: "split"})
    assert at.decode_tile(6, 100, torch.float16, 64, CPU, True) == Tile("split")
    tables_env(**{at.DECODE_KERNEL_ENV: "packed"})
    assert at.decode_tile(6, 100, torch.float16, 64, CPU, True) == Tile("packed", None, 16, 4, 1)
    assert at.decode_tile(1, 16, torch.float16, 64, CPU, True) == Tile("packed")
    tables_env(**{at.DECODE_KERNEL_ENV: "fastest"})
    with pytest.raises(ValueError, match="TP_ENGINE_DECODE_KERNEL"):
        at.tables()


def _spy(monkeypatch, module, calls):
    real = module.launch_meta

    def spy(*args, **kwargs):
        meta = real(*args, **kwargs)
        calls.append((module.__name__.rsplit(".", 1)[-1], meta["BLOCK_N"], meta["num_warps"]))
        return meta

    monkeypatch.setattr(module, "launch_meta", spy)


def test_the_decode_kernel_launches_the_planted_tile(tables_env, monkeypatch):
    """Two sequences of up to 100 tokens fall in bucket (1, 128), five in (8, 128): each gets
    its planted kernel and tile, and the outputs stay the reference's."""
    tables_env(decode_table([entry(1, 128, "split", 32, warps=2), entry(8, 128, "packed", 64)]))
    calls: list = []
    _spy(monkeypatch, decode, calls)
    _spy(monkeypatch, packed, calls)
    for lens in (DECODE_LENS[3:], DECODE_LENS):  # 2 and 5 sequences, pages of 16
        b = make_batch(lens, 2, 4, 64, 16, torch.float16, seed=21)
        ref = run_decode(b, None, decode.paged_decode_attention_ref)
        assert_matches(run_decode(b, None), ref, torch.float16)
    # packed: 64 (key, head) rows over the 2 KV heads one program takes = 32 keys per tile.
    assert calls == [("decode_attention", 32, 2), ("decode_attention_packed", 32, 4)]


def prefill_entry(length, kernel, block_m=32, block_n=16, ws=False):
    return dict(length=length, dtype="float16", kernel=kernel, block_m=block_m, block_n=block_n,
                num_warps=4, num_stages=1, warp_specialize=ws)  # fmt: skip


def test_planted_prefill_table(tables_env):
    table = {"table": "prefill_tiles", "version": 1, "capability": None, "head_dim": 16,
             "length_buckets": [16, 64], "entries": [prefill_entry(64, "tma", ws=True),
                                                     prefill_entry(16, "paged")]}  # fmt: skip
    tables_env(prefill_table=table)
    assert at.prefill_tile(40, torch.float16, 16, CPU, True) == Tile("tma", 32, 16, 4, 1, True)
    assert at.prefill_tile(9, torch.float16, 16, CPU, True).kernel == "paged"
    assert at.prefill_tile(40, torch.bfloat16, 16, CPU, True) == Tile("paged")  # no entry
    del table["entries"][0]["block_m"]
    tables_env(prefill_table=table)
    with pytest.raises(ValueError, match="'block_m' must be a positive integer"):
        at.tables()


def test_the_decode_sweeps_dry_run_writes_a_table_the_runtime_takes(
    tables_env, monkeypatch, tmp_path
):
    """benchmarks/gpu/decode_tiles.py --dry-run: every shape x KV dtype x candidate runs under
    the interpreter, and the table it writes is read back and followed."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    out, folder = tmp_path / "out", tmp_path / "tables"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks/gpu/decode_tiles.py"), "--dry-run",
           "--out", str(out), "--table", str(folder / at.DECODE_FILE)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "decode_tiles.json").read_text())["rows"]
    assert len(rows) == 2 * 2 * 2 * 2 and not [r for r in rows if "error" in r]
    table = json.loads((folder / at.DECODE_FILE).read_text())
    assert table["capability"] == [0, 0] and len(table["entries"]) == 8  # no GPU matches it
    monkeypatch.setenv(at.TABLES_ENV, str(folder))
    at.reset()
    for e in table["entries"]:
        tile = at.decode_tile(e["batch"], e["context"], at_dtype(e["kv_dtype"]), 32, CPU, True)
        assert tile == Tile(e["kernel"], None, e["block_n"], e["num_warps"], e["num_stages"])


def at_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[name]


def test_the_prefill_sweep_picks_the_fastest_agreeing_kernel_per_length():
    from benchmarks.gpu.prefill_table import build_table

    def tma(ms, tile, err=1e-3):
        return {"ms": ms, "tile": tile, "rel_err_vs_paged": err}

    records = [
        # 1k: the fastest TMA tile disagrees with the paged kernel (a wrong result): not taken.
        {"seq_len": 1024, "ours": {"ms": 2.0},
         "tma": [tma(1.5, [128, 64, 8, 3, False]), tma(1.0, [128, 128, 8, 2, True], err=0.5)]},
        # 4k over two batch sizes: the totals decide (paged 1 + 4 < TMA 1.2 + 4.1).
        {"seq_len": 4096, "ours": {"ms": 1.0}, "tma": [tma(1.2, [64, 64, 4, 3, False])]},
        {"seq_len": 4096, "ours": {"ms": 4.0}, "tma": [tma(4.1, [64, 64, 4, 3, False])]},
        {"seq_len": 16384, "ours": {"error": "OOM"}, "tma": []},  # no figure: no entry
    ]  # fmt: skip
    table = build_table(records, torch.bfloat16, 128, [9, 0], "H200")
    parsed = at.parse_table(table, "t", "prefill_tiles")
    assert parsed.buckets == ((1024, 4096),)
    assert parsed.entries[(1024, "bfloat16")] == Tile("tma", 128, 64, 8, 3, False)
    assert parsed.entries[(4096, "bfloat16")].kernel == "paged"
