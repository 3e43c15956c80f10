"""The engine with n-gram speculation over the CUDA graphs' data path (CPU: the runner built by
`TP_ENGINE_DECODE_GRAPHS=padded`, which runs uniform steps eagerly on the padded static
buffers): greedy outputs equal transformers', and verify steps in which every sequence verifies
k drafts took the padded path of q = 1 + k, on every rank (at TP 2 the ranks' collectives would
not match if one of them padded a step the other did not)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rank_worker.runner.cuda_graphs import ENV_VAR
from tests.test_speculative import CKPT, MAX_TOKENS, NGRAM, hf_greedy_reference, make_prompts
from tests.tp_cases import MAX_MODEL_LEN, build_checkpoints
from tp_engine import LLM, SamplingParams

K = NGRAM["num_speculative_tokens"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoints(tmp_path_factory.mktemp("ckpt"))[CKPT]


@pytest.fixture(scope="module")
def reference(checkpoint) -> tuple[list[list[int]], list[list[int]]]:
    return hf_greedy_reference(checkpoint)


@pytest.mark.parametrize("tp", [1, 2])
def test_ngram_verify_steps_take_the_padded_graph_path(checkpoint, reference, monkeypatch, tp):
    monkeypatch.setenv(ENV_VAR, "padded")  # the ranks, spawned below, inherit it
    prompts, expected = reference
    llm = LLM(
        str(checkpoint), tensor_parallel_size=tp, block_size=4, num_kv_blocks=128,
        max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN, speculative_config=NGRAM,
    )  # fmt: skip
    try:
        graphs = llm.engine.runner.graph_runner
        assert graphs is not None and graphs.graphs == {}  # built, nothing captured
        assert sorted(graphs.ladders) == [1, 1 + K]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        # The repetitive prompts one at a time (batch 1: every verify step of k drafts is
        # uniform), then all prompts together (mixed steps, verify entries of unequal lengths:
        # the mixed-step graphs' padded path, `rank_worker.runner.mixed_graphs`).
        repetitive = len(make_prompts(643)) - 4  # make_prompts: the last 4 are random
        # Copies of a prompt draft alike, so their verify steps are uniform: 3 run in a batch
        # of 4, 5 in 8 (padded).
        batches = [
            *([i] for i in range(repetitive)),
            *([i] * 3 for i in range(repetitive)),
            *([i] * 5 for i in range(2)),
            list(range(len(prompts))),
        ]
        for batch in batches:
            outs = llm.generate(
                [{"prompt_token_ids": prompts[i]} for i in batch], greedy, use_tqdm=False
            )
            for i, out in zip(batch, outs, strict=True):
                assert out.outputs[0].token_ids == expected[i], f"prompt {i}"
        stats = llm.engine.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert graphs.eager_runs_by_query_len[1 + K] > 0, graphs.eager_runs_by_query_len
        assert graphs.eager_runs_by_query_len[1] > 0
        assert graphs.padded_runs_by_query_len[1 + K] > 0, graphs.padded_runs_by_query_len
        assert set(graphs.eager_runs_by_query_len) == {1, 1 + K}
        assert graphs.num_replays == 0
        mixed = llm.engine.runner.mixed_graphs
        assert mixed.graphs == {} and sum(mixed.eager_runs_by_bucket.values()) > 0
        llm.engine.core.scheduler.block_manager.check_integrity()
    finally:
        llm.shutdown()
