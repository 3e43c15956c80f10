"""CUDA graphs for mixed steps (prompt tokens, alone or beside decodes), by token bucket
(`rank_worker.runner.mixed_graphs`): the buckets, the padded layout of the static buffers, which
step takes which path, and that the padded path computes what the eager one does.

CPU: the layout exactly; the padded path end to end with the runner built by
`TP_ENGINE_DECODE_GRAPHS=padded` (uncaptured: the model runs eagerly on the same static buffers
a graph reads), with the torch backend (host lengths read back from the buffers) and the Triton
one interpreted (the capture's host bounds, device lengths: what a GPU captures); planted errors
(a padding slot that writes a real block, a metadata buffer left stale from the step before)
that those checks catch; and the engine against transformers at TP 1 and 2. GPU (`gpu`
marker): capture and replay against eager execution, and the same planted errors.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first `import kernels` (tests/conftest too)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rank_worker.inputs.block_tables import BlockTables
from rank_worker.inputs.graph_sizes import token_buckets
from rank_worker.inputs.input_prep import prepare_inputs
from rank_worker.runner.cuda_graphs import ENV_VAR
from rank_worker.runner.mixed_graphs import MixedGraphRunner, StaticMixedBuffers
from rank_worker.runner.model_runner import ModelRunner
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from shm_ipc.step_plan import StepPlan
from tests.test_cuda_graphs import make_plan
from tests.test_lora_e2e import case  # noqa: F401 (a fixture: the adapters and PEFT's outputs)

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
NUM_KV_BLOCKS = 40
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU = torch.device("cpu")


# -- buckets and layout ----------------------------------------------------------------------


def test_token_buckets():
    assert token_buckets(2) == [2]
    assert token_buckets(40) == [8, 16, 32, 40]
    assert token_buckets(512) == [8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    buckets = token_buckets(8192)
    assert buckets[-3:] == [7680, 7936, 8192] and len(buckets) == 41
    assert token_buckets(1000)[-3:] == [512, 768, 1000]
    with pytest.raises(ValueError, match=">= 2 tokens"):
        token_buckets(1)


def test_config_bounds_the_largest_bucket():
    from tp_engine.config import EngineConfig
    from tp_engine.executor.rank_config import runner_config_for

    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE)
    assert config.resolved_cuda_graph_max_tokens == 512
    small = dataclasses.replace(config, max_num_batched_tokens=100)
    assert small.resolved_cuda_graph_max_tokens == 100  # never past the token budget
    assert dataclasses.replace(config, cuda_graph_max_tokens=0).resolved_cuda_graph_max_tokens == 0
    engine = EngineConfig(max_model_len=MAX_MODEL_LEN, cuda_graph_max_tokens=96)
    assert runner_config_for(engine).cuda_graph_max_tokens == 96
    with pytest.raises(ValueError, match="cuda_graph_max_tokens must be 0"):
        EngineConfig(cuda_graph_max_tokens=1)


def prepare(plan: StepPlan, width: int = 16):
    return prepare_inputs(plan, BlockTables(8, width, BLOCK_SIZE, "cpu"))


def test_static_buffers_pad_a_mixed_step():
    """Two decodes, a prefill and a chunk after a cached prefix (13 tokens) in the bucket of 16:
    tokens 13..15 belong to a padding sequence (row 4) that reads 3 keys of block 0 and stores
    nothing; the rows after it are empty."""
    buffers = StaticMixedBuffers(32, 6, MAX_MODEL_LEN, BLOCK_SIZE, CPU)
    assert (buffers.rows(16), buffers.rows(2), buffers.width) == (7, 3, 16)
    plan = make_plan(0, [
        (list(range(10, 20)), [5, 6, 7], 9, 1),
        (list(range(20, 23)), [8], 2, 1),
        (list(range(30, 35)), [9, 10], 0, 5),
        (list(range(40, 50)), [11, 12, 13], 4, 6),
    ])  # fmt: skip
    buffers.load(prepare(plan), 16)
    input_ids, positions, meta = buffers.forward_args(16)
    assert input_ids.tolist() == [19, 22, 30, 31, 32, 33, 34, *range(44, 50), 0, 0, 0]
    assert positions.tolist() == [9, 2, 0, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 0, 0, 0]
    assert meta.slot_mapping.tolist()[-4:] == [13 * 4 + 1, -1, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 7, 13, 16, 16, 16]
    assert meta.seq_lens.tolist() == [10, 3, 5, 10, 3, 0, 0]
    assert meta.block_table[:5, :3].tolist() == [
        [5, 6, 7], [8, 0, 0], [9, 10, 0], [11, 12, 13], [0, 0, 0],
    ]  # fmt: skip
    # The capture's host fields, the same for every step: bounds, one launch of the prefill
    # kernel over every row (no leading decodes), never the fresh-prompt (TMA) path.
    assert (meta.max_query_len, meta.max_seq_len) == (16, MAX_MODEL_LEN)
    assert meta.query_start_loc_host.tolist() == [0] + [16] * 7
    assert meta.seq_lens_host.tolist() == [MAX_MODEL_LEN] * 7
    assert meta.num_leading_decodes == 0 and not meta.fresh_prefill
    # The torch backend's host fields are read back from the buffers.
    exact = buffers.forward_args(16, host_bounds=False)[2]
    assert exact.query_start_loc_host.tolist() == meta.query_start_loc.tolist()
    assert exact.seq_lens_host.tolist() == meta.seq_lens.tolist()
    # A smaller step in a smaller bucket next: nothing of the first is left where it is read.
    small = make_plan(1, [(list(range(60, 66)), [14, 15], 0, 6)])
    buffers.load(prepare(small), 8)
    input_ids, _, meta = buffers.forward_args(8)
    assert input_ids.tolist() == [60, 61, 62, 63, 64, 65, 0, 0]
    assert meta.slot_mapping.tolist() == [56, 57, 58, 59, 60, 61, -1, -1]
    assert meta.query_start_loc.tolist() == [0, 6, 8, 8, 8, 8, 8, 8]
    assert meta.seq_lens.tolist() == [6, 2, 0, 0, 0, 0, 0]
    assert meta.block_table[0, :2].tolist() == [14, 15] and meta.block_table[1, 0] == 0
    # Capture's empty step: the padding sequence holds every token.
    buffers.load_padding(32)
    _, _, meta = buffers.forward_args(32)
    assert meta.query_start_loc.tolist() == [0] + [32] * 7
    assert meta.seq_lens.tolist() == [32, 0, 0, 0, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [-1] * 32
    assert meta.block_table[0, :8].tolist() == [0] * 8
    with pytest.raises(ValueError, match="13 tokens do not fit the bucket of 8"):
        buffers.load(prepare(plan), 8)


def test_padding_past_max_model_len_has_table_columns():
    # A bucket larger than max_model_len: the padding sequence's context needs more columns
    # than a real sequence's, and the static table has them.
    buffers = StaticMixedBuffers(48, 4, 16, BLOCK_SIZE, CPU)
    assert buffers.width == 12 and buffers.context_bound == 48
    buffers.load(prepare(make_plan(0, [([1, 2, 3], [7], 0, 3)])), 48)
    _, _, meta = buffers.forward_args(48)
    assert meta.seq_lens.tolist()[:2] == [3, 45]
    assert meta.block_table[1].tolist() == [0] * 12


def test_can_run_what_fits_a_bucket():
    runner = MixedGraphRunner(
        torch.nn.Identity(), [], max_tokens=20, max_num_seqs=4, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, device=CPU,
    )  # fmt: skip
    assert runner.buckets == [8, 16, 20]
    seq = (list(range(40)), list(range(1, 11)), 10)

    def plan(*q_lens: int) -> StepPlan:
        return make_plan(0, [(*seq, q) for q in q_lens])

    assert runner.can_run(plan(1, 1, 5)) and runner.bucket_for(7) == 8
    assert runner.can_run(plan(20)) and runner.bucket_for(20) == 20
    assert not runner.can_run(plan(21))  # past the largest bucket: eager
    assert not runner.can_run(plan(5, 5, 5, 5, 1))  # past max_num_seqs
    with pytest.raises(ValueError, match="21 tokens exceed the largest mixed-step bucket"):
        runner.run(prepare(plan(21)))


# -- the padded path computes what the eager path does ---------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=64, max_position_embeddings=MAX_MODEL_LEN, seed=11,
    )  # fmt: skip


# Blocks no sequence of `scenario` owns: block 0 (every padding row's context) and the last five.
UNOWNED = [0, *range(NUM_KV_BLOCKS - 5, NUM_KV_BLOCKS)]


def scenario(vocab: int) -> list[StepPlan]:
    """Mixed steps in every bucket of [8, 16, 32], a prompt larger than the largest (eager), a
    decode batch (the decode graphs) and a prompt after a cached prefix (F shares A's first two
    blocks). Sequences: (all tokens, blocks)."""
    rng = np.random.default_rng(3)
    tok = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    a, b, c = (tok(13), [1, 2, 3, 4]), (tok(9), [5, 6, 7]), (tok(10), [8, 9, 10])
    d, e = (tok(38), list(range(11, 21))), (tok(41), list(range(21, 32)))
    f = (a[0][:8] + tok(6), [1, 2, 32, 33])
    return [
        make_plan(0, [(*a, 0, 9), (*b, 0, 5)]),  # 14 tokens: bucket 16
        make_plan(1, [(*a, 9, 1), (*b, 5, 1), (*c, 0, 7)]),  # 9: 16
        make_plan(2, [(*a, 10, 1), (*b, 6, 1), (*c, 7, 1), (*d, 0, 20)]),  # 23: 32, a chunk
        make_plan(3, [(*a, 11, 1), (*b, 7, 1), (*c, 8, 1), (*d, 20, 17)]),  # 20: 32, its end
        make_plan(4, [(*e, 0, 40)]),  # 40 > 32: eager
        make_plan(5, [(*a, 12, 1), (*b, 8, 1)]),  # uniform: the decode graphs
        make_plan(6, [(*c, 9, 1), (*f, 8, 6), (*e, 40, 1)]),  # 8: a prefix hit in bucket 8
        make_plan(7, [(*d, 37, 1), (*f, 14 - 1, 1)]),  # decodes again
    ]


def run_steps(
    model_dir: Path, backend: str, device: str, graphs: bool, monkeypatch
) -> tuple[list[torch.Tensor], ModelRunner]:
    """`scenario`'s logits per step, eagerly (`graphs` False) or over the graphs' padded path
    (`TP_ENGINE_DECODE_GRAPHS=padded`: the runners built, nothing captured; GPU: captured)."""
    if graphs and device == "cpu":
        monkeypatch.setenv(ENV_VAR, "padded")
    else:
        monkeypatch.delenv(ENV_VAR, raising=False)
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=8, max_num_batched_tokens=48, cuda_graph_max_tokens=32,
        attention_backend=backend, dtype="float32", enforce_eager=not graphs,
        # The graphs' data path is attention's; interpreted layer kernels would only add time.
        layer_kernels="torch" if device == "cpu" else "auto",
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), device)
    runner.init_kv_cache(runner.determine_num_kv_blocks())
    assert (runner.mixed_graphs is not None) == graphs
    logits = [runner.execute(plan) for plan in scenario(runner.vocab_size)]
    return logits, runner


def assert_same(
    got: tuple[list[torch.Tensor], ModelRunner], ref: tuple[list, ModelRunner], tol: float = 1e-5
) -> None:
    """Every step's logits and every cache equal the eager run's (fp32: the padded steps only
    change the matmuls' row counts, and on a GPU the kernels' summation order: the graphs
    attend every row with the prefill kernel, eager steps split decodes off); the blocks
    nobody owns hold nothing."""
    for step, (a, b) in enumerate(zip(got[0], ref[0], strict=True)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"step {step}")
    for pair, ref_pair in zip(got[1].kv_caches, ref[1].kv_caches, strict=True):
        for cache, ref_cache in zip(pair, ref_pair, strict=True):
            assert not cache[UNOWNED].any(), "a padding row wrote a block nobody owns"
            torch.testing.assert_close(cache, ref_cache, atol=tol, rtol=tol)


@pytest.fixture(scope="module")
def eager_runs(model_dir) -> dict[str, tuple[list[torch.Tensor], ModelRunner]]:
    with pytest.MonkeyPatch.context() as mp:
        return {
            backend: run_steps(model_dir, backend, device, False, mp)
            for backend, device in (("torch", "cpu"), ("triton", KERNEL_DEVICE))
        }


@pytest.mark.parametrize(("backend", "device"), [("torch", "cpu"), ("triton", KERNEL_DEVICE)])
def test_padded_mixed_steps_match_eager(model_dir, eager_runs, monkeypatch, backend, device):
    """torch: host lengths read back from the buffers; triton (interpreted on CPU): the
    capture's host bounds, lengths read on the device, one prefill launch per layer."""
    padded = run_steps(model_dir, backend, device, True, monkeypatch)
    mixed, decode = padded[1].mixed_graphs, padded[1].graph_runner
    assert mixed.buckets == [8, 16, 32] and mixed.host_bounds == (backend == "triton")
    runs = mixed.replays_by_bucket if device == "cuda" else mixed.eager_runs_by_bucket
    assert runs == {16: 2, 32: 2, 8: 1}  # steps 0-3 and 6; step 4 (40 tokens) ran eagerly
    assert mixed.padding_tokens == (16 - 14) + (16 - 9) + (32 - 23) + (32 - 20)
    assert sum(decode.eager_runs_by_query_len.values()) + decode.num_replays == 2  # 5, 7
    assert_same(padded, eager_runs[backend])


