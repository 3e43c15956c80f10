"""`launch/serve.py --speculative-config`: completions (whole and streamed) carry the tokens
the engine gives without speculation, /metrics has vLLM's spec-decode series, and a bad
config is refused before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_harness import REPO_ROOT, serving
from tests.tp_cases import CHECKPOINTS
from tp_engine import LLM, SamplingParams
from tp_engine.testing import build_random_qwen3

pytestmark = pytest.mark.slow

CKPT = "tied_kv2_oddvocab"
SPEC = {"method": "ngram", "num_speculative_tokens": 3}
PROMPTS = [[11, 12, 13, 14, 15, 16] * 4, [40, 41, 42, 40, 41, 42, 40, 41, 42, 40]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_random_qwen3(
        tmp_path_factory.mktemp("ckpt") / CKPT, max_position_embeddings=256, **CHECKPOINTS[CKPT]
    )


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(
        model_dir, log, "--served-model-name", "m", "--num-kv-blocks", "128",
        "--speculative-config", json.dumps(SPEC),
    )  # fmt: skip


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    """Greedy tokens without speculation."""
    with LLM(str(model_dir), num_kv_blocks=128) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _body(prompt: list[int], **extra) -> dict:
    return {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **extra}  # fmt: skip


def test_completions_and_metrics(server, expected):
    for prompt, want in zip(PROMPTS, expected, strict=True):
        status, reply = server.post("/v1/completions", _body(prompt))
        assert status == 200, reply
        assert reply["choices"][0]["token_ids"] == want
        assert reply["usage"]["completion_tokens"] == len(want)
    drafts = server.metric("vllm:spec_decode_num_drafts_total")
    draft_tokens = server.metric("vllm:spec_decode_num_draft_tokens_total")
    accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= draft_tokens
    assert server.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_streamed_chunks_carry_every_token(server, expected):
    events = server.stream(
        "/v1/completions",
        {**_body(PROMPTS[0]), "stream": True,
         "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )  # fmt: skip
    events = [e for e in events if isinstance(e, dict)]
    tokens = [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]
    assert tokens == expected[0]
    assert events[-1]["usage"]["completion_tokens"] == len(expected[0])


def test_a_bad_speculative_config_is_refused_before_start(model_dir):
    proc = subprocess.run(
        [sys.executable, "launch/serve.py", "--model", str(model_dir), "--port", "0",
         "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "method must be one of" in proc.stderr
