"""The bf16 judge of tests/test_gpu_e2e.py, on CPU: it passes a correct engine and fails a wrong
kernel.

The engine computes in bf16 (torch attention backend, the reference path); the judge is
transformers in float32 on the same bf16-rounded weights. A correct engine may leave the
judge's greedy path only at a near-tie, by less than LOGPROB_SLACK; an attention whose softmax
scale is 30% off (planted here) leaves it by more. The `gpu` test applies the same judge to the
Triton and flash-attn backends natively.
"""

from __future__ import annotations

import pytest

from rank_worker.attention import torch_backend
from tests.test_gpu_e2e import (
    BF16_ENGINE,
    assert_close_greedy,
    build_bf16_model,
    generate,
    hf_greedy,
    load_judge,
    make_prompts,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = build_bf16_model(tmp_path_factory.mktemp("bf16"))
    judge = load_judge(model_dir, "cpu")
    prompts = make_prompts(judge.config.vocab_size)
    reference = [hf_greedy(judge, p) for p in prompts]
    return model_dir, judge, prompts, reference


def run_engine(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    got, facts = generate(
        model_dir, prompts, attention_backend="torch", block_size=16, **BF16_ENGINE
    )
    assert facts["backend"] == "torch"
    return got


def test_the_judge_passes_a_correct_bf16_engine(setup):
    model_dir, judge, prompts, reference = setup
    got = run_engine(model_dir, prompts)
    frac = assert_close_greedy(judge, prompts, got, reference, "torch bf16 vs transformers")
    assert frac > 0.5  # bf16 follows the float32 path most of the way


def test_the_judge_fails_a_wrong_softmax_scale(setup, monkeypatch):
    model_dir, judge, prompts, reference = setup
    attend = torch_backend._attend_padded

    def wrong_scale(q, k, v, query_lens, seq_lens, scale):
        return attend(q, k, v, query_lens, seq_lens, scale * 1.3)

    monkeypatch.setattr(torch_backend, "_attend_padded", wrong_scale)
    got = run_engine(model_dir, prompts)
    with pytest.raises(AssertionError, match="gap"):
        assert_close_greedy(judge, prompts, got, reference, "wrong scale vs transformers")
