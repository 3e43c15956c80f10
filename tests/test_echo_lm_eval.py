"""Scoring clients against the server: `echo` with logprobs, `max_tokens: 0`, batches of
token-id prompts, `GET /tokenizer_info`, and lm-evaluation-harness itself.

lm-eval's `local-completions` model scores a (context, continuation) pair by sending its token
ids with `{"echo": true, "logprobs": 1, "max_tokens": 1, "temperature": 0}` (older versions:
`max_tokens: 0`) and summing `choices[i].logprobs.token_logprobs` over the continuation; the
first prompt token's entry is null. So the echoed prompt logprobs must be exactly the model's:
they are compared with transformers' float32 log-softmax at every position.

One server for the module: 2 ranks over gloo (the logits are gathered from both vocabulary
shards), on the padded checkpoint of `tp_cases` (config vocabulary larger than the tokenizer,
as real Qwen3 checkpoints are). The lm-eval test needs the `lm-eval` package (the `eval`
extra) and is skipped without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.server_harness import REPO_ROOT, serving
from tests.tp_cases import build_padded_checkpoint

pytestmark = pytest.mark.slow

MODEL = "padded"
MAX_MODEL_LEN = 256
TEXT = "The quick brown fox jumps over the lazy dog."
# float32 on both sides; the engine's matmuls split over two ranks and reduce in another order
# than transformers', which moves a logprob by a few 1e-6 at most.
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_padded_checkpoint(tmp_path_factory.mktemp("padded"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--served-model-name", MODEL,
            "--tensor-parallel-size", "2", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-kv-blocks", "64"]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(model_dir, log, *args)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is the log-softmax of the logits after ids[: i + 1]."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def complete(server, **body) -> dict:
    status, resp = server.post("/v1/completions", {"model": MODEL, "temperature": 0, **body})
    assert status == 200, resp
    return resp


def check_echoed_logprobs(
    logprobs: dict, ids: list[int], ref: torch.Tensor, num_top: int, tokenizer
) -> None:
    """`logprobs` of an echoed prompt `ids` (then perhaps generated tokens) against
    transformers' `ref = hf_logprobs(ids)`, at every position."""
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for i in range(1, len(logprobs["token_logprobs"])):
        row = ref[i - 1]
        assert logprobs["token_logprobs"][i] == pytest.approx(float(row[ids[i]]), abs=ATOL), i
        # The chosen token, then the top `num_top`, keyed by their text: tokens that decode
        # alike (padding ids, partial characters) share one key, the later one's value.
        expected = {
            tokenizer.decode([t]): float(row[t]) for t in [ids[i], *row.topk(num_top).indices]
        }
        assert logprobs["top_logprobs"][i] == pytest.approx(expected, abs=ATOL), i


# -- echo -------------------------------------------------------------------------------------------


