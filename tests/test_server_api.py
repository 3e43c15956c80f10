"""The HTTP server, for real: `torchrun --nproc-per-node 2 launch/serve.py` (gloo, CPU, the demo
checkpoint) started once for the module, then many requests against it.

Greedy references come from `LLM.generate` on the same checkpoint in this process (one rank:
float32 results do not depend on the tensor-parallel size). The last test shuts the server
down with SIGTERM and checks that nothing is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.server_harness import Server, parse_sse, shm_entries, torchrun_cmd, wait_until

pytestmark = pytest.mark.slow

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "tp-engine-demo"
MAX_MODEL_LEN = 2048
NUM_KV_BLOCKS = 96  # 1536 tokens: smaller than max_model_len, so the engine can refuse too
BLOCK_SIZE = 16
PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "def add(a, b):"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    # Sockets live in TMPDIR; a short private one keeps their paths short and lets the last
    # test check that nothing was left in it.
    tmpdir = tempfile.mkdtemp(prefix="srvtest-")
    env = dict(os.environ, TP_ENGINE_CACHE=str(cache), TMPDIR=tmpdir)
    env.pop("XDG_RUNTIME_DIR", None)
    env.pop("TP_ENGINE_FAULT", None)
    yield env
    leftovers = [p.name for p in Path(tmpdir).iterdir()]
    shutil.rmtree(tmpdir, ignore_errors=True)
    assert not [name for name in leftovers if name.startswith("tpe-")], leftovers


@pytest.fixture(scope="module")
def demo_dir(env):
    old = os.environ.get("TP_ENGINE_CACHE")
    os.environ["TP_ENGINE_CACHE"] = env["TP_ENGINE_CACHE"]
    try:
        from tp_engine.demo import demo_checkpoint_dir

        return demo_checkpoint_dir()  # built here first; the server finds it
    finally:
        if old is None:
            del os.environ["TP_ENGINE_CACHE"]
        else:
            os.environ["TP_ENGINE_CACHE"] = old


@pytest.fixture(scope="module")
def server(env, demo_dir, tmp_path_factory):
    shm_before = shm_entries()
    args = [
        "--port", "0",
        "--api-key", API_KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--num-kv-blocks", str(NUM_KV_BLOCKS),
        "--block-size", str(BLOCK_SIZE),
        "--shutdown-timeout", "20",
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = Server([*torchrun_cmd(2), *args], env, log).wait_ready()
    srv.shm_before = shm_before
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llm(demo_dir):
    from tp_engine import LLM

    engine = LLM(
        str(demo_dir),
        tensor_parallel_size=1,
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        block_size=BLOCK_SIZE,
    )
    yield engine
    engine.shutdown()


def greedy_reference(llm, prompts, max_tokens):
    from tp_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def complete(server, **body):
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}
    status, resp = server.post("/v1/completions", body, AUTH)
    assert status == 200, resp
    return resp


# -- basics ---------------------------------------------------------------------------------------


def test_health_version_models(server):
    assert server.get("/health")[0] == 200  # no API key needed outside /v1
    status, data = server.get("/version")
    assert status == 200 and json.loads(data)["version"]
    status, data = server.get("/v1/models", AUTH)
    models = json.loads(data)
    assert status == 200 and models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == MODEL and model["max_model_len"] == MAX_MODEL_LEN
    assert model["object"] == "model"


def test_completions_equal_llm_generate(server, llm):
    ref = greedy_reference(llm, PROMPTS, 10)
    # One request per prompt, then all prompts in one batched request.
    for prompt, (text, ids) in zip(PROMPTS, ref, strict=True):
        resp = complete(server, prompt=prompt, max_tokens=10, return_token_ids=True)
        (choice,) = resp["choices"]
        assert choice["token_ids"] == ids and choice["text"] == text
        assert choice["finish_reason"] == "length"
        assert resp["object"] == "text_completion" and resp["model"] == MODEL
        usage = resp["usage"]
        assert usage["prompt_tokens"] == len(choice["prompt_token_ids"])
        assert usage["completion_tokens"] == 10
        assert usage["total_tokens"] == usage["prompt_tokens"] + 10
    resp = complete(server, prompt=PROMPTS, max_tokens=10)
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in resp["choices"]] == [text for text, _ in ref]
    # Token-id prompts give the same tokens as their text.
    resp = complete(server, prompt=llm.tokenizer(PROMPTS[0])["input_ids"], max_tokens=10)
    assert resp["choices"][0]["text"] == ref[0][0]


def test_streamed_completion_equals_the_full_one(server, llm):
    ((text, _),) = greedy_reference(llm, [PROMPTS[1]], 12)
    events = server.stream(
        "/v1/completions",
        {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
         "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
        AUTH,
    )  # fmt: skip
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert len({c["id"] for c in events[:-1]}) == 1


def test_chat_equals_llm_generate_on_the_chat_template(server, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ((text, ids),) = greedy_reference(llm, [prompt], 8)
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    status, resp = server.post("/v1/chat/completions", body, AUTH)
    assert status == 200, resp
    assert resp["object"] == "chat.completion"
    (choice,) = resp["choices"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == text
    assert choice["finish_reason"] == "length"
    assert resp["usage"]["prompt_tokens"] == len(llm.tokenizer(prompt)["input_ids"])
    assert resp["usage"]["completion_tokens"] == len(ids) == 8

    events = server.stream(
        "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
        AUTH,
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == text
    usage = events[-2]["usage"]
    assert events[-2]["choices"] == [] and usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] == resp["usage"]["prompt_tokens"]
    # The second time, the prompt's full blocks came from the prefix cache.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= BLOCK_SIZE


# -- stopping ---------------------------------------------------------------------------------------


def test_stop_strings_end_the_text_before_them(server, llm):
    ((text, _),) = greedy_reference(llm, [PROMPTS[2]], 16)
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    cut = text.index(stop)
    body = {"prompt": PROMPTS[2], "max_tokens": 16, "stop": [stop, "never-there"]}
    (choice,) = complete(server, **body)["choices"]
    assert choice["text"] == text[:cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    (choice,) = complete(server, **body, include_stop_str_in_output=True)["choices"]
    assert choice["text"] == text[: cut + len(stop)]
    # Streaming never sends a part of the stop string.
    events = server.stream(
        "/v1/completions",
        {"model": MODEL, **body, "temperature": 0, "ignore_eos": True, "stream": True},
        AUTH,
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text[:cut]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    # Each of n samples stops by itself (rank 0 stops that sample only).
    choices = complete(server, **body, n=2)["choices"]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [(text[:cut], "stop")] * 2
    wait_until(lambda: server.metric("vllm:num_requests_running") == 0, 5, "both to be stopped")


def test_stop_token_ids_end_the_output_on_that_token(server, llm):
    ((_, ids),) = greedy_reference(llm, [PROMPTS[3]], 12)
    stop_id = ids[4]
    body = {"prompt": PROMPTS[3], "max_tokens": 12, "stop_token_ids": [stop_id]}
    (choice,) = complete(server, **body, return_token_ids=True)["choices"]
    assert choice["token_ids"] == ids[: ids.index(stop_id) + 1]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id


# -- sampling -----------------------------------------------------------------------------------------


def test_n_choices_and_seeded_sampling(server):
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    first = complete(server, **body)
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert first["usage"]["completion_tokens"] == 18
    second = complete(server, **body)
    assert [c["text"] for c in second["choices"]] == [c["text"] for c in first["choices"]]


def test_concurrent_clients_get_their_own_results(server, llm):
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    ref = greedy_reference(llm, prompts, 6)

    def one(i):
        if i % 2:
            events = server.stream(
                "/v1/completions",
                {"model": MODEL, "prompt": prompts[i], "max_tokens": 6, "temperature": 0,
                 "ignore_eos": True, "stream": True},
                AUTH,
            )  # fmt: skip
            return "".join(e["choices"][0]["text"] for e in events[:-1])
        return complete(server, prompt=prompts[i], max_tokens=6)["choices"][0]["text"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(one, range(len(prompts))))
    assert texts == [text for text, _ in ref]


def test_logprobs_are_returned_in_openai_shapes(server):
    (choice,) = complete(server, prompt=PROMPTS[0], max_tokens=3, logprobs=2)["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert "".join(lp["tokens"]) == choice["text"] or "\ufffd" in "".join(lp["tokens"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    status, resp = server.post("/v1/chat/completions", body, AUTH)
    assert status == 200, resp
    content = resp["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(t["top_logprobs"]) == 2 for t in content)
    assert {"token", "logprob", "bytes"} <= set(content[0])


# -- invalid requests ------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_HI = [{"role": "user", "content": "Hi"}]
# (id, path, body (dict or raw bytes), headers, expected status)
INVALID = [
    ("bad-json", COMPLETIONS, b'{"prompt": "Hi", ', AUTH, 400),
    ("body-not-an-object", COMPLETIONS, b"[1, 2, 3]", AUTH, 400),
    ("empty-body", COMPLETIONS, b"", AUTH, 400),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 5}, AUTH, 400),
    ("prompt-wrong-type", COMPLETIONS, {"prompt": 5}, AUTH, 400),
    ("prompt-mixed-list", COMPLETIONS, {"prompt": [1, "a"]}, AUTH, 400),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, AUTH, 400),
    ("empty-prompt-list", COMPLETIONS, {"prompt": []}, AUTH, 400),
    ("prompt-too-long", COMPLETIONS, {"prompt": "hello " * 2500}, AUTH, 400),
    ("prompt-plus-max-tokens-too-long", COMPLETIONS, {"prompt": "Hi", "max_tokens": 2048}, AUTH, 400),
    ("exceeds-kv-pool", COMPLETIONS, {"prompt": "Hi", "max_tokens": 1600}, AUTH, 400),
    ("token-ids-out-of-vocab", COMPLETIONS, {"prompt": [1, 2, 10**6]}, AUTH, 400),
    ("negative-token-id", COMPLETIONS, {"prompt": [-1, 3]}, AUTH, 400),
    ("max-tokens-0", COMPLETIONS, {"prompt": "Hi", "max_tokens": 0}, AUTH, 400),
    ("max-tokens-negative", COMPLETIONS, {"prompt": "Hi", "max_tokens": -3}, AUTH, 400),
    ("max-tokens-string", COMPLETIONS, {"prompt": "Hi", "max_tokens": "ten"}, AUTH, 400),
    ("max-tokens-float", COMPLETIONS, {"prompt": "Hi", "max_tokens": 1.5}, AUTH, 400),
    ("temperature-negative", COMPLETIONS, {"prompt": "Hi", "temperature": -1}, AUTH, 400),
    ("temperature-string", COMPLETIONS, {"prompt": "Hi", "temperature": "hot"}, AUTH, 400),
    ("top-p-0", COMPLETIONS, {"prompt": "Hi", "top_p": 0}, AUTH, 400),
    ("top-p-above-1", COMPLETIONS, {"prompt": "Hi", "top_p": 1.5}, AUTH, 400),
    ("top-k-negative", COMPLETIONS, {"prompt": "Hi", "top_k": -5}, AUTH, 400),
    ("min-p-above-1", COMPLETIONS, {"prompt": "Hi", "min_p": 2.0}, AUTH, 400),
    ("presence-penalty-3", COMPLETIONS, {"prompt": "Hi", "presence_penalty": 3}, AUTH, 400),
    ("repetition-penalty-0", COMPLETIONS, {"prompt": "Hi", "repetition_penalty": 0}, AUTH, 400),
    ("n-0", COMPLETIONS, {"prompt": "Hi", "n": 0}, AUTH, 400),
    ("n-too-many", COMPLETIONS, {"prompt": "Hi", "n": 1000}, AUTH, 400),
    ("stop-empty-string", COMPLETIONS, {"prompt": "Hi", "stop": [""]}, AUTH, 400),
    ("stop-wrong-type", COMPLETIONS, {"prompt": "Hi", "stop": 5}, AUTH, 400),
    ("stop-token-id-negative", COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [-1]}, AUTH, 400),
    ("stop-token-id-out-of-vocab", COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [10**6]}, AUTH, 400),
    ("min-tokens-above-max", COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}, AUTH, 400),
    ("logprobs-too-many", COMPLETIONS, {"prompt": "Hi", "logprobs": 100}, AUTH, 400),
    ("seed-string", COMPLETIONS, {"prompt": "Hi", "seed": "x"}, AUTH, 400),
    ("stream-string", COMPLETIONS, {"prompt": "Hi", "stream": "yes"}, AUTH, 400),
    ("stream-options-without-stream", COMPLETIONS, {"prompt": "Hi", "stream_options": {"include_usage": True}}, AUTH, 400),
    ("unknown-model", COMPLETIONS, {"prompt": "Hi", "model": "gpt-4"}, AUTH, 404),
    ("missing-api-key", COMPLETIONS, {"prompt": "Hi"}, {}, 401),
    ("wrong-api-key", COMPLETIONS, {"prompt": "Hi"}, {"Authorization": "Bearer nope"}, 401),
    ("chat-missing-messages", CHAT, {"max_tokens": 5}, AUTH, 400),
    ("chat-empty-messages", CHAT, {"messages": []}, AUTH, 400),
    ("chat-unknown-role", CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, AUTH, 400),
    ("chat-content-wrong-type", CHAT, {"messages": [{"role": "user", "content": 5}]}, AUTH, 400),
    ("chat-image-part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, AUTH, 400),
    ("chat-tools", CHAT, {"messages": USER_HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, AUTH, 400),
    ("chat-max-completion-tokens-0", CHAT, {"messages": USER_HI, "max_completion_tokens": 0}, AUTH, 400),
    ("chat-unknown-model", CHAT, {"messages": USER_HI, "model": "nope"}, AUTH, 404),
    ("chat-missing-api-key", CHAT, {"messages": USER_HI}, {}, 401),
    ("unknown-route", "/v1/embeddings", {"input": "Hi"}, AUTH, 404),
    ("tokenize-unknown-model", "/tokenize", {"prompt": "Hi", "model": "nope"}, AUTH, 404),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [10**6]}, AUTH, 400),
    ("tokenize-missing-api-key", "/tokenize", {"prompt": "Hi"}, {}, 401),
    ("detokenize-missing-api-key", "/detokenize", {"tokens": [1, 2]}, {}, 401),
]  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "headers", "expected"),
    [case[1:] for case in INVALID],
    ids=[case[0] for case in INVALID],
)
def test_invalid_request_is_refused_with_an_openai_error(server, path, body, headers, expected):
    status, resp = server.post(path, body, headers)
    assert status == expected, resp
    error = resp["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]


# -- logit_bias, allowed_token_ids, bad_words ---------------------------------------------------


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key=API_KEY)


def test_openai_clients_logit_bias_works_unchanged(server, llm):
    client = openai_client(server)
    _, free = greedy_reference(llm, ["Once upon a time"], 6)[0]
    favourite = next(t for t in range(100, 600) if t not in free)
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0,
              "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # fmt: skip
    forced = client.completions.create(
        prompt="Once upon a time", logit_bias={str(favourite): 100}, **kwargs
    )
    assert forced.choices[0].model_extra["token_ids"] == [favourite] * 6
    banned = client.completions.create(
        prompt="Once upon a time", logit_bias={str(free[0]): -100}, **kwargs
    )
    assert free[0] not in banned.choices[0].model_extra["token_ids"]
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], logit_bias={str(favourite): 100}, **kwargs
    )
    assert chat.choices[0].model_extra["token_ids"] == [favourite] * 6


def test_allowed_token_ids_and_bad_words_on_both_endpoints(server, llm):
    from tp_engine import SamplingParams

    allowed = [11, 222, 333]
    body = {"max_tokens": 5, "allowed_token_ids": allowed, "return_token_ids": True}
    resp = complete(server, prompt="Hello, my name is", **body)
    assert set(resp["choices"][0]["token_ids"]) <= set(allowed)
    status, resp = server.post(
        "/v1/chat/completions",
        {"messages": USER_HI, "temperature": 1.0, "seed": 1, "ignore_eos": True, **body},
        AUTH,
    )
    assert status == 200 and set(resp["choices"][0]["token_ids"]) <= set(allowed), resp
    # A word of the free output that is one token (with or without its leading space) never
    # appears once banned.
    from tp_engine.sampling_params import tokenize_bad_words

    _, free = greedy_reference(llm, ["The capital of France is"], 8)[0]
    tokenizer = llm.engine.tokenizer

    def single_tokens(word: str) -> set[int]:
        params = tokenize_bad_words(SamplingParams(bad_words=[word]), tokenizer)
        return {ids[0] for ids in params.bad_words_token_ids if len(ids) == 1}

    words = (tokenizer.decode([t]).strip() for t in free)
    word = next(w for w in words if w and set(free) & single_tokens(w))
    resp = complete(
        server, prompt="The capital of France is", max_tokens=8, bad_words=[word],
        return_token_ids=True,
    )  # fmt: skip
    assert not set(resp["choices"][0]["token_ids"]) & single_tokens(word)


BAD_CONSTRAINTS = [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {str(10**6): 1}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [5, 10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": "abc"}, "bad_words"),
    ({"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 1}, "allowed_token_ids"),
]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(("fields", "param"), BAD_CONSTRAINTS, ids=[p for _, p in BAD_CONSTRAINTS])
def test_bad_token_constraints_are_400s_naming_the_field(server, path, fields, param):
    prompt = {"prompt": "Hi"} if path == COMPLETIONS else {"messages": USER_HI}
    status, resp = server.post(path, {"model": MODEL, "max_tokens": 3, **prompt, **fields}, AUTH)
    assert status == 400, resp
    assert resp["error"]["param"] == param, resp
    assert param.split(".")[0] in resp["error"]["message"]


def test_nothing_left_at_the_first_step_is_a_400_from_rank_0_too(server, llm):
    """EOS held back by min_tokens: only rank 0 knows the EOS ids, and it refuses too."""
    eos = min(llm.engine.eos_token_ids)
    status, resp = server.post(
        COMPLETIONS,
        {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "min_tokens": 1,
         "allowed_token_ids": [eos]},
        AUTH,
    )  # fmt: skip
    assert status == 400, resp
    assert "allowed_token_ids leaves no token" in resp["error"]["message"]
    assert complete(server, prompt="Still there?", max_tokens=2)["usage"]["completion_tokens"] == 2


def test_the_server_keeps_serving_after_invalid_requests(server):
    for _, path, body, headers, _ in INVALID[:10]:
        server.post(path, body, headers)
    assert server.get("/health")[0] == 200
    assert complete(server, prompt="Still there?", max_tokens=3)["usage"]["completion_tokens"] == 3
    assert server.metric("vllm:num_requests_running") == 0


def test_chat_parsing_needs_the_server_flags(server):
    """This server runs no --tool-call-parser and no --reasoning-parser: tools (unless
    tool_choice is "none") and a thinking budget are refused, naming the field and the flag."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra, param, flag in [
        ({"tools": tools}, "tools", "--tool-call-parser"),
        ({"tools": tools, "tool_choice": "required"}, "tools", "--tool-call-parser"),
        ({"thinking_token_budget": 8}, "thinking_token_budget", "--reasoning-parser"),
    ]:
        body = {"messages": USER_HI, "max_tokens": 2, **extra}
        status, resp = server.post("/v1/chat/completions", body, AUTH)
        assert status == 400 and resp["error"]["param"] == param, resp
        assert flag in resp["error"]["message"]
    body = {"messages": USER_HI, "max_tokens": 2, "tools": tools, "tool_choice": "none"}
    status, resp = server.post("/v1/chat/completions", body, AUTH)
    assert status == 200, resp
    message = resp["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["reasoning_content"] is None


def test_too_long_prompt_error_states_the_lengths(server):
    status, resp = server.post(COMPLETIONS, {"prompt": [5] * 2000, "max_tokens": 100}, AUTH)
    assert status == 400
    message = resp["error"]["message"]
    assert "2048" in message and "2000" in message and "2100" in message and "100" in message
    assert resp["error"]["code"] == "context_length_exceeded"
    # The engine's own refusal (the KV pool is smaller than the context) names the sizes too.
    status, resp = server.post(COMPLETIONS, {"prompt": [5] * 100, "max_tokens": 1500}, AUTH)
    assert status == 400 and str(NUM_KV_BLOCKS) in resp["error"]["message"]


# -- metrics, tokenizer routes ------------------------------------------------------------------------


def test_metrics_use_vllms_names(server):
    long_prompt = " ".join(PROMPTS * 4)
    complete(server, prompt=long_prompt, max_tokens=2)
    complete(server, prompt=long_prompt, max_tokens=2)  # its full blocks hit the prefix cache
    samples = server.metrics()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
    ):
        assert f'{name}{{model_name="{MODEL}"}}' in samples, name
    assert server.metric("vllm:prefix_cache_hits_total") >= BLOCK_SIZE
    assert server.metric("vllm:prompt_tokens_total") > 0
    assert server.metric("vllm:generation_tokens_total") >= 4
    assert server.metric("vllm:e2e_request_latency_seconds_count") >= 2
    assert server.metric("vllm:request_success_total") >= 2


