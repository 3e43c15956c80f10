"""CUDA graphs for uniform steps (decodes, q = 1, and speculative verify steps, q = 1 + k): which
(q, size) a batch runs in, how it is padded, when graphs are off, and that a padded batch
computes what the unpadded one does, the target's captured states (EAGLE-3) included.

CPU: the pure functions exactly, and the padded path end to end with `DecodeGraphRunner`
before capture (it then runs the model eagerly on the same static buffers a graph would read),
with the torch and the Triton (interpreted) backends. GPU (`gpu` marker): capture and replay
against eager execution. The engine end to end (n-gram speculation over the padded path) is
`test_cuda_graphs_speculative.py`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rank_worker.attention.selection import get_backend
from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.graph_sizes import capture_sizes, graph_size_for
from rank_worker.inputs.input_prep import prepare_inputs
from rank_worker.runner.cuda_graphs import (
    ENV_VAR,
    DecodeGraphRunner,
    StaticDecodeBuffers,
    disabled_reason,
    graph_runner_for,
    is_decode_only,
    ladders,
    padded_without_capture,
    uniform_query_len,
    verify_query_lens,
)
from rank_worker.runner.model_runner import ModelRunner
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


def test_ladders_per_query_length():
    # At most max_num_seqs sequences and max_num_batched_tokens tokens per step.
    assert ladders((1, 4), 8, 20, 64) == {1: [1, 2, 4, 8], 4: [1, 2, 4, 5]}
    assert ladders((4, 1, 4), 8, 100, 64) == {1: [1, 2, 4, 8], 4: [1, 2, 4, 8]}
    assert ladders((1, 4), 8, 3, 64) == {1: [1, 2, 3]}  # not one sequence of 4 fits
    # A q reaching max_model_len would look like fresh prompts to the backend: never captured.
    assert ladders((1, 8), 4, 100, 8) == {1: [1, 2, 4]}
    with pytest.raises(ValueError, match="query lengths must be >= 1"):
        ladders((0, 1), 8, 20, 64)
    assert verify_query_lens(0) == (1,)
    assert verify_query_lens(3) == (1, 4)


def test_uniform_query_len():
    assert uniform_query_len(np.array([0, 1, 2, 3])) == 1
    assert uniform_query_len(np.array([0, 4, 8])) == 4
    assert uniform_query_len(np.array([0, 4, 5])) is None  # a verify entry beside a decode
    assert uniform_query_len(np.array([0, 0, 0])) is None  # empty entries
    assert uniform_query_len(np.array([0])) is None


# -- plans -----------------------------------------------------------------------------------


def make_plan(
    step_id: int, work: list[tuple[list[int], list[int], int, int]], every_row: bool = False
) -> StepPlan:
    """One step from (all tokens, block ids, tokens already cached, new tokens) per sequence,
    sequence i in row i (its blocks sent again, as a rewrite of the row); every sequence samples
    its last row, or (`every_row`, as a verify step) every row it computes."""
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
        logits_indices=(np.arange(qsl_arr[-1]) if every_row else qsl_arr[1:] - 1).astype(np.int32),
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
    buffers = StaticDecodeBuffers({1: 8}, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    plan = make_plan(0, [([5, 6, 7], [3], 2, 1), (list(range(9)), [8, 2, 6], 8, 1)])
    assert is_decode_only(plan)
    buffers.load(prepare(plan), 1, 4)
    input_ids, positions, meta = buffers.forward_args(1, 4)
    assert input_ids.tolist() == [7, 8, 0, 0]
    assert positions.tolist() == [2, 8, 0, 0]
    # Padding rows store nothing and attend to one key of block 0.
    assert meta.slot_mapping.tolist() == [3 * 4 + 2, 6 * 4 + 0, -1, -1]
    assert meta.seq_lens.tolist() == [3, 9, 1, 1]
    assert meta.block_table[:, :3].tolist() == [[3, 0, 0], [8, 2, 6], [0, 0, 0], [0, 0, 0]]
    assert input_ids.dtype == meta.slot_mapping.dtype == torch.int64
    assert meta.seq_lens.dtype == meta.block_table.dtype == torch.int32
    with pytest.raises(ValueError, match="do not fit"):
        buffers.load(prepare(plan), 1, 1)
    prefill = make_plan(1, [([5, 6, 7], [3], 0, 3)])
    assert not is_decode_only(prefill)
    with pytest.raises(ValueError, match="step 1: not a batch of 1 tokens per sequence"):
        buffers.load(prepare(prefill), 1, 4)


def test_static_buffers_load_and_metadata():
    buffers = StaticDecodeBuffers({1: 8}, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    assert buffers.width == MAX_MODEL_LEN // BLOCK_SIZE
    wide = make_plan(0, [(list(range(13)), [1, 2, 3, 4], 12, 1)] * 3)
    narrow = make_plan(1, [([1, 2], [9], 1, 1)])
    buffers.load(prepare(wide), 1, 4)
    buffers.load(prepare(narrow), 1, 2)
    input_ids, positions, meta = buffers.forward_args(1, 2)
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
        buffers.load(prepare(too_wide), 1, 1)


def test_static_buffers_take_resolved_placeholders():
    # Placeholder ids are resolved before the graph's static input buffer is written.
    buffers = StaticDecodeBuffers({1: 4}, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    plan = make_plan(0, [([5, 6, 7], [3], 2, 1), (list(range(9)), [8, 2, 6], 8, 1)])
    plan = dataclasses.replace(plan, input_ids=np.array([-2, 8], dtype=np.int32))
    last_sampled = torch.tensor([40, 41, 42])
    buffers.load(prepare(plan, last_sampled), 1, 2)
    assert buffers.forward_args(1, 2)[0].tolist() == [41, 8]


def test_static_buffers_pad_verify_steps():
    """q = 3 tokens per sequence over blocks of 2 (q > block_size): sequence i owns tokens
    [3i, 3i + 3); a padding sequence stores nothing and reads 3 keys of block 0, in both table
    columns 3 positions reach, whatever an earlier step left there."""
    bs = 2
    buffers = StaticDecodeBuffers({1: 8, 3: 4}, 16, bs, torch.device("cpu"))
    assert (buffers.max_seqs, buffers.max_tokens) == (8, 12)
    assert buffers.forward_args(3, 4)[2].seq_lens.tolist() == [3] * 4  # capture's padding
    wide = make_plan(0, [
        (list(range(10, 20)), [5, 6, 7, 8, 9], 7, 3),
        (list(range(30, 36)), [11, 12, 13], 3, 3),
        (list(range(40, 44)), [14, 15], 1, 3),
    ])  # fmt: skip
    assert uniform_query_len(wide.query_start_loc) == 3 and not is_decode_only(wide)
    buffers.load(prepare_inputs(wide, BlockTables(8, 8, bs, "cpu")), 3, 4)
    input_ids, positions, meta = buffers.forward_args(3, 4)
    assert input_ids.tolist() == [17, 18, 19, 33, 34, 35, 41, 42, 43, 0, 0, 0]
    assert positions.tolist() == [7, 8, 9, 3, 4, 5, 1, 2, 3, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [17, 18, 19, 25, 26, 27, 29, 30, 31, -1, -1, -1]
    assert meta.seq_lens.tolist() == [10, 6, 4, 3]
    assert meta.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    assert meta.block_table[0].tolist()[:5] == [5, 6, 7, 8, 9]
    assert meta.block_table[1].tolist()[:3] == [11, 12, 13]
    assert meta.block_table[3].tolist()[:2] == [0, 0]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 16)  # bounds
    assert meta.query_start_loc_host.tolist() == [0, 3, 6, 9, 12]
    assert meta.seq_lens_host.tolist() == [16] * 4
    assert meta.num_leading_decodes == 0 and not meta.fresh_prefill
    # One sequence in a batch of 2: row 1 held the second sequence's blocks.
    narrow = make_plan(1, [(list(range(50, 53)), [3, 4], 0, 3)])
    buffers.load(prepare_inputs(narrow, BlockTables(8, 8, bs, "cpu")), 3, 2)
    input_ids, positions, meta = buffers.forward_args(3, 2)
    assert input_ids.tolist() == [50, 51, 52, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [6, 7, 8, -1, -1, -1]
    assert meta.seq_lens.tolist() == [3, 3]
    assert meta.block_table[:, :2].tolist() == [[3, 4], [0, 0]]
    assert meta.query_start_loc.tolist() == [0, 3, 6]
    # The decode buffers' query_start_loc is its own.
    assert buffers.forward_args(1, 2)[2].query_start_loc.tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="3 sequences of 3 tokens do not fit a batch of 2"):
        buffers.load(prepare_inputs(wide, BlockTables(8, 8, bs, "cpu")), 3, 2)
    with pytest.raises(ValueError, match="do not fit a batch of 8"):  # q = 3 holds 4
        buffers.load(prepare_inputs(wide, BlockTables(8, 8, bs, "cpu")), 3, 8)
    with pytest.raises(ValueError, match="not a batch of 1 tokens per sequence"):
        buffers.load(prepare_inputs(wide, BlockTables(8, 8, bs, "cpu")), 1, 4)


def test_can_run_uniform_plans_of_captured_query_lengths():
    runner = DecodeGraphRunner(
        torch.nn.Identity(), [], max_num_seqs=8, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, device=torch.device("cpu"), max_num_batched_tokens=20,
        query_lens=(1, 4),
    )  # fmt: skip
    assert runner.ladders == {1: [1, 2, 4, 8], 4: [1, 2, 4, 5]}
    assert runner.sizes == [1, 2, 4, 8]
    seq = (list(range(20)), [1, 2, 3, 4, 5], 12)

    def plan(*q_lens: int) -> StepPlan:
        return make_plan(0, [(*seq, q) for q in q_lens])

    assert runner.can_run(plan(1, 1, 1))
    assert runner.can_run(plan(4, 4)) and runner.can_run(plan(*[4] * 5))
    assert not runner.can_run(plan(*[4] * 6))  # 24 tokens: past the budget's 5 sequences
    assert not runner.can_run(plan(*[1] * 9))  # past max_num_seqs
    assert not runner.can_run(plan(4, 1))  # a verify entry beside a decode
    assert not runner.can_run(plan(4, 3))  # fewer drafts in one sequence
    assert not runner.can_run(plan(2, 2))  # a q not captured
    with pytest.raises(ValueError, match="no captured graph fits 2 sequences of unequal"):
        runner.run(prepare(plan(4, 1)))


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


def test_padded_knob(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    on_cpu = "the model runs on cpu"
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not padded_without_capture(on_cpu, cpu, config)
    monkeypatch.setenv(ENV_VAR, "padded")
    assert padded_without_capture(on_cpu, cpu, config)
    assert not padded_without_capture(None, cpu, config)  # graphs on (a stand-in): capture
    # A GPU captures, or has a reason of its own.
    assert not padded_without_capture("enforce_eager is set", cuda, config)
    eager = dataclasses.replace(config, enforce_eager=True)
    assert not padded_without_capture(on_cpu, cpu, eager)
    monkeypatch.setenv(ENV_VAR, "captured")
    with pytest.raises(ValueError, match="TP_ENGINE_DECODE_GRAPHS must be 'padded' or unset"):
        padded_without_capture(on_cpu, cpu, config)


def test_runner_config_tells_the_ranks_k():
    from tp_engine.config import EngineConfig
    from tp_engine.executor.rank_config import runner_config_for

    plain = EngineConfig(max_model_len=MAX_MODEL_LEN)
    assert runner_config_for(plain).num_speculative_tokens == 0
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft_model", "model": "/nowhere", "num_speculative_tokens": 3},
    ):
        config = dataclasses.replace(plain, speculative_config=spec)
        assert runner_config_for(config).num_speculative_tokens == 3


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


# Tokens per sequence of the verify steps: 1 + k drafts with k = 4, more than a block (4).
Q = 5


def verify_scenario(vocab: int) -> list[StepPlan]:
    """Prefill five sequences, then verify steps of Q tokens per sequence (every row's logits,
    as verification samples them) for 3 sequences (runs in 4) and 5 (in 8), a step with a
    verify entry beside a decode (eager), a decode of 2 (in 2) and a verify step of 1. No
    sequence owns block 0."""
    rng = np.random.default_rng(1)
    lens = [3, 8, 13, 5, 20]
    toks = [rng.integers(0, vocab, n + 3 * Q).tolist() for n in lens]
    blocks = [
        [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19],
        [20, 21, 22, 23, 24, 25, 26, 27],
    ]  # fmt: skip
    s = list(zip(toks, blocks, strict=True))
    return [
        make_plan(0, [(t, b, 0, n) for (t, b), n in zip(s, lens, strict=True)]),
        make_plan(1, [(t, b, n, Q) for (t, b), n in zip(s[:3], lens, strict=False)], True),
        make_plan(
            2,
            [(t, b, n + Q * (i < 3), Q) for i, ((t, b), n) in enumerate(zip(s, lens, strict=True))],
            True,
        ),
        make_plan(3, [(*s[0], 3 + 2 * Q, Q), (*s[4], 20 + Q, 1)], True),
        make_plan(4, [(*s[1], 8 + 2 * Q, 1), (*s[2], 13 + 2 * Q, 1)]),
        make_plan(5, [(*s[4], 21 + Q, Q)], True),
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


@dataclasses.dataclass
class Run:
    logits: list[torch.Tensor]  # per step, [B', V]
    caches: list[torch.Tensor]  # every layer's K and V cache after the last step
    runner: ModelRunner
    # Per step, the target's kept states as the step left `model.model.captured` (cloned).
    states: list[tuple[torch.Tensor, torch.Tensor]]


def run_steps(
    model_dir: Path,
    backend: str,
    device: str,
    graphs: str,
    dtype: str = "float32",
    placeholders: bool = False,
    *,
    steps: Callable[[int], list[StepPlan]] = scenario,
    k: int = 0,
    keep_layers: tuple[int, ...] = (),
) -> Run:
    """Execute `steps`; `graphs`: "off", "padded" (uncaptured runner: padded but eager) or
    "captured" (the real thing, GPU); `placeholders`: decode tokens as placeholder ids; `k`:
    speculative tokens (graphs for Q = 1 + k tokens per sequence too); `keep_layers`: the
    model keeps those layers' states, as for an EAGLE-3 head."""
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=32, max_num_seqs=8,
        attention_backend=backend, dtype=dtype, enforce_eager=graphs != "captured",
        num_speculative_tokens=k,
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), device)
    runner.model.model.capture_layers = keep_layers  # before capture: graph outputs
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    if graphs == "padded":
        runner.graph_runner = graph_runner_for(
            runner.model, runner.kv_caches, config, runner.device, None
        )
    run = Run([], [c for pair in runner.kv_caches for c in pair], runner, [])
    for plan in steps(runner.vocab_size):
        if placeholders:
            run.logits.append(runner.execute(*with_placeholders(plan, runner.device)))
        else:
            run.logits.append(runner.execute(plan))
        if keep_layers:
            run.states.append(tuple(t.clone() for t in runner.model.model.captured))
    return run


