"""The server's pure parts, without processes: wire messages, incremental detokenization and
stop strings, request parsing, logprob shapes, metric counters."""

from __future__ import annotations

import random

import msgpack
import pytest

from tp_engine.frontend.detokenizer import IncrementalDetokenizer
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.logprob_format import LogprobFormatter, cut_top
from tp_engine.server.api.metrics import ServerMetrics
from tp_engine.server.api.prompts import PromptBuilder, check_max_tokens
from tp_engine.server.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tp_engine.server.messages import (
    AbortRequest,
    AddRequest,
    Control,
    ControlReply,
    Dead,
    Delta,
    Drain,
    EngineOutputs,
    EngineStats,
    Exit,
    Hello,
    MessageError,
    Ready,
    Rejected,
    TokenLogprobs,
    decode,
    encode,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tp_engine.testing import build_tokenizer

    return build_tokenizer(tmp_path_factory.mktemp("tok"))


# -- messages -------------------------------------------------------------------------------------

STATS = EngineStats(2, 1, 0.25, 100, 32, 0)
MESSAGES = [
    Hello("/m", ["a", "b"], 4096, 151936, {"temperature": 0.7}, None, 4),
    Ready(8000),
    AddRequest("cmpl-1-0", [1, 2, 3], {"n": 2, "stop": ["x"], "seed": None}),
    AbortRequest("cmpl-1-0", [1], True),
    AbortRequest("cmpl-1-0", None, False),
    EngineOutputs(
        ["a"],
        [Rejected("b", 400, "too long")],
        [
            Delta("a", 0, [5], None, None, 3, 0.01, [TokenLogprobs([5, 6], [-0.1, -2.0], 1)],
                  None),
            Delta("a", 1, [7, 8], "stop", 8, None, None, None,
                  [None, TokenLogprobs([4], [-1.5], 3)]),
        ],
        STATS,
    ),
    Drain(10.0),
    Dead("rank 1 failed at step 3"),
    Exit(1),
    Control(7, "update_weights_from_distributed", {"names": ["a"], "shapes": [[2, 3]]}),
    ControlReply(7, 400, "rank 2 refused: unknown name 'a'", {}),
    Hello("/m", ["a"], 4096, 151936, {}, None, 1, enable_weight_updates=True),
    Hello("/m", ["a"], 4096, 151936, {}, None, 1, supported_tasks=["embed", "score"],
          pooled_size=1024, is_matryoshka=True),
    AddRequest("embd-1-0", [1, 2], {}, {"task": "embed", "dimensions": 4}),
    EngineOutputs(
        ["a"], [], [Delta("a", 0, [], "stop", None, 0, 0.0, None, None, b"\x00\x00\x80?")], STATS
    ),
]  # fmt: skip


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1 not msgpack",
        msgpack.packb("hello"),
        msgpack.packb([99, 1]),
        msgpack.packb({"kind": "Ready"}),  # a field missing
        msgpack.packb(
            {
                "kind": "EngineOutputs",
                "accepted": [],
                "rejected": [[1]],
                "deltas": [],
                "stats": [0, 0, 0.0, 0, 0, 0],
            }
        ),
    ],
)
def test_anything_else_is_refused(frame):
    with pytest.raises(MessageError):
        decode(frame)


# -- detokenizer ------------------------------------------------------------------------------------


def run(detok, ids, *, engine_stopped=False, chunk=1):
    out = ""
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        out += detok.update(ids[i : i + chunk], engine_stopped and last, last)
        if detok.finished:
            break
    return out


def test_incremental_text_equals_a_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 25))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        text = run(detok, ids, chunk=rng.randint(1, 3))
        assert text == detok.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_ids_the_tokenizer_does_not_know_are_empty_text(tokenizer):
    """Checkpoints pad the LM head past the tokenizer (Qwen3: 151936 rows, 151669 tokens); such
    an id used to raise TypeError in convert_tokens_to_string (a 500, or a stream cut short)."""
    unknown = len(tokenizer) + 7
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(tokenizer) + 20) for _ in range(rng.randint(1, 20))]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        text = run(detok, ids, chunk=rng.randint(1, 3))
        known = [t for t in ids if t < len(tokenizer)]
        assert text == detok.text == tokenizer.decode(known, skip_special_tokens=skip)
    # A stop string across an unknown id still matches: the id is no text at all.
    hello, world = tokenizer("Hello")["input_ids"], tokenizer(" world")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["o w"])
    assert run(detok, [*hello, unknown, *world]) == "Hell"
    assert detok.stop_string == "o w" and detok.finished