def plant(monkeypatch, fault: str) -> None:
    """An error in the graphs' data path: a padding token's slot in a real block, or one of
    the metadata buffers left as the step before wrote it."""
    load = StaticMixedBuffers.load

    def faulty(self: StaticMixedBuffers, inputs, bucket: int) -> None:
        kept = {name: getattr(self, name).clone() for name in ("seq_lens", "query_start_loc")}
        load(self, inputs, bucket)
        t = inputs.meta.num_tokens
        if fault == "padding_slot" and t < bucket:
            self.slot_mapping[t] = 5 * BLOCK_SIZE  # B's first token: its block 5, slot 0
        elif fault == "padding_slot_unowned" and t < bucket:
            self.slot_mapping[t] = UNOWNED[-1] * BLOCK_SIZE
        elif fault.startswith("stale_"):
            name = fault.removeprefix("stale_")
            getattr(self, name).copy_(kept[name])

    monkeypatch.setattr(StaticMixedBuffers, "load", faulty)


@pytest.mark.parametrize(
    ("backend", "fault"),
    [
        ("torch", "padding_slot"),
        ("torch", "padding_slot_unowned"),
        ("torch", "stale_seq_lens"),
        ("triton", "stale_query_start_loc"),
    ],
)
def test_planted_errors_are_caught(model_dir, eager_runs, monkeypatch, backend, fault):
    device = "cpu" if backend == "torch" else KERNEL_DEVICE
    plant(monkeypatch, fault)
    padded = run_steps(model_dir, backend, device, True, monkeypatch)
    unowned = "a padding row wrote a block nobody owns"
    with pytest.raises(AssertionError, match=unowned if fault.endswith("unowned") else "step"):
        assert_same(padded, eager_runs[backend])


