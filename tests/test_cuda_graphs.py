"""Decode CUDA graphs: which size a batch runs in, how it is padded, when graphs are off, and
that a padded batch computes what the unpadded one does.

CPU: the pure functions exactly, and the padded path end to end with `DecodeGraphRunner`
before capture (it then runs the model eagerly on the same static buffers a graph would read),
with the torch and the Triton (interpreted) backends. GPU (`gpu` marker): capture and replay
against eager execution.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rank_worker.attention.selection import get_backend
from rank_worker.block_tables import BlockTables
from rank_worker.cuda_graphs import (
    DecodeGraphRunner,
    StaticDecodeBuffers,
    capture_sizes,
    disabled_reason,
    graph_size_for,
    is_decode_only,
)
from rank_worker.input_prep import prepare_inputs
from rank_worker.model_runner import ModelRunner
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from shm_ipc.step_plan import Command, StepPlan

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
# Where Triton runs in this session: interpreted on CPU, natively where there is a GPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- sizes -----------------------------------------------------------------------------------


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-2:] == [248, 256] and len(sizes) == 35
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_graph_size_for_picks_the_smallest_that_fits():
    sizes = capture_sizes(20)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 9: 16, 16: 16, 17: 20, 20: 20, 21: None}
    assert {b: graph_size_for(b, sizes) for b in expected} == expected


# -- plans -----------------------------------------------------------------------------------


def make_plan(step_id: int, work: list[tuple[list[int], list[int], int, int]]) -> StepPlan:
    """One step from (all tokens, block ids, tokens already cached, new tokens) per sequence,
    sequence i in row i (its blocks sent again, as a rewrite of the row); every sequence samples
    its last row."""
    ids, qsl, lens = [], [0], []
    for tokens, _, done, n in work:
        ids.append(np.asarray(tokens)[done : done + n])
        qsl.append(qsl[-1] + n)
        lens.append(done + n)
    qsl_arr = np.array(qsl, dtype=np.int32)
    blocks = [b for _, b, _, _ in work]
    plan = StepPlan(
        step_id=step_id,
        command=Command.RUN,
        input_ids=np.concatenate(ids).astype(np.int32),
        query_start_loc=qsl_arr,
        seq_lens=np.array(lens, dtype=np.int32),
        rows=np.arange(len(work), dtype=np.int32),
        logits_indices=(qsl_arr[1:] - 1).astype(np.int32),
        edit_rows=np.arange(len(work), dtype=np.int32),
        edit_starts=np.zeros(len(work), dtype=np.int32),
        edit_offsets=np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int32),
        edit_blocks=np.array([x for b in blocks for x in b], dtype=np.int32),
    )
    plan.validate()
    return plan


def prepare(plan: StepPlan, last_sampled: torch.Tensor | None = None, width: int = 32):
    """The plan's inputs on the CPU, over fresh tables `width` blocks wide."""
    return prepare_inputs(plan, BlockTables(8, width, BLOCK_SIZE, "cpu"), last_sampled=last_sampled)