def test_stop_strings_spanning_tokens_cut_the_text_and_are_never_streamed(tokenizer):
    ids = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, stop=["fox jumps", "zzz"])
    pieces = [detok.update([t], False, False) for t in ids]
    assert detok.finished and detok.stop_string == "fox jumps"
    assert "".join(pieces) == "The quick brown "
    assert not any("f" in p for p in pieces)
    detok = IncrementalDetokenizer(tokenizer, stop=["fox jumps"], include_stop_str_in_output=True)
    assert run(detok, ids) == "The quick brown fox jumps"


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = tokenizer("ab ab ab ab")["input_ids"]
    # As in vLLM, only text that arrives once min_tokens is reached is searched.
    detok = IncrementalDetokenizer(tokenizer, stop=["ab"], min_tokens=len(ids))
    assert run(detok, ids) == "ab ab ab " and detok.stop_string == "ab"
    detok = IncrementalDetokenizer(tokenizer, stop=["zz"], min_tokens=len(ids))
    assert run(detok, ids) == "ab ab ab ab"


def test_the_engines_stop_token_is_counted_but_not_shown(tokenizer):
    ids = tokenizer("Hello world")["input_ids"]
    stop_id = tokenizer("!")["input_ids"][0]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert run(detok, [*ids, stop_id], engine_stopped=True) == "Hello world"
    assert detok.token_ids == [*ids, stop_id]


# -- request parsing ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
        (b'{"prompt": "x", "temperature": true}', "temperature"),
        (b'{"prompt": ["x", 1]}', "prompt"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
        ),
        (b'{"max_tokens": 1}', "prompt"),
        (b"[]", None),
        (b"{", None),
        (b"  ", None),
    ],
)
def test_parse_errors_are_400s_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_body(CompletionRequest, body)
    assert info.value.status == 400 and info.value.param == param


def test_requests_accept_openai_and_vllm_fields():
    req = parse_body(
        ChatCompletionRequest,
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],'
        b' "max_completion_tokens": 5, "top_k": 3, "min_tokens": 1, "user": "ignored", "x": 1}',
    )
    assert req.max_completion_tokens == 5 and req.top_k == 3 and req.min_tokens == 1
    req = parse_body(CompletionRequest, b'{"prompt": [[1, 2], [3]], "temperature": 0}')
    assert req.prompt == [[1, 2], [3]] and req.temperature == 0.0


# -- logprobs, metrics ----------------------------------------------------------------------------------


def test_logprob_shapes(tokenizer):
    fmt = LogprobFormatter(tokenizer)
    a, b = tokenizer("Hi there")["input_ids"][:2]
    entries = [TokenLogprobs([a, b, a], [-0.5, -0.2, -0.5], 2),
               TokenLogprobs([b, b, a], [-0.1, -0.1, -3.0], 1)]  # fmt: skip
    comp = fmt.completion(entries)
    assert comp["token_logprobs"] == [-0.5, -0.1]
    assert comp["text_offset"] == [0, len(tokenizer.decode([a]))]
    assert comp["top_logprobs"][0] == {tokenizer.decode([a]): -0.5, tokenizer.decode([b]): -0.2}
    chat = fmt.chat(entries)["content"]
    assert [len(t["top_logprobs"]) for t in chat] == [2, 2]
    assert chat[0]["bytes"] == list(tokenizer.decode([a]).encode())
    prompt = fmt.prompt([None, entries[0]])
    assert prompt[0] is None and prompt[1][str(a)]["rank"] == 2 and prompt[1][str(b)]["rank"] == 1


def test_unknown_ids_in_logprobs_are_empty_strings(tokenizer):
    fmt = LogprobFormatter(tokenizer)
    a, unknown = tokenizer("Hi")["input_ids"][0], len(tokenizer) + 3
    text = tokenizer.decode([a])
    entries = [TokenLogprobs([unknown, a], [-0.5, -0.2], 2)]
    comp = fmt.completion(entries)
    assert comp["tokens"] == [""] and comp["top_logprobs"] == [{"": -0.5, text: -0.2}]
    (chat,) = fmt.chat(entries)["content"]
    assert chat["token"] == "" and chat["bytes"] == [] and chat["top_logprobs"][0]["token"] == text
    assert fmt.prompt([None, entries[0]])[1][str(unknown)]["decoded_token"] == ""