def assert_same_run(got: Run, ref: Run, tol: dict[str, float]) -> None:
    for step, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
        torch.testing.assert_close(a, b, **tol, msg=f"step {step}")
    for step, (a, b) in enumerate(zip(got.states, ref.states, strict=True)):
        for x, y in zip(a, b, strict=True):
            assert x.shape == y.shape, f"step {step}"
            torch.testing.assert_close(x, y, **tol, msg=f"step {step} states")
    for a, b in zip(got.caches, ref.caches, strict=True):
        torch.testing.assert_close(a, b, **tol)
        assert not a[0].any()  # block 0: read by padding rows, written by nobody


@pytest.mark.parametrize(
    ("backend", "device", "placeholders"),
    [("torch", "cpu", False), ("torch", "cpu", True), ("triton", KERNEL_DEVICE, False)],
)
def test_padded_decode_matches_eager(model_dir, backend, device, placeholders):
    # With placeholders the padded path must resolve them before its static input buffer.
    eager = run_steps(model_dir, backend, device, "off")
    padded = run_steps(model_dir, backend, device, "padded", placeholders=placeholders)
    graphs = padded.runner.graph_runner
    assert graphs.num_replays == 0  # nothing captured on CPU
    assert graphs.eager_runs_by_query_len == {1: 3}  # steps 1, 2 and 4; step 3 is mixed
    assert eager.logits[1].shape == padded.logits[1].shape == (3, padded.runner.vocab_size)
    # fp32; a padded batch only changes the matmuls' row count.
    assert_same_run(padded, eager, dict(atol=1e-5, rtol=1e-5))