def test_vllms_grafana_dashboard_reads_only_served_series(server):
    """Every series and label vLLM's own dashboard queries (`tests/test_grafana_dashboard.py`)
    is on our /metrics, and the request-phase histograms hold this test's requests: one
    prompt with n = 2 (5 tokens each) and one with n = 1 (3 tokens), all cut by max_tokens."""
    from tests import dashboard_queries
    from tests.test_grafana_dashboard import DASHBOARD

    def scrape():
        status, data = server.get("/metrics")
        assert status == 200
        return data.decode()

    before = scrape()
    complete(server, prompt=PROMPTS[1], max_tokens=5, n=2)
    complete(server, prompt=PROMPTS[2], max_tokens=3)
    after = scrape()
    refs = dashboard_queries.references(dashboard_queries.load(DASHBOARD))
    assert dashboard_queries.missing(refs, after, {"model_name": MODEL}) == []

    def grew(name):
        return dashboard_queries.total(after, name, model_name=MODEL) - dashboard_queries.total(
            before, name, model_name=MODEL
        )

    finished = 3  # sequences: two samples, one request
    assert grew("vllm:request_success_total") == finished
    for phase in ("prefill", "decode", "inference"):
        assert grew(f"vllm:request_{phase}_time_seconds_count") == finished, phase
    prefill = grew("vllm:request_prefill_time_seconds_sum")
    decode = grew("vllm:request_decode_time_seconds_sum")
    # Prefill starts at rank 0's first scheduling, after the request reached the API process,
    # and ends with the first token, as TTFT does; inference is prefill and decode.
    assert 0 < prefill <= grew("vllm:time_to_first_token_seconds_sum")
    assert decode > 0  # 4 and 2 decode tokens after each first token
    assert grew("vllm:request_inference_time_seconds_sum") == pytest.approx(prefill + decode)
    # One observation per prompt, its longest sample: 5 (of two samples) and 3.
    assert grew("vllm:request_max_num_generation_tokens_count") == 2
    assert grew("vllm:request_max_num_generation_tokens_sum") == 5 + 3
    assert grew("vllm:request_generation_tokens_sum") == 5 + 5 + 3
    assert dashboard_queries.total(after, "vllm:num_requests_swapped") == 0
    assert dashboard_queries.total(after, "vllm:cpu_cache_usage_perc") == 0  # no host KV tier