def test_echo_with_logprobs_equals_transformers_at_every_position(server, tokenizer, hf_model):
    """lm-eval's request: a batch of token-id prompts, one token generated after each."""
    prompts = [tokenizer(TEXT)["input_ids"], [5, 17, 300, 642, 690, 3]]  # 690: a padding id
    resp = complete(server, prompt=prompts, max_tokens=1, logprobs=2, echo=True, seed=1234)
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    for ids, choice in zip(prompts, resp["choices"], strict=True):
        lp = choice["logprobs"]
        ref = hf_logprobs(hf_model, ids)
        generated = int(ref[-1].argmax())
        check_echoed_logprobs(lp, [*ids, generated], ref, 2, tokenizer)
        assert len(lp["tokens"]) == len(ids) + 1
        assert lp["tokens"] == [tokenizer.decode([t]) for t in [*ids, generated]]
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids) + 1)]
        assert choice["text"] == tokenizer.decode(ids) + tokenizer.decode([generated])
    assert resp["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert resp["usage"]["completion_tokens"] == 2


def test_echo_without_logprobs_text_and_token_prompts(server, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    plain = complete(server, prompt=TEXT, max_tokens=4, ignore_eos=True)["choices"][0]["text"]
    for prompt in (TEXT, ids):
        resp = complete(server, prompt=prompt, max_tokens=4, ignore_eos=True, echo=True)
        (choice,) = resp["choices"]
        assert choice["text"] == TEXT + plain and choice["logprobs"] is None
        events = server.stream(
            "/v1/completions",
            {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
             "ignore_eos": True, "echo": True, "stream": True},
        )  # fmt: skip
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT + plain
        assert events[-1] == "[DONE]"


def test_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(server, tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    body = {"prompt": ids, "max_tokens": 3, "logprobs": 1, "echo": True, "ignore_eos": True}
    whole = complete(server, **body)["choices"][0]
    events = server.stream(
        "/v1/completions", {"model": MODEL, "temperature": 0, "stream": True, **body}
    )
    chunks = [e["choices"][0] for e in events[:-1]]
    assert len(chunks[0]["logprobs"]["tokens"]) >= len(ids)  # the prompt, then its first token
    streamed = {
        key: [v for c in chunks for v in c["logprobs"][key]]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
    assert streamed == whole["logprobs"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(
    server, tokenizer, hf_model
):
    """Older lm-eval's request. The engine runs it as a prompt-only request, so even a prompt
    that fills the whole context is scored (echo with max_tokens 1 would not fit)."""
    ids = (tokenizer(TEXT)["input_ids"] * 30)[:MAX_MODEL_LEN]
    body = {"prompt": ids, "max_tokens": 0, "logprobs": 1, "echo": True, "return_token_ids": True}
    (choice,) = complete(server, **body)["choices"]
    assert choice["token_ids"] == [] and choice["finish_reason"] == "length"
    assert choice["text"] == tokenizer.decode(ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_echoed_logprobs(choice["logprobs"], ids, hf_logprobs(hf_model, ids), 1, tokenizer)
    events = server.stream(
        "/v1/completions", {"model": MODEL, "temperature": 0, "stream": True, **body}
    )
    assert events[-1] == "[DONE]"
    (chunk,) = [e["choices"][0] for e in events[:-1]]
    assert chunk["text"] == choice["text"] and chunk["finish_reason"] == "length"
    assert chunk["logprobs"] == choice["logprobs"]
    # Without echo, max_tokens 0 asks for nothing at all: refused, as OpenAI does.
    status, resp = server.post("/v1/completions", {"prompt": TEXT, "max_tokens": 0})
    assert status == 400 and resp["error"]["param"] == "max_tokens"


def test_tokenizer_info(server, tokenizer):
    status, data = server.get("/tokenizer_info")
    info = json.loads(data)
    assert status == 200 and info["eos_token"] == tokenizer.eos_token == "<|im_end|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert info["pad_token"] == "<|endoftext|>" and info["bos_token"] is None
    assert info["model_max_length"] == MAX_MODEL_LEN


# -- lm-eval ----------------------------------------------------------------------------------------


def test_lm_eval_loglikelihoods_equal_transformers(server, model_dir, hf_model, tmp_path):
    """`lm_eval --model local-completions` (as docs/serving.md shows it) on the small multiple-choice
    task in tests/data/lm_eval: every loglikelihood it records equals transformers' sum over the
    continuation's tokens, and its is_greedy flag agrees."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.utils import check_remote_tokenizer_support

    base_url = f"http://{server.host}:{server.port}/v1/completions"
    # lm-eval's own probe for the remote tokenizer: /tokenizer_info (eos_token) and /tokenize.
    assert check_remote_tokenizer_support(base_url)
    model_args = (
        f"model={MODEL},base_url={base_url},tokenizer={model_dir},tokenizer_backend=huggingface"
    )
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false"
    )
    out = tmp_path / "lm_eval"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", model_args, "--batch_size", "4", "--tasks", "tp_engine_tiny_mc",
           "--include_path", "tests/data/lm_eval", "--output_path", str(out), "--log_samples"]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (samples_file,) = out.rglob("samples_tp_engine_tiny_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 5

    # The token ids lm-eval sent, from its own context/continuation split.
    lm = LocalCompletionsAPI(
        base_url=base_url, model=MODEL, tokenizer=str(model_dir), tokenizer_backend="huggingface"
    )
    num_checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            ctx_ids, cont_ids = lm._encode_pair(context, continuation)
            ref = hf_logprobs(hf_model, ctx_ids + cont_ids)
            rows = ref[len(ctx_ids) - 1 : -1]  # the rows that predict the continuation
            expected = float(rows.gather(1, torch.tensor(cont_ids)[:, None]).sum())
            greedy = bool((rows.argmax(-1) == torch.tensor(cont_ids)).all())
            loglikelihood, is_greedy = resp[0]
            assert float(loglikelihood) == pytest.approx(expected, abs=ATOL), (
                context,
                continuation,
            )
            assert (is_greedy in (True, "True")) == greedy
            num_checked += 1
    assert num_checked == 16