@pytest.mark.parametrize(("backend", "device"), [("torch", "cpu"), ("triton", KERNEL_DEVICE)])
def test_padded_verify_matches_eager(model_dir, backend, device):
    """Verify steps of Q = 1 + k tokens per sequence, some padded (3 in 4, 5 in 8), beside a
    step that is not uniform (eager) and a decode: every row's logits, and the caches, equal
    the eager runner's; block 0 (the padding's context) is never written."""
    eager = run_steps(model_dir, backend, device, "off", steps=verify_scenario, k=Q - 1)
    padded = run_steps(model_dir, backend, device, "padded", steps=verify_scenario, k=Q - 1)
    graphs = padded.runner.graph_runner
    assert graphs.ladders == {1: [1, 2, 4, 8], Q: [1, 2, 4, 8]}
    assert graphs.num_replays == 0
    assert graphs.eager_runs_by_query_len == {Q: 3, 1: 1}  # steps 1, 2, 5; step 4
    vocab = padded.runner.vocab_size
    assert eager.logits[2].shape == padded.logits[2].shape == (5 * Q, vocab)
    assert_same_run(padded, eager, dict(atol=1e-5, rtol=1e-5))
    # The padding's own rows are finite too: each of their Q queries sees a key (a seq_len
    # below Q would leave rows with none: NaN here, reads before the table on a GPU)...
    one = verify_scenario(vocab)[5]
    graphs.buffers.load(prepare(one), Q, 8)
    assert torch.isfinite(graphs._forward(Q, 8)[0]).all()
    # ...and so are the rows of fresh buffers, which capture runs before any step.
    fresh = graph_runner_for(
        padded.runner.model, padded.runner.kv_caches, padded.runner.config, torch.device(device),
        None,
    )  # fmt: skip
    assert torch.isfinite(fresh._forward(Q, 8)[0]).all()
    assert torch.isfinite(fresh._forward(1, 8)[0]).all()