def test_tokenize_and_detokenize(server, llm):
    status, resp = server.post("/tokenize", {"prompt": PROMPTS[0]}, AUTH)
    assert status == 200 and resp["tokens"] == llm.tokenizer(PROMPTS[0])["input_ids"]
    assert resp["count"] == len(resp["tokens"]) and resp["max_model_len"] == MAX_MODEL_LEN
    status, resp = server.post("/detokenize", {"tokens": resp["tokens"]}, AUTH)
    assert status == 200 and resp["prompt"] == PROMPTS[0]


# -- disconnects and shutdown ---------------------------------------------------------------------


def open_stream(server, max_tokens):
    conn = server.connection()
    body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn.request(
        "POST", COMPLETIONS, json.dumps(body), {**AUTH, "Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def read_events(resp, count):
    events = []
    while len(events) < count:
        line = resp.readline()
        assert line, "stream ended early"
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
            assert resp.readline() == b"\n"  # each event ends with an empty line
    return events


def test_client_disconnect_mid_stream_frees_its_blocks(server):
    finished_before = server.metric("vllm:request_success_total")
    conn, resp = open_stream(server, max_tokens=1400)
    read_events(resp, 3)
    assert server.metric("vllm:num_requests_running") == 1
    assert server.metric("vllm:kv_cache_usage_perc") > 0
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(
        lambda: (
            server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:kv_cache_usage_perc") == 0
        ),
        timeout_s=10,
        what="the aborted request's blocks to be freed",
    )
    assert server.metric("vllm:request_success_total") == finished_before  # aborted, not done

    # The same for a client that gives up waiting for a whole (non-streamed) response.
    conn = server.connection()
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1400, "ignore_eos": True}
    conn.request(
        "POST", COMPLETIONS, json.dumps(body), {**AUTH, "Content-Type": "application/json"}
    )
    wait_until(lambda: server.metric("vllm:num_requests_running") == 1, 10, "the request to run")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(
        lambda: (
            server.metric("vllm:num_requests_running") == 0
            and server.metric("vllm:kv_cache_usage_perc") == 0
        ),
        timeout_s=10,
        what="the abandoned request's blocks to be freed",
    )


def test_sigterm_drains_in_flight_requests_and_leaves_nothing_behind(server, env):
    conn, resp = open_stream(server, max_tokens=40)
    events = read_events(resp, 1)
    os.kill(server.rank0_pid(), signal.SIGTERM)
    # New requests are refused while the in-flight one finishes.
    wait_until(lambda: server.get("/health")[0] != 200, timeout_s=10, what="health to turn 503")
    events += parse_sse(resp.read())
    conn.close()
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=60) == 0, server.log_tail()
    wait_until(lambda: not server.alive_pids(), timeout_s=10, what="every process to exit")
    assert shm_entries(server.run_pids()) <= server.shm_before
    assert not [p for p in Path(env["TMPDIR"]).iterdir() if p.name.startswith("tpe-")]
    assert "Traceback" not in server.log(), server.log_tail()
