"""`torchrun --nproc-per-node 2 launch/serve.py --model <a Qwen3-MoE checkpoint>` serves it:
greedy completions equal `LLM.generate` on one rank (float32: the TP size does not change
the tokens), the experts split over the two ranks."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.moe_cases import MOE_CHECKPOINTS
from tests.server_harness import Server, torchrun_cmd

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, my name is", "The quick brown fox", "Once upon a time"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tp_engine.testing import build_random_qwen3_moe

    shape = dict(MOE_CHECKPOINTS["moe_e8k3_mixed"], max_position_embeddings=256)
    return build_random_qwen3_moe(tmp_path_factory.mktemp("moe"), **shape)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    tmpdir = tempfile.mkdtemp(prefix="moesrv-")  # short socket paths
    env = dict(os.environ, TMPDIR=tmpdir)
    env.pop("TP_ENGINE_FAULT", None)
    args = ["--model", str(checkpoint), "--port", "0", "--num-kv-blocks", "64",
            "--block-size", "16"]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = Server([*torchrun_cmd(2), *args], env, log).wait_ready()
    yield srv
    srv.stop()
    shutil.rmtree(tmpdir, ignore_errors=True)


def test_serves_greedy_completions_equal_to_llm_generate(server, checkpoint):
    from tp_engine import LLM, SamplingParams

    llm = LLM(str(checkpoint), num_kv_blocks=64, block_size=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    body = {"model": str(checkpoint), "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    status, resp = server.post("/v1/completions", body)
    assert status == 200, resp
    assert [c["token_ids"] for c in resp["choices"]] == expected
    assert all(c["finish_reason"] == "length" for c in resp["choices"])