def test_static_buffers_load_pads_on_the_device():
    # The graph's inputs come from the step's prepared device tensors (one H2D copy per step),
    # copied device-to-device; padding rows are filled in place.
    buffers = StaticDecodeBuffers(8, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    plan = make_plan(0, [([5, 6, 7], [3], 2, 1), (list(range(9)), [8, 2, 6], 8, 1)])
    assert is_decode_only(plan)
    buffers.load(prepare(plan), 4)
    input_ids, positions, meta = buffers.forward_args(4)
    assert input_ids.tolist() == [7, 8, 0, 0]
    assert positions.tolist() == [2, 8, 0, 0]
    # Padding rows store nothing and attend to one key of block 0.
    assert meta.slot_mapping.tolist() == [3 * 4 + 2, 6 * 4 + 0, -1, -1]
    assert meta.seq_lens.tolist() == [3, 9, 1, 1]
    assert meta.block_table[:, :3].tolist() == [[3, 0, 0], [8, 2, 6], [0, 0, 0], [0, 0, 0]]
    assert input_ids.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.seq_lens.dtype == meta.block_table.dtype == torch.int32
    with pytest.raises(ValueError, match="do not fit"):
        buffers.load(prepare(plan), 1)
    prefill = make_plan(1, [([5, 6, 7], [3], 0, 3)])
    assert not is_decode_only(prefill)
    with pytest.raises(ValueError, match="step 1: not a decode-only batch"):
        buffers.load(prepare(prefill), 4)


def test_static_buffers_load_and_metadata():
    buffers = StaticDecodeBuffers(8, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    assert buffers.width == MAX_MODEL_LEN // BLOCK_SIZE
    wide = make_plan(0, [(list(range(13)), [1, 2, 3, 4], 12, 1)] * 3)
    narrow = make_plan(1, [([1, 2], [9], 1, 1)])
    buffers.load(prepare(wide), 4)
    buffers.load(prepare(narrow), 2)
    input_ids, positions, meta = buffers.forward_args(2)
    assert input_ids.tolist() == [2, 0] and positions.tolist() == [1, 0]
    assert meta.slot_mapping.tolist() == [9 * 4 + 1, -1]
    assert meta.seq_lens.tolist() == [2, 1]
    # Columns past the narrow plan's width keep the wide plan's (valid, never read) blocks.
    assert meta.block_table[:, :5].tolist() == [[9, 2, 3, 4, 0], [0, 2, 3, 4, 0]]
    assert meta.query_start_loc.tolist() == [0, 1, 2]
    assert (meta.max_query_len, meta.max_seq_len) == (1, MAX_MODEL_LEN)
    assert meta.seq_lens_host.tolist() == [MAX_MODEL_LEN] * 2  # bounds, not values
    too_wide = make_plan(2, [([0] * 80, list(range(20)), 79, 1)])
    with pytest.raises(ValueError, match="exceeds the static width"):
        buffers.load(prepare(too_wide), 1)


def test_static_buffers_take_resolved_placeholders():
    # Placeholder ids are resolved before the graph's static input buffer is written.
    buffers = StaticDecodeBuffers(4, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    plan = make_plan(0, [([5, 6, 7], [3], 2, 1), (list(range(9)), [8, 2, 6], 8, 1)])
    plan = dataclasses.replace(plan, input_ids=np.array([-2, 8], dtype=np.int32))
    last_sampled = torch.tensor([40, 41, 42])
    buffers.load(prepare(plan, last_sampled), 2)
    assert buffers.forward_args(2)[0].tolist() == [41, 8]


# -- when graphs are off ---------------------------------------------------------------------


def test_disabled_reasons(monkeypatch):
    cuda, triton, single = torch.device("cuda"), get_backend("triton"), TPInfo(0, 1)
    assert disabled_reason(cuda, False, triton, single) is None
    assert "runs on cpu" in disabled_reason(torch.device("cpu"), False, triton, single)
    assert "enforce_eager" in disabled_reason(cuda, True, triton, single)
    assert "'torch' attention backend" in disabled_reason(cuda, False, get_backend("torch"), single)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda: "gloo")
    assert "gloo" in disabled_reason(cuda, False, triton, TPInfo(0, 2))
    assert disabled_reason(cuda, False, triton, single) is None  # one rank: no collectives
    monkeypatch.setattr(dist, "get_backend", lambda: "nccl")
    assert disabled_reason(cuda, False, triton, TPInfo(1, 2)) is None


def test_the_local_gpu_even_under_gloo(monkeypatch):
    from rank_worker.tp import init_process_group, local_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert local_device(3) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_device(3) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_device(3) == torch.device("cpu")
    # torchrun's variables decide it; a group of one creates nothing.
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    tp = init_process_group("gloo", rank=0, world_size=1)
    assert (tp.local_rank, tp.local_size, tp.device) == (0, 1, torch.device("cpu"))


def test_ranks_sharing_a_gpu_split_its_kv_memory(monkeypatch):
    def on_gpu(rank: int, size: int, local_size: int | None = None) -> TPInfo:
        local_size = size if local_size is None else local_size
        return TPInfo(rank, size, rank % local_size, local_size, torch.device("cuda", 0))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert on_gpu(2, 4).ranks_on_device == 4
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert on_gpu(1, 4).ranks_on_device == 2  # ranks 1 and 3 on GPU 1
    assert on_gpu(1, 2).ranks_on_device == 1  # NCCL: one each
    assert on_gpu(0, 12, local_size=6).ranks_on_device == 3  # torchrun: this node's ranks
    assert TPInfo(0, 4, 0, 4).ranks_on_device == 1  # CPU ranks each have their share


# -- the padded path computes what the eager path does ---------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("g"), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=64, max_position_embeddings=MAX_MODEL_LEN, seed=7,
    )  # fmt: skip


def scenario(vocab: int) -> list[StepPlan]:
    """Prefill five sequences, then decode batches of 3 (runs in 4), 5 (in 8), a mixed step
    (eager) and 1. No sequence owns block 0, the block every padding row reads, so a stray
    write by a padding row would show in the caches."""
    rng = np.random.default_rng(0)
    lens = [3, 8, 13, 5, 20]
    toks = [rng.integers(0, vocab, n + 4).tolist() for n in lens]
    blocks = [[1, 2], [3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19, 20]]
    seqs = list(zip(toks, blocks, strict=True))
    return [
        make_plan(0, [(t, b, 0, n) for (t, b), n in zip(seqs, lens, strict=True)]),
        make_plan(1, [(t, b, n, 1) for (t, b), n in zip(seqs[:3], lens, strict=False)]),
        make_plan(
            2,
            [(t, b, n + (i < 3), 1) for i, ((t, b), n) in enumerate(zip(seqs, lens, strict=True))],
        ),
        make_plan(3, [(*seqs[0], 5, 2), (*seqs[4], 21, 1)]),
        make_plan(4, [(*seqs[4], 22, 1)]),
    ]


def with_placeholders(plan: StepPlan, device: torch.device) -> tuple[StepPlan, torch.Tensor]:
    """The plan as asynchronous scheduling sends it: each decode token is a placeholder for a
    row of the previous step's samples (`last_sampled`, returned: rows reversed, one spare)."""
    decodes = np.flatnonzero(np.diff(plan.query_start_loc) == 1)
    tokens = plan.query_start_loc[decodes]
    rows = np.arange(decodes.size)[::-1]
    last_sampled = torch.full((decodes.size + 1,), 3, dtype=torch.int64)
    last_sampled[torch.from_numpy(rows.copy())] = torch.from_numpy(
        plan.input_ids[tokens].astype(np.int64)
    )
    ids = plan.input_ids.copy()
    ids[tokens] = -rows - 1
    return dataclasses.replace(plan, input_ids=ids), last_sampled.to(device)


def run_steps(
    model_dir: Path,
    backend: str,
    device: str,
    graphs: str,
    dtype: str = "float32",
    placeholders: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], ModelRunner]:
    """Execute the scenario; `graphs`: "off", "padded" (uncaptured runner: padded but eager)
    or "captured" (the real thing, GPU); `placeholders`: decode tokens as placeholder ids."""
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=24, max_num_seqs=8,
        attention_backend=backend, dtype=dtype, enforce_eager=graphs != "captured",
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), device)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    if graphs == "padded":
        runner.graph_runner = DecodeGraphRunner(
            runner.model, runner.kv_caches, max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK_SIZE, device=runner.device,
        )  # fmt: skip
    logits = []
    for plan in scenario(runner.vocab_size):
        if placeholders:
            logits.append(runner.execute(*with_placeholders(plan, runner.device)))
        else:
            logits.append(runner.execute(plan))
    caches = [c for pair in runner.kv_caches for c in pair]
    return logits, caches, runner


