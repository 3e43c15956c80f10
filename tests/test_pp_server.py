"""`serve.py --pipeline-parallel-size 2` under torchrun (2 ranks, so TP = WORLD_SIZE / PP = 1):
the server's completions are transformers' greedy continuations, and the torchrun world is
checked against TP x PP before anything starts (`bringup.tensor_parallel_size`)."""

from __future__ import annotations

import os

import pytest
import torch

from rank_worker.dist import bringup
from tests.moe_cases import hf_greedy
from tests.server_harness import Server, torchrun_cmd
from tests.tp_cases import MAX_MODEL_LEN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tp_engine.testing import build_random_qwen3

    return build_random_qwen3(
        tmp_path_factory.mktemp("pp") / "dense", hidden_size=32, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=True,
        max_position_embeddings=MAX_MODEL_LEN, seed=41,
    )  # fmt: skip


def test_torchrun_pp2_serves_greedy_completions(checkpoint, tmp_path) -> None:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    prompts = [[7, 3, 99, 12], list(range(20, 37))]
    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    expected = hf_greedy(model, prompts, 5)
    tok = AutoTokenizer.from_pretrained(checkpoint)
    env = dict(os.environ)
    env.pop("TP_ENGINE_FAULT", None)
    env.pop("TP_ENGINE_PP_LAYER_PARTITION", None)
    args = ["--model", str(checkpoint), "--port", "0", "--pipeline-parallel-size", "2",
            "--block-size", "4", "--num-kv-blocks", "32", "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    server = Server([*torchrun_cmd(2), *args], env, tmp_path / "server.log").wait_ready()
    try:
        for prompt, want in zip(prompts, expected, strict=True):
            body = {"model": str(checkpoint), "prompt": prompt, "max_tokens": 5,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            status, reply = server.post("/v1/completions", body)
            assert status == 200, reply
            assert reply["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
        # Two stages of one rank each (vLLM's split of 3 layers), not one TP group of two.
        log = server.log()
        assert "rank 0: pipeline stage 0 of 2 (TP rank 0 of 1), layers [0, 2) of 3" in log
        assert "rank 1: pipeline stage 1 of 2 (TP rank 0 of 1), layers [2, 3) of 3" in log
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log_tail()


def test_torchrun_world_must_be_tp_times_pp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert bringup.tensor_parallel_size(None, 2) == 2
    assert bringup.tensor_parallel_size(2, 2) == 2
    assert bringup.tensor_parallel_size(None) == 4
    for requested, pp in ((4, 2), (None, 3), (1, 2)):
        with pytest.raises(ValueError, match=rf"pipeline_parallel_size={pp} but torchrun"):
            bringup.tensor_parallel_size(requested, pp)
    monkeypatch.delenv("RANK")
    assert bringup.tensor_parallel_size(3, 2) == 3  # no torchrun: as asked
