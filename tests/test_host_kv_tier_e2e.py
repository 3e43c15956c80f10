"""The host-memory KV tier end to end (`kv_offloading_size`): a multi-turn workload whose
histories far outgrow the device pool. Greedy tokens equal transformers' and the same run
without the tier, at TP 1 and 2; blocks the device pool evicted come back from host memory
(external prefix-cache hits), so fewer prompt tokens are computed than without the tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.tp_cases import hf_greedy
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

TURNS = 3
OUTPUT_TOKENS = 6
MAX_MODEL_LEN = 64
SHAPE = dict(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, tie_word_embeddings=True, seed=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("ckpt"), max_position_embeddings=MAX_MODEL_LEN, **SHAPE
    )


def conversations(
    llm: LLM, vocab_size: int, lora_request: Any = None
) -> tuple[list[list[int]], list[list[int]]]:
    """Four conversations of `TURNS` turns, each turn's prompt its history (every earlier
    prompt and answer) plus new user tokens; all four turns of a round in one call. Returns
    every prompt and every answer, round by round."""
    g = torch.Generator().manual_seed(7)
    new = lambda n: torch.randint(0, vocab_size, (n,), generator=g).tolist()  # noqa: E731
    histories = [new(14) for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    prompts, answers = [], []
    for turn in range(TURNS):
        outputs = llm.generate(
            [{"prompt_token_ids": h} for h in histories], params, use_tqdm=False,
            lora_request=lora_request,
        )  # fmt: skip
        for h, out in zip(histories, outputs, strict=True):
            prompts.append(list(h))
            answers.append(list(out.outputs[0].token_ids))
        histories = [
            h + a + new(8) for h, a in zip(histories, answers[-4:], strict=True)
        ] if turn + 1 < TURNS else histories  # fmt: skip
    return prompts, answers


def engine(checkpoint: Path, tp: int, offload_gib: float | None, **knobs) -> LLM:
    # 16 blocks of 4 tokens: one conversation's history at a time, at most.
    settings = dict(
        block_size=4, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=MAX_MODEL_LEN,
        max_model_len=MAX_MODEL_LEN,
    )  # fmt: skip
    return LLM(
        str(checkpoint), tensor_parallel_size=tp, kv_offloading_size=offload_gib,
        **{**settings, **knobs},
    )  # fmt: skip


def computed_prompt_tokens(llm: LLM, prompts: list[list[int]]) -> int:
    stats = llm.engine.stats()
    found = stats.prefix_cache_hits + stats.external_prefix_cache_hits
    return sum(len(p) for p in prompts) - found


@pytest.fixture(scope="module")
def without_tier(checkpoint) -> tuple[list[list[int]], list[list[int]], int]:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    with engine(checkpoint, 1, None) as llm:
        prompts, answers = conversations(llm, vocab)
        assert llm.engine.stats().external_prefix_cache_hits == 0
        return prompts, answers, computed_prompt_tokens(llm, prompts)


@pytest.mark.parametrize("tp", [1, 2])
def test_histories_come_back_from_host_memory(checkpoint, without_tier, tp, monkeypatch) -> None:
    from transformers import AutoConfig

    from rank_worker.kv.side_stream import ENV_VAR

    # The ranks run their copies as late as the side stream's contract allows (a GPU's
    # asynchrony, played on CPU): a forward pass that read a block before its copy up would
    # read stale K/V and change the tokens.
    monkeypatch.setenv(ENV_VAR, "deferred")

    base_prompts, base_answers, base_computed = without_tier
    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    with engine(checkpoint, tp, 0.001) as llm:
        assert llm.engine.core.host_tier is not None and llm.engine.core.host_tier.num_blocks >= 64
        prompts, answers = conversations(llm, vocab)
        stats = llm.engine.stats()
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        computed = computed_prompt_tokens(llm, prompts)
        preemptions = llm.engine.core.scheduler.num_preemptions
        llm.engine.core.scheduler.block_manager.check_integrity()
        llm.engine.core.host_tier.check_integrity()
    assert prompts == base_prompts and answers == base_answers  # the same run without the tier
    assert answers == hf_greedy(checkpoint, prompts, OUTPUT_TOKENS)
    assert stats.external_prefix_cache_hits > 0
    assert metrics["vllm:external_prefix_cache_hits"] == stats.external_prefix_cache_hits
    assert metrics["vllm:external_prefix_cache_queries"] >= stats.external_prefix_cache_hits
    assert computed < base_computed, (computed, base_computed)
    assert preemptions > 0  # the pool is that tight: preempted sequences come back from below


@pytest.mark.parametrize(
    "knobs",
    [
        # Prompts in chunks of 8 tokens: hits from below, then the rest chunk by chunk.
        {"max_num_batched_tokens": 8, "max_num_seqs": 2},
        # n-gram speculation: verify entries, rejected drafts' blocks given back.
        {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        # Asynchronous scheduling: copies decided for a step while the one before runs.
        {"async_scheduling": True},
    ],
    ids=["chunked", "ngram", "async"],
)
def test_hits_from_below_compose(checkpoint, without_tier, knobs) -> None:
    """The same tokens with each of these on (TP 1), and hits from below counted."""
    from transformers import AutoConfig

    base_prompts, base_answers, _ = without_tier
    vocab = AutoConfig.from_pretrained(checkpoint).vocab_size
    with engine(checkpoint, 1, 0.001, **knobs) as llm:
        prompts, answers = conversations(llm, vocab)
        hits = llm.engine.stats().external_prefix_cache_hits
        llm.engine.core.scheduler.block_manager.check_integrity()
    assert prompts == base_prompts and answers == base_answers
    assert hits > 0


def test_adapters_compose_with_hits_from_below(checkpoint, tmp_path) -> None:
    """An adapter's blocks go down and come back under its own chains: the same tokens as the
    same adapter without the tier (and not the base model's)."""
    from tests.lora_cases import build_adapter
    from tp_engine import LoRARequest

    adapter = build_adapter(checkpoint, tmp_path / "adapter", seed=3, r=8,
                            target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    lora = LoRARequest("a", 1, str(adapter))
    runs, hits = {}, {}
    for gib in (None, 0.001):
        with engine(checkpoint, 1, gib, enable_lora=True, max_lora_rank=8) as llm:
            runs[gib] = conversations(llm, llm.engine.vocab_size, lora)
            hits[gib] = llm.engine.stats().external_prefix_cache_hits
            llm.engine.core.scheduler.block_manager.check_integrity()
    assert runs[0.001] == runs[None] and hits[0.001] > 0 == hits[None]
