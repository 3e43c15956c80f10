"""Token ids the tokenizer does not know, end to end: `LLM.generate` and the HTTP server.

Published Qwen3 checkpoints pad the embedding and LM head past the tokenizer (151936 rows,
151669 tokens), so a padding id can be sampled. One such id used to make the server answer 500
(TypeError from the incremental detokenizer) and cut streams short of their closing chunk.
Every path from ids to text treats such an id as empty text, as vLLM does: texts, streamed
deltas, stop strings, and the token strings of logprobs ("").

The checkpoint (`tp_cases.build_padded_checkpoint`) makes greedy generations mix known and
padding ids; the fixtures check that they do, so the tests cannot pass vacuously.
"""

from __future__ import annotations

import pytest

from tests.server_harness import serving
from tests.tp_cases import PADDED_VOCAB, build_padded_checkpoint
from tp_engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "padded"
PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_padded_checkpoint(tmp_path_factory.mktemp("padded"))


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = LLM(str(model_dir), max_model_len=256, num_kv_blocks=64, block_size=16)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def num_known(llm) -> int:
    n = len(llm.tokenizer)
    assert n < PADDED_VOCAB == llm.engine.vocab_size
    return n


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--served-model-name", MODEL,
            "--max-model-len", "256", "--num-kv-blocks", "64"]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(model_dir, log, *args)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def reference(llm, num_known) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt's greedy completion; every one mixes both kinds of id."""
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    ref = []
    for out in outs:
        ids = out.outputs[0].token_ids
        assert any(t >= num_known for t in ids) and any(t < num_known for t in ids), ids
        ref.append((out.outputs[0].text, ids))
    return ref


def known_text(llm, ids: list[int], num_known: int) -> str:
    return llm.tokenizer.decode([t for t in ids if t < num_known])


def stop_across_unknown(text: str, llm, ids: list[int], num_known: int) -> str:
    """A two-character stop string whose characters come from the tokens either side of an
    unknown id, so it only matches if that id is no text at all."""
    for i in range(1, len(ids) - 1):
        if ids[i] >= num_known > max(ids[i - 1], ids[i + 1]):
            cut = len(known_text(llm, ids[:i], num_known))
            stop = text[cut - 1 : cut + 1]
            if len(stop) == 2 and "\ufffd" not in stop and stop.strip():
                return stop
    raise AssertionError(f"no unknown id between two printable tokens in {ids}")


# -- LLM.generate ---------------------------------------------------------------------------------


def test_llm_text_and_logprobs(llm, reference, num_known):
    for text, ids in reference:
        assert text == known_text(llm, ids, num_known)
    # A padding id in the prompt too: its prompt logprob entry decodes to "".
    prompt = [*llm.tokenizer(PROMPTS[0])["input_ids"], num_known + 5, 10]
    (out,) = llm.generate([prompt], greedy(logprobs=2, prompt_logprobs=1), use_tqdm=False)
    (completion,) = out.outputs
    assert completion.text == known_text(llm, completion.token_ids, num_known)
    for token_id, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert len(entry) in (2, 3)  # the top 2 and the sampled token (if not among them)
        for t, lp in entry.items():
            assert lp.decoded_token == ("" if t >= num_known else llm.tokenizer.decode([t]))
        assert token_id in entry
    assert out.prompt_logprobs[-2][num_known + 5].decoded_token == ""


def test_llm_stop_string_across_an_unknown_id(llm, reference, num_known):
    text, ids = reference[0]
    stop = stop_across_unknown(text, llm, ids, num_known)
    (out,) = llm.generate([PROMPTS[0]], greedy(stop=[stop]), use_tqdm=False)
    assert out.outputs[0].text == text[: text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


# -- the server ---------------------------------------------------------------------------------------


def post(server, path: str, **body):
    status, resp = server.post(path, {"model": MODEL, "temperature": 0, "ignore_eos": True, **body})
    assert status == 200, resp
    return resp


def test_completions_stream_and_not(server, llm, reference, num_known):
    for prompt, (text, ids) in zip(PROMPTS, reference, strict=True):
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "logprobs": 1}
        (choice,) = post(server, "/v1/completions", **body, return_token_ids=True)["choices"]
        assert choice["token_ids"] == ids and choice["text"] == text
        tokens = choice["logprobs"]["tokens"]
        assert tokens == ["" if t >= num_known else llm.tokenizer.decode([t]) for t in ids]
        events = server.stream(
            "/v1/completions",
            {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": True, **body},
        )
        assert events[-1] == "[DONE]"
        chunks = [e["choices"][0] for e in events[:-1]]
        assert "".join(c["text"] for c in chunks) == text
        assert [t for c in chunks for t in c["logprobs"]["tokens"]] == tokens
        assert chunks[-1]["finish_reason"] == "length"


def test_chat_stream_and_not_end_with_their_closing_chunk(server, num_known):
    body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip
    resp = post(server, "/v1/chat/completions", **body, return_token_ids=True)
    (choice,) = resp["choices"]
    ids = choice["token_ids"]
    assert any(t >= num_known for t in ids), ids
    content = choice["logprobs"]["content"]
    assert [c["token"] == "" for c in content] == [t >= num_known for t in ids]
    assert all(c["bytes"] == [] for c in content if c["token"] == "")
    assert choice["finish_reason"] == "length"
    events = server.stream(
        "/v1/chat/completions",
        {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": True, **body},
    )
    assert events[-1] == "[DONE]"
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[-1]["delta"] == {} and chunks[-1]["finish_reason"] == "length"
    text = "".join(c["delta"].get("content", "") for c in chunks)
    assert text == choice["message"]["content"]


def test_server_stop_strings_across_an_unknown_id(server, llm, reference, num_known):
    text, ids = reference[1]
    stop = stop_across_unknown(text, llm, ids, num_known)
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "stop": [stop]}
    (choice,) = post(server, "/v1/completions", **body)["choices"]
    assert choice["text"] == text[: text.index(stop)] and choice["stop_reason"] == stop
    events = server.stream(
        "/v1/completions",
        {"model": MODEL, "temperature": 0, "ignore_eos": True, "stream": True, **body},
    )
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_echo_and_prompt_logprobs_of_an_unknown_prompt_id(server, llm, num_known):
    prompt = [*llm.tokenizer(PROMPTS[2])["input_ids"], num_known + 9]
    body = {"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 0}
    (choice,) = post(server, "/v1/completions", **body)["choices"]
    assert choice["text"].startswith(PROMPTS[2])
    assert choice["logprobs"]["tokens"][len(prompt) - 1] == ""
    assert choice["prompt_logprobs"][-1][str(num_known + 9)]["decoded_token"] == ""