@pytest.mark.gpu
def test_captured_mixed_graphs_match_eager_gpu(model_dir, eager_runs, monkeypatch):
    """Captured and replayed: one graph per bucket, every mixed step of `scenario` replayed (the
    40-token one eager), the capture's time and device memory kept."""
    captured = run_steps(model_dir, "triton", "cuda", True, monkeypatch)
    runner = captured[1]
    mixed = runner.mixed_graphs
    assert sorted(mixed.graphs) == [8, 16, 32]
    assert mixed.replays_by_bucket == {16: 2, 32: 2, 8: 1} and not mixed.eager_runs_by_bucket
    assert runner.graph_runner.num_replays == 2
    assert runner.graph_memory_bytes > 0 and runner.startup_s["capture"] > 0
    assert_same(captured, eager_runs["triton"], tol=1e-4)


@pytest.mark.gpu
def test_graph_memory_is_counted_in_the_kv_budget_gpu(model_dir):
    """Sized from the device's memory: the KV sizing reserves the graphs' pool (measured on a
    forward of the largest graph's 32 tokens), so that once captured the device's use stays
    within gpu_memory_utilization (less the graphs' own driver memory, which is not reserved)."""
    from rank_worker.kv.device_memory import CudaMemory

    utilization = 0.2
    config = RunnerConfig(
        max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=8,
        max_num_batched_tokens=48, cuda_graph_max_tokens=32, attention_backend="triton",
        gpu_memory_utilization=utilization,
    )  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cuda")
    try:
        runner.init_kv_cache(runner.determine_num_kv_blocks())
        reserved, took = runner.graph_reserve_bytes, runner.graph_memory_bytes
        assert reserved is not None and reserved > 0 and took is not None and took > 0
        reading = CudaMemory(runner.device).read()
        over = reading.total - reading.free - int(reading.total * utilization)
        # Past the budget by the graphs' driver memory at most: a few MiB for this model.
        assert over < (64 << 20), (over, reserved, took)
    finally:
        runner.release()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fault", ["padding_slot", "padding_slot_unowned", "stale_seq_lens", "stale_query_start_loc"]
)
def test_planted_errors_in_captured_graphs_are_caught_gpu(model_dir, eager_runs, monkeypatch,
                                                          fault):  # fmt: skip
    """The replayed graphs read what the buffers hold: each planted error shows."""
    plant(monkeypatch, fault)
    captured = run_steps(model_dir, "triton", "cuda", True, monkeypatch)
    assert captured[1].mixed_graphs.num_replays == 5
    unowned = "a padding row wrote a block nobody owns"
    with pytest.raises(AssertionError, match=unowned if fault.endswith("unowned") else "step"):
        assert_same(captured, eager_runs["triton"], tol=1e-4)