@pytest.mark.parametrize(
    ("backend", "device", "placeholders"),
    [("torch", "cpu", False), ("torch", "cpu", True), ("triton", KERNEL_DEVICE, False)],
)
def test_padded_decode_matches_eager(model_dir, backend, device, placeholders):
    # With placeholders the padded path must resolve them before its static input buffer.
    eager, eager_caches, _ = run_steps(model_dir, backend, device, "off")
    padded, padded_caches, runner = run_steps(
        model_dir, backend, device, "padded", placeholders=placeholders
    )
    assert runner.graph_runner.num_replays == 0  # nothing captured on CPU
    assert eager[1].shape == padded[1].shape == (3, runner.vocab_size)
    for step, (got, ref) in enumerate(zip(padded, eager, strict=True)):
        # fp32; a padded batch only changes the matmuls' row count.
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    for got, ref in zip(padded_caches, eager_caches, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
        assert not got[0].any()  # block 0: read by padding rows, written by nobody


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "placeholders"), [("float32", False), ("bfloat16", False), ("float32", True)]
)
def test_captured_graphs_match_eager_gpu(model_dir, dtype, placeholders):
    eager, eager_caches, _ = run_steps(model_dir, "triton", "cuda", "off", dtype)
    captured, captured_caches, runner = run_steps(
        model_dir, "triton", "cuda", "captured", dtype, placeholders
    )
    assert sorted(runner.graph_runner.graphs) == [1, 2, 4, 8]
    assert runner.graph_runner.num_replays == 3  # steps 1, 2 and 4; step 3 is mixed
    # fp32: summation order only. bf16: a different row count may pick another GEMM kernel,
    # whose bf16 outputs can differ by an ulp; logits are fp32 but derived from bf16 hidden
    # states of magnitude ~1, so a few 1e-2 at most.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    for step, (got, ref) in enumerate(zip(captured, eager, strict=True)):
        torch.testing.assert_close(got, ref, **tol, msg=f"step {step}")
    for got, ref in zip(captured_caches, eager_caches, strict=True):
        torch.testing.assert_close(got, ref, **tol)
        assert not got[0].any()