def test_padded_path_keeps_the_targets_states(model_dir):
    """A model keeping layers' states for an EAGLE-3 head: after every step, padded or not,
    `model.model.captured` holds exactly the step's T rows, equal to the eager forward's."""
    layers = (0, 1, 2)  # the embeddings, the input of layer 1, the last layer's output
    eager = run_steps(
        model_dir, "torch", "cpu", "off", steps=verify_scenario, k=Q - 1, keep_layers=layers
    )
    padded = run_steps(
        model_dir, "torch", "cpu", "padded", steps=verify_scenario, k=Q - 1, keep_layers=layers
    )
    assert padded.runner.graph_runner.captures_states
    assert padded.runner.graph_runner.eager_runs_by_query_len == {Q: 3, 1: 1}
    hidden = padded.runner.hf_config.hidden_size
    embeds, aux = padded.states[1]  # 3 sequences of Q tokens, run in a batch of 4
    assert embeds.shape == (3 * Q, hidden) and aux.shape == (3 * Q, 3 * hidden)
    assert_same_run(padded, eager, dict(atol=1e-5, rtol=1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "placeholders"), [("float32", False), ("bfloat16", False), ("float32", True)]
)
def test_captured_graphs_match_eager_gpu(model_dir, dtype, placeholders):
    eager = run_steps(model_dir, "triton", "cuda", "off", dtype)
    captured = run_steps(model_dir, "triton", "cuda", "captured", dtype, placeholders)
    graphs = captured.runner.graph_runner
    assert sorted(graphs.graphs) == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert graphs.num_replays == 3  # steps 1, 2 and 4; step 3 is mixed
    # fp32: summation order only. bf16: a different row count may pick another GEMM kernel,
    # whose bf16 outputs can differ by an ulp; logits are fp32 but derived from bf16 hidden
    # states of magnitude ~1, so a few 1e-2 at most.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    assert_same_run(captured, eager, tol)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "keep_layers"), [("float32", ()), ("bfloat16", (0, 1, 2))])