def test_echoed_logprobs_put_the_prompt_first(tokenizer):
    """vLLM's echo shape: the prompt's tokens, the first with null logprob and top_logprobs,
    then the generated ones; text offsets run on through both."""
    fmt = LogprobFormatter(tokenizer)
    p0, p1, g = tokenizer("Hi there now")["input_ids"][:3]
    prompt_entries = [None, TokenLogprobs([p1, g, p0], [-1.0, -0.5, -2.0], 2)]
    echo = ([p0, p1], cut_top(prompt_entries, num_top=1))
    comp = fmt.completion([TokenLogprobs([g], [-0.25], 1)], echo=echo)
    texts = [tokenizer.decode([t]) for t in (p0, p1, g)]
    assert comp["tokens"] == texts
    assert comp["token_logprobs"] == [None, -1.0, -0.25]
    # Cut to the chosen token and the top 1, as `logprobs: 1` asks.
    assert comp["top_logprobs"] == [None, {texts[1]: -1.0, texts[2]: -0.5}, {texts[2]: -0.25}]
    assert comp["text_offset"] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]


def test_max_tokens_0_only_with_echo_and_echo_asks_for_prompt_logprobs(tokenizer):
    builder = PromptBuilder(tokenizer, Hello("/m", ["m"], 64, 700, {}, None, 1))
    for body in (b'{"prompt": "x", "max_tokens": 0}',):
        with pytest.raises(APIError) as info:
            check_max_tokens(parse_body(CompletionRequest, body))
        assert info.value.status == 400 and info.value.param == "max_tokens"
    chat = b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}'
    with pytest.raises(APIError) as info:
        check_max_tokens(parse_body(ChatCompletionRequest, chat))
    assert info.value.param == "max_completion_tokens"
    req = parse_body(
        CompletionRequest, b'{"prompt": "x", "max_tokens": 0, "echo": true, "logprobs": 2}'
    )
    check_max_tokens(req)
    params = builder.sampling_params(req, 0)
    assert params.max_tokens == 0 and params.logprobs == 2 and params.prompt_logprobs == 2
    req = parse_body(CompletionRequest, b'{"prompt": "x", "logprobs": 2}')
    assert builder.sampling_params(req, 1).prompt_logprobs is None  # no echo: not computed


def test_tokenizer_info_has_what_lm_eval_reads(tokenizer):
    info = PromptBuilder(tokenizer, Hello("/m", ["m"], 64, 700, {}, None, 1)).tokenizer_info()
    assert info["eos_token"] == "<|im_end|>" and info["pad_token"] == "<|endoftext|>"
    assert info["bos_token"] is None and info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 64 and info["tokenizer_class"]


def test_engine_counters_advance_by_their_difference():
    metrics = ServerMetrics("m")
    metrics.set_engine_stats(EngineStats(1, 2, 0.5, 100, 30, 1))
    metrics.set_engine_stats(EngineStats(0, 0, 0.0, 150, 30, 1))
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert value("vllm:prefix_cache_queries_total", labels) == 150
    assert value("vllm:prefix_cache_hits_total", labels) == 30
    assert value("vllm:num_preemptions_total", labels) == 1
    assert value("vllm:num_requests_running", labels) == 0
    assert value("vllm:kv_cache_usage_perc", labels) == 0


def test_host_tier_counters_and_gauge() -> None:
    """The host-memory KV tier's figures under vLLM's external prefix-cache names."""
    metrics = ServerMetrics("m")
    tier = dict(external_prefix_cache_queries=80, external_prefix_cache_hits=48)
    metrics.set_engine_stats(EngineStats(1, 0, 0.5, 100, 30, 0, **tier, host_kv_cache_usage=0.25))
    tier = dict(external_prefix_cache_queries=120, external_prefix_cache_hits=64)
    metrics.set_engine_stats(EngineStats(0, 0, 0.0, 150, 30, 0, **tier, host_kv_cache_usage=0.5))
    value = metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert value("vllm:external_prefix_cache_queries_total", labels) == 120
    assert value("vllm:external_prefix_cache_hits_total", labels) == 64
    assert value("tp_engine:host_kv_cache_usage_perc", labels) == 0.5


class _Client:
    """What a Generation reads of its engine client when it applies deltas."""

    def __init__(self) -> None:
        self.metrics = ServerMetrics("m")
        self.aborted: list[str] = []

    def abort(self, request_id, sample_indices=None, *, stopped=False) -> None:
        self.aborted.append(request_id)


