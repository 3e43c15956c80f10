"""Speculative decoding with a draft model (a smaller random Qwen3 with the target's tokenizer,
and the target itself), greedy outputs against transformers at TP 1, 2 and 4 with prefix
caching, chunked prefill, a small token budget and preemption; a draft with another vocabulary
is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_speculative import CKPT, check_matches_hf, hf_greedy_reference
from tests.tp_cases import MAX_MODEL_LEN, build_checkpoints
from tp_engine import LLM
from tp_engine.testing import build_random_qwen3, truncate_layers

pytestmark = pytest.mark.slow

K = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    target = build_checkpoints(root)[CKPT]
    # The target's first layer (a layer-dropped copy): cheap, and it agrees with the target
    # often enough that both accepted and rejected drafts occur.
    return {"target": target, "draft": truncate_layers(target, root / "draft", 1)}


@pytest.fixture(scope="module")
def reference(checkpoints):
    return hf_greedy_reference(checkpoints["target"])


def _llm(checkpoints, tp: int, draft: str) -> LLM:
    spec = {"method": "draft_model", "model": str(checkpoints[draft]), "num_speculative_tokens": K}
    return LLM(
        str(checkpoints["target"]), tensor_parallel_size=tp, block_size=4, num_kv_blocks=128,
        max_num_seqs=8, max_num_batched_tokens=MAX_MODEL_LEN, speculative_config=spec,
    )  # fmt: skip


@pytest.fixture(
    scope="module",
    params=[(1, "draft"), (2, "draft"), (4, "draft"), (2, "target")],
    ids=["tp1", "tp2", "tp4", "tp2-self"],
)
def draft_llm(request, checkpoints):
    tp, draft = request.param
    engine = _llm(checkpoints, tp, draft)
    engine.draft_is_target = draft == "target"
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(
    "knobs",
    [
        {"enable_prefix_caching": True, "enable_chunked_prefill": True},
        {"max_num_batched_tokens": 8, "max_num_seqs": 4},
        {"num_kv_blocks": 16},
    ],
    ids=["prefix_chunked", "small_budget", "small_pool"],
)
def test_greedy_equals_transformers_with_a_draft_model(draft_llm, reference, knobs):
    check_matches_hf(draft_llm, reference, **knobs)
    stats = draft_llm.engine.spec_stats
    if "num_kv_blocks" in knobs:
        assert draft_llm.engine.core.scheduler.num_preemptions > 0
    if draft_llm.draft_is_target:
        # The target as its own draft: every draft is what the target then samples.
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_a_draft_with_another_vocabulary_is_refused(checkpoints, tmp_path):
    from transformers import AutoTokenizer

    from tp_engine.engine import check_draft_model

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoints["target"]))
    other = build_random_qwen3(
        tmp_path / "other", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=1,
        head_dim=8, intermediate_size=64, vocab_size=700, max_position_embeddings=MAX_MODEL_LEN,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"draft model's vocabulary \(700 logits rows\) differs"):
        check_draft_model(str(other), 643, tokenizer)
    with pytest.raises(ValueError, match=r"has no config\.json"):
        check_draft_model(str(tmp_path), 643, tokenizer)
    check_draft_model(str(checkpoints["draft"]), 643, tokenizer)  # the same vocabulary
