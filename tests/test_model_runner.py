"""ModelRunner's life cycle on CPU (the logits themselves are checked in test_model_tp.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from rank_worker.runner.model_runner import ModelRunner
from rank_worker.runner_config import RunnerConfig
from rank_worker.tp import TPInfo
from shm_ipc.step_plan import Command, StepPlan
from tests.tp_cases import BLOCK_SIZE, MAX_MODEL_LEN, make_scenario
from tp_engine.core.sampling.profiling import profile_sampling
from tp_engine.testing import build_random_qwen3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_qwen3(
        tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip


def test_cpu_defaults_and_sizing(model_dir: Path) -> None:
    config = RunnerConfig(max_model_len=128, kv_cache_memory_bytes=1 << 20, block_size=16)
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cpu")
    assert runner.dtype == torch.float32  # "auto" on CPU
    # K and V * 2 layers * 16 tokens * 2 KV heads (all of them at TP=1) * 8 dims * 4 bytes
    assert runner.kv_spec.bytes_per_block == 2 * 2 * 16 * 2 * 8 * 4
    assert runner.determine_num_kv_blocks() == (1 << 20) // runner.kv_spec.bytes_per_block
    with pytest.raises(RuntimeError, match="init_kv_cache"):
        runner.execute(dataclasses.replace(StepPlan.exit(0), command=Command.RUN))


def test_exit_plan_is_refused(model_dir: Path) -> None:
    runner = ModelRunner(
        model_dir, RunnerConfig(max_model_len=128, block_size=16), TPInfo(0, 1), "cpu"
    )
    runner.init_kv_cache(4)
    with pytest.raises(ValueError, match="RUN"):
        runner.execute(StepPlan.exit(3))


def test_warmup_step_runs(model_dir: Path) -> None:
    # The GPU sizing path runs this step before measuring memory; on CPU we can at least check
    # that the largest step is a valid plan the model runs.
    config = RunnerConfig(
        max_model_len=40, max_num_seqs=5, max_num_batched_tokens=100, block_size=8
    )
    runner = ModelRunner(model_dir, config, TPInfo(0, 1), "cpu")
    plan, num_blocks, _ = runner._warmup_plan()
    plan.validate()
    assert plan.num_tokens == 100 and plan.num_seqs == 5
    assert int(plan.seq_lens.max()) <= 40 and num_blocks == 5
    assert runner._warmup(profile_sampling) == num_blocks * runner.kv_spec.bytes_per_block


def decode_placeholders(plan: StepPlan, rng: np.random.Generator) -> tuple[StepPlan, torch.Tensor]:
    """The plan as asynchronous scheduling sends it: every decode token (a sequence with one
    new token) is a placeholder for a row of the previous step's samples, which `last_sampled`
    (returned, with rows in shuffled order and spare rows) holds."""
    decodes = np.flatnonzero(np.diff(plan.query_start_loc) == 1)
    tokens = plan.query_start_loc[decodes]
    num_rows = decodes.size + 2
    rows = rng.permutation(num_rows)[: decodes.size]
    last_sampled = torch.from_numpy(rng.integers(0, 100, num_rows))
    last_sampled[torch.from_numpy(rows)] = torch.from_numpy(plan.input_ids[tokens].astype(np.int64))
    ids = plan.input_ids.copy()
    ids[tokens] = -rows - 1
    return dataclasses.replace(plan, input_ids=ids), last_sampled


def test_placeholder_ids_give_the_same_logits(model_dir: Path) -> None:
    config = RunnerConfig(max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, num_kv_blocks=48)
    runners = [ModelRunner(model_dir, config, TPInfo(0, 1), "cpu") for _ in range(2)]
    for runner in runners:
        runner.init_kv_cache(runner.determine_num_kv_blocks())
    real, held = runners
    rng = np.random.default_rng(0)
    # Steps 3 and 4 are decodes only, step 2 mixes a decode with prefills.
    for plan in make_scenario(real.vocab_size).plans:
        placeholder_plan, last_sampled = decode_placeholders(plan, rng)
        want = real.execute(plan)
        got = held.execute(placeholder_plan, last_sampled)
        assert torch.equal(got, want), f"step {plan.step_id}"
    plan, _ = decode_placeholders(make_scenario(real.vocab_size).plans[3], rng)
    with pytest.raises(ValueError, match=r"step 3: .*no last_sampled"):
        held.execute(plan)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole_prompts"])
def test_warmup_budgets_the_largest_logits_a_step_can_produce(model_dir: Path, chunked: bool):
    """The memory warm-up computes exactly as many logits rows as the scheduler's worst step:
    sampled rows plus prompt-logprob rows. The worst step is driven through the real engine: 3
    decodes beside a prompt asking for prompt logprobs (chunked: 4 of its rows, the scheduler's
    cap; whole prompts: all its tokens' rows, up to the token budget)."""
    from tp_engine import LLM, SamplingParams
    from tp_engine.executor.rank_config import max_logits_rows_per_step, runner_config_for

    budget = 16 if chunked else 64
    llm = LLM(
        str(model_dir), block_size=4, num_kv_blocks=64, max_num_seqs=4, max_model_len=64,
        max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
    )  # fmt: skip
    try:
        runner = llm.engine.runner
        warmup_plan, _, _ = runner._warmup_plan()
        budgeted = warmup_plan.logits_indices.size
        assert budgeted == runner.config.resolved_max_num_logits_rows
        assert budgeted == max_logits_rows_per_step(llm.engine.config) == (7 if chunked else 64)
        assert runner_config_for(llm.engine.config).max_num_logits_rows == budgeted
        # The warm-up step is one the model runs: sampled rows first, then the others.
        assert runner._warmup(profile_sampling) > 0
        assert len(set(warmup_plan.logits_indices.tolist())) == budgeted

        rows: list[int] = []
        execute = runner.execute

        def recording(plan, *args, **kwargs):
            rows.append(int(plan.logits_indices.size))
            return execute(plan, *args, **kwargs)

        runner.execute = recording
        plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        scored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
        prompt_len = 20 if chunked else 61
        prompts = [[5], [6], [7], list(range(100, 100 + prompt_len))]
        llm.generate(prompts, [plain, plain, plain, scored], use_tqdm=False)
    finally:
        llm.shutdown()
    assert max(rows) == budgeted, rows