def test_token_metrics_count_output_tokens_one_by_one(tokenizer, monkeypatch):
    """Multi-token deltas (speculative decoding): generation tokens count the tokens output,
    not those after a stop string, and inter-token latency is observed once per token after
    the first (a delta's gap spread over its tokens), summing to the decode time."""
    from tp_engine.sampling_params import SamplingParams
    from tp_engine.server.api import generation
    from tp_engine.server.api.generation import Generation, PromptInput, StopOptions

    ids = tokenizer("The quick brown fox jumps over the lazy dog")["input_ids"]
    clock = [100.0]
    monkeypatch.setattr(generation.time, "monotonic", lambda: clock[0])
    client = _Client()
    stop = StopOptions(["fox jumps"], False, True, 0)
    gen = Generation(client, tokenizer, "r", [PromptInput([1, 2])], lambda p: SamplingParams(), 2,
                     stop)  # fmt: skip
    first, second = gen.choices

    def apply(choice, tokens, at):
        clock[0] = at
        return gen._apply(choice, Delta("r-0", choice.sample_index, tokens, None, None, None,
                                        None, None, None))  # fmt: skip

    apply(first, ids[:1], 101.0)
    apply(first, ids[1:4], 101.3)  # 3 tokens 0.3 s later: 0.1 s each
    # " fox", " jum", "ps" end the stop string: " over", " the", " laz" are never output.
    update = apply(first, ids[4:10], 101.9)
    assert update.token_ids == ids[4:7] and first.finish_reason == "stop"
    value = client.metrics.registry.get_sample_value
    labels = {"model_name": "m"}
    assert value("vllm:generation_tokens_total", labels) == 7
    assert value("vllm:inter_token_latency_seconds_count", labels) == 6
    assert value("vllm:inter_token_latency_seconds_sum", labels) == pytest.approx(0.9)
    assert value("vllm:inter_token_latency_seconds_bucket", {**labels, "le": "0.1"}) == 3
    # A first delta of 3 tokens: its later 2 came with the first, no gap.
    apply(second, ids[:3], 102.0)
    assert value("vllm:generation_tokens_total", labels) == 10
    assert value("vllm:inter_token_latency_seconds_count", labels) == 8
    assert value("vllm:inter_token_latency_seconds_sum", labels) == pytest.approx(0.9)
    assert value("vllm:time_to_first_token_seconds_count", labels) == 2


def test_waiting_for_the_api_process_stops_when_asked():
    # Start-up waits for the API process to connect; a stop signal (or its death) must end
    # the wait at once rather than after the start-up timeout.
    import time

    from tp_engine.server.ipc import EnginePipes, RunDir
    from tp_engine.server.messages import Exit

    run_dir = RunDir.create()
    pipes = EnginePipes(run_dir)
    try:
        stop_at = time.monotonic() + 0.2
        start = time.monotonic()
        sent = pipes.send_once_connected(
            Exit(0), keep_waiting=lambda: time.monotonic() < stop_at, timeout_s=300
        )
        assert not sent and time.monotonic() - start < 60
    finally:
        pipes.close()
        run_dir.remove()


def test_control_ops_answer_refusals_400_and_an_inconsistent_engine_503():
    """An operation's refusal is a 400 and a failed commit (a trainer killed mid-broadcast) a
    503 with the engine kept (a full load repairs it); a dead engine is not caught."""
    from types import SimpleNamespace

    from tp_engine.common.failures import EngineDeadError
    from tp_engine.executor.control import ControlRefusedError, EngineInconsistentError
    from tp_engine.server.rank0.control_ops import run_op

    def engine_raising(exc):
        def update(*args, **kwargs):
            raise exc

        return SimpleNamespace(update_weights_from_disk=update)

    refused = run_op(engine_raising(ControlRefusedError("rank 1: 'x' has shape (2,)")),
                     "update_weights_from_disk", {"model_path": "/m"})  # fmt: skip
    assert (refused.status, refused.message) == (400, "rank 1: 'x' has shape (2,)")
    broken = EngineInconsistentError("commit failed", SimpleNamespace(step_id=3))
    outcome = run_op(engine_raising(broken), "update_weights_from_disk", {"model_path": "/m"})
    assert outcome.status == 503 and "commit failed" in outcome.message
    assert run_op(engine_raising(None), "no_such_op", {}).status == 400
    assert run_op(engine_raising(None), "update_weights_from_disk", {}).message == (
        "missing 'model_path'"
    )
    with pytest.raises(EngineDeadError):
        run_op(engine_raising(EngineDeadError("rank 1 died")), "update_weights_from_disk",
               {"model_path": "/m"})  # fmt: skip