@pytest.mark.gpu
def test_torch_backend_on_gpu_runs_eagerly(model_dir):
    _, _, runner = run_steps(model_dir, "torch", "cuda", "captured")  # graphs allowed, yet off
    assert runner.graph_runner is None


def test_runner_captures_only_what_its_config_allows(model_dir, monkeypatch):
    """Start-up cost: graphs for the batch sizes a step can have (up to max_num_seqs, and no
    more sequences than the token budget), static block tables exactly as wide as max_model_len
    needs; and the runner reports how long each start-up phase took. (CPU: capture itself is
    stubbed, the sizing is what is checked.)"""
    from rank_worker import model_runner

    captured = []
    monkeypatch.setattr(model_runner, "disabled_reason", lambda *args: None)
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self: captured.append(self.sizes))
    config = RunnerConfig(
        max_model_len=40, block_size=BLOCK_SIZE, num_kv_blocks=24, max_num_seqs=12,
        max_num_batched_tokens=10, attention_backend="triton",
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), KERNEL_DEVICE)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    assert captured == [[1, 2, 4, 8, 10]]  # min(max_num_seqs, max_num_batched_tokens) = 10
    assert runner.graph_runner.buffers.width == 40 // BLOCK_SIZE
    assert runner.graph_runner.buffers.block_table.shape == (10, 10)
    assert set(runner.startup_s) == {"load", "profile", "kv_cache", "kernel_warmup", "capture"}
    assert all(t >= 0 for t in runner.startup_s.values())