def test_captured_verify_graphs_match_eager_gpu(model_dir, dtype, keep_layers):
    """Verify steps replayed from graphs of Q tokens per sequence (the paged prefill kernel's
    path in a graph), with and without the target's states as graph outputs."""
    run = dict(steps=verify_scenario, k=Q - 1, keep_layers=keep_layers)
    eager = run_steps(model_dir, "triton", "cuda", "off", dtype, **run)
    captured = run_steps(model_dir, "triton", "cuda", "captured", dtype, **run)
    graphs = captured.runner.graph_runner
    assert sorted(graphs.graphs) == [(q, s) for q in (1, Q) for s in (1, 2, 4, 8)]
    assert graphs.replays_by_query_len == {Q: 3, 1: 1}
    assert graphs.eager_runs_by_query_len == {}
    assert captured.logits[2].shape == (5 * Q, captured.runner.vocab_size)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == "float32" else dict(atol=5e-2, rtol=5e-2)
    assert_same_run(captured, eager, tol)


@pytest.mark.gpu
def test_torch_backend_on_gpu_runs_eagerly(model_dir):
    run = run_steps(model_dir, "torch", "cuda", "captured")  # graphs allowed, yet off
    assert run.runner.graph_runner is None


@pytest.mark.parametrize(
    ("k", "ladder"), [(0, {1: [1, 2, 4, 8, 10]}), (3, {1: [1, 2, 4, 8, 10], 4: [1, 2]})]
)
def test_runner_captures_only_what_its_config_allows(model_dir, monkeypatch, k, ladder):
    """Start-up cost: graphs for the batch sizes a step can have (up to max_num_seqs, and no
    more sequences than the token budget: 10 tokens hold 10 decodes, 2 verify entries of
    1 + 3), static block tables exactly as wide as max_model_len needs; and the runner reports
    how long each start-up phase took. (CPU: capture itself is stubbed, the sizing is what is
    checked.)"""
    from rank_worker.runner import graph_setup
    from rank_worker.runner.mixed_graphs import MixedGraphRunner

    captured = []
    monkeypatch.setattr(graph_setup, "disabled_reason", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(
        DecodeGraphRunner, "capture", lambda self, pool: captured.append((self.ladders, pool))
    )
    monkeypatch.setattr(
        MixedGraphRunner, "capture", lambda self, pool: captured.append((self.buckets, pool))
    )
    config = RunnerConfig(
        max_model_len=40, block_size=BLOCK_SIZE, num_kv_blocks=24, max_num_seqs=12,
        max_num_batched_tokens=10, attention_backend="triton", num_speculative_tokens=k,
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), KERNEL_DEVICE)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    # The mixed steps' buckets (up to the token budget) first, all into one pool.
    assert captured == [([8, 10], "pool"), (ladder, "pool")]
    assert runner.graph_runner.buffers.width == 40 // BLOCK_SIZE
    assert runner.graph_runner.buffers.block_table.shape == (10, 10)
    assert runner.graph_runner.buffers.input_ids.shape == (10,)  # max(1 * 10, 4 * 2) tokens
    assert set(runner.startup_s) == {"load", "profile", "kv_cache", "kernel_warmup", "capture"}
    assert all(t >= 0 for t in runner.startup_s.values())


def test_padded_knob_builds_the_runner_on_cpu_without_capture(model_dir, monkeypatch):
    """`TP_ENGINE_DECODE_GRAPHS=padded`: on CPU the runner exists (the engine's steps take its
    padded path) and nothing is captured; enforce_eager still means no runner."""
    captured = []
    monkeypatch.setattr(DecodeGraphRunner, "capture", lambda self, pool: captured.append(self))
    monkeypatch.setenv(ENV_VAR, "padded")
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=8, max_num_seqs=4,
        max_num_batched_tokens=32, num_speculative_tokens=2,
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cpu")
    runner.init_kv_cache(8)
    assert runner.graph_runner is not None and captured == []
    assert runner.graph_runner.ladders == {1: [1, 2, 4], 3: [1, 2, 4]}
    assert "capture" not in runner.startup_s
    eager = ModelRunner(model_dir, dataclasses.replace(config, enforce_eager=True),
                        TPInfo(0, 1), "cpu")  # fmt: skip
    eager.init_kv_cache(8)
    assert eager.graph_runner is None