# -- the engine against transformers ---------------------------------------------------------

E2E_MAX_TOKENS = 8
# Prompt lengths: steps of every bucket of [8, 16, 24] (the scheduler packs them up to its
# budget of 32 tokens, so some steps take 25..32 tokens: eager), and one prompt longer than the
# budget (chunked: 32 + 8).
E2E_LENGTHS = (3, 6, 11, 15, 22, 29, 40)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A checkpoint, prompts (E2E_LENGTHS, then prompts sharing a cached prefix with them) and
    transformers' greedy continuations."""
    from tests.tp_cases import CHECKPOINTS, hf_greedy
    from tp_engine.testing import build_random_qwen3

    checkpoint = build_random_qwen3(
        tmp_path_factory.mktemp("ckpt"), max_position_embeddings=MAX_MODEL_LEN,
        **CHECKPOINTS["tied_kv2_oddvocab"],
    )  # fmt: skip
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 643, (n,), generator=g).tolist() for n in E2E_LENGTHS]
    # Prefix hits: the first 4 blocks (16 tokens) of the 22- and 29-token prompts, then more.
    prompts += [p[:16] + torch.randint(0, 643, (n,), generator=g).tolist()
                for p, n in ((prompts[4], 3), (prompts[5], 12))]  # fmt: skip
    return checkpoint, prompts, hf_greedy(checkpoint, prompts, E2E_MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_over_padded_mixed_steps_equals_transformers(e2e, monkeypatch, tp):
    """Greedy through every rank's padded path (at TP 2 the ranks' collectives would not match if
    one of them ran a step in another bucket than the other)."""
    from tp_engine import LLM, SamplingParams

    checkpoint, prompts, expected = e2e
    monkeypatch.setenv(ENV_VAR, "padded")  # the ranks, spawned below, inherit it
    llm = LLM(
        str(checkpoint), tensor_parallel_size=tp, block_size=BLOCK_SIZE, num_kv_blocks=128,
        max_num_seqs=8, max_num_batched_tokens=32, cuda_graph_max_tokens=24,
    )  # fmt: skip
    try:
        mixed = llm.engine.runner.mixed_graphs
        assert mixed is not None and mixed.buckets == [8, 16, 24] and mixed.graphs == {}
        greedy = SamplingParams(temperature=0.0, max_tokens=E2E_MAX_TOKENS, ignore_eos=True)
        n = len(E2E_LENGTHS)
        # All at once (mixed steps of many sizes), one at a time (a prompt alone in its
        # bucket), then the prompts sharing cached prefixes.
        batches = [list(range(n)), *([i] for i in range(n)), [n, n + 1]]
        for batch in batches:
            outs = llm.generate(
                [{"prompt_token_ids": prompts[i]} for i in batch], greedy, use_tqdm=False
            )
            for i, out in zip(batch, outs, strict=True):
                assert out.outputs[0].token_ids == expected[i], f"prompt {i}"
        assert outs[0].num_cached_tokens == outs[1].num_cached_tokens == 16
        assert set(mixed.eager_runs_by_bucket) == {8, 16, 24}, mixed.eager_runs_by_bucket
        assert mixed.padding_tokens > 0
        llm.engine.core.scheduler.block_manager.check_integrity()
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_lora_over_padded_mixed_steps_equals_peft(case, monkeypatch, tp):  # noqa: F811
    """A batch of three adapters and the base model, then each request alone, through the padded
    path (the LoRA kernels read each token's slot from their fixed buffer, -1 past the step; at
    TP 2 each rank's shard of the adapters)."""
    from tests.test_lora_e2e import MIXED, generate, lora, start_llm

    monkeypatch.setenv(ENV_VAR, "padded")  # the ranks, spawned below, inherit it
    llm = start_llm(case, tp, max_loras=3, cuda_graph_max_tokens=24)
    try:
        work = list(enumerate(MIXED))
        expected = [case["reference"][name][i] for i, (name, _) in work]
        prompts = [case["prompts"][i] for i, _ in work]
        outs = generate(llm, prompts, [lora(case, name) for _, (name, _) in work])
        assert [o.outputs[0].token_ids for o in outs] == expected
        for (i, (name, _)), want in zip(work[:4], expected, strict=False):
            [out] = generate(llm, [prompts[i]], [lora(case, name)])
            assert out.outputs[0].token_ids == want, (i, name)
        assert len(llm.engine.runner.mixed_graphs.eager_runs_by_bucket) >= 2
    finally:
        llm.shutdown()


def test_graph_memory_past_the_utilization_budget_warns(model_dir, monkeypatch, caplog):
    """Capture (stubbed on CPU) measured against a stand-in device: the graphs' bytes kept, and
    a warning naming how far past gpu_memory_utilization they pushed the device."""
    from rank_worker.kv.device_memory import MemoryReading
    from rank_worker.runner import graph_setup
    from rank_worker.runner.cuda_graphs import DecodeGraphRunner

    gib = 1 << 30
    free = [10 * gib]  # the stand-in's free bytes: capture takes 3 GiB of them

    class Device:
        def read(self) -> MemoryReading:
            return MemoryReading(total=100 * gib, free=free[0], reserved=0, allocated=0,
                                 peak_allocated=0)  # fmt: skip

        def reset_peak(self) -> None:
            pass

    def capture(self, pool) -> None:
        free[0] -= 3 * gib if isinstance(self, MixedGraphRunner) else 0

    monkeypatch.setattr(graph_setup, "disabled_reason", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(MixedGraphRunner, "capture", capture)
    monkeypatch.setattr(DecodeGraphRunner, "capture", capture)
    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=8,
                          max_num_seqs=4, max_num_batched_tokens=32)  # fmt: skip
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cpu", memory=Device())
    with caplog.at_level("WARNING", logger=graph_setup.__name__):
        runner.init_kv_cache(8)
    assert runner.graph_memory_bytes == 3 * gib
    # 100 GiB at 0.9: 90 GiB may be used; 93 GiB are.
    assert f"{3 * gib} bytes past gpu_memory_utilization=0.9" in caplog.text
    assert graph_setup.over_budget_warning(Device().read(), 0.95, 3 * gib) is None


def test_kv_sizing_reserves_the_graphs_pool(model_dir, monkeypatch):
    """Where graphs will be captured, the sizing takes the graphs' pool off the KV budget: the
    peak of a forward over the largest graph's tokens (32: the mixed bucket bound by the token
    budget), measured after the warm-up on a stand-in device."""
    from rank_worker.kv.cache import KVCacheSpec
    from rank_worker.runner import graph_setup
    from tests.test_memory_profile import OUTSIDE, TOTAL, DeviceStandIn

    probe = 3 << 20
    probes = []

    class ProbedDevice(DeviceStandIn):
        def read(self):
            reading = super().read()
            if self.calls.count("reset_peak") < 2:  # the warm-up's
                return reading
            return dataclasses.replace(reading, peak_allocated=reading.allocated + probe)

    monkeypatch.setattr(graph_setup, "disabled_reason", lambda *args: None)
    pool_bytes = graph_setup.graph_pool_bytes
    monkeypatch.setattr(
        graph_setup,
        "graph_pool_bytes",
        lambda run, memory: probes.append(run) or pool_bytes(run, memory),
    )
    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, max_num_seqs=4,
                          max_num_batched_tokens=32, gpu_memory_utilization=0.5)  # fmt: skip
    assert graph_setup.largest_graph_tokens(config) == 32
    decodes_only = dataclasses.replace(config, cuda_graph_max_tokens=0)
    assert graph_setup.largest_graph_tokens(decodes_only) == 4  # max_num_seqs decodes
    peak = 20 << 20
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cpu", memory=ProbedDevice(peak))
    blocks = runner.determine_num_kv_blocks()
    assert len(probes) == 1  # the probe ran, once
    spec = KVCacheSpec(2, 2, 16, BLOCK_SIZE, torch.float32)
    scratch = math.ceil(32 / BLOCK_SIZE) * spec.bytes_per_block  # the warm-up's
    expected = (int(TOTAL * 0.5) - (peak - scratch) - OUTSIDE - probe) // spec.bytes_per_block
    assert blocks == expected
    # Without graphs, nothing is reserved.
    monkeypatch.setattr(graph_setup, "disabled_reason", lambda *args: "enforce_eager is set")
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cpu", memory=ProbedDevice(peak))
    assert runner.determine_num_kv_blocks() == expected + probe // spec.bytes_per_block
