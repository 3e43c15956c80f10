"""Qwen3 chat as its users run it, through the official `openai` client: thinking split into
`reasoning_content` (`--reasoning-parser qwen3`), tool calls in Qwen3's Hermes format
(`--enable-auto-tool-choice --tool-call-parser hermes`), the template's arguments, a thinking
budget, and the checkpoint's sampling defaults.

The model is scripted (`tests/scripted_model.py`): each user message carries a selector token
(`<s:NAME>`), and the checkpoint's weights make the model say `SCRIPTS[NAME]`, token by token,
even at Qwen3's sampling defaults. One server (one rank) serves the whole module; every case
runs streamed and not, and the two must agree.

`test_thinking_token_budget_*` and `test_llm_chat_thinking_budget` wait on the engine forcing
`</think>` (`tp_engine.common.thinking.forced_think_end`); until it does, they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from tests.scripted_model import END_THINK, IM_END, THINK, Script, Switch, build_scripted_checkpoint
from tests.server_harness import REPO_ROOT, Server, serving

pytestmark = pytest.mark.slow

MODEL = "scripted-qwen3"

SCRIPTS = {
    # Thinking on (the template leaves it to the model, which opens <think> itself).
    "think": (THINK, "\nThe user greets me", ", so I greet back.\n", END_THINK,
              "\n\nHello! How can I help?", IM_END),
    # Thinking opened by the template (chat_template_kwargs thinking_in_prompt).
    "think_open": ("Thinking began", " in the prompt.\n", END_THINK,
                   "\n\nAn answer after a prompt-opened think.", IM_END),
    # Thinking off (enable_thinking false): a stray </think> in the answer is content.
    "no_think": ("The answer is 4.", END_THINK, " A stray close tag is content.", IM_END),
    # Long thinking: cut by max_tokens, or by a thinking budget.
    "long_think": (THINK, "\nStep one.", " Step two.", " Step three.", " Step four.", END_THINK,
                   "\n\nDone thinking.", IM_END),
    # One call, its arguments arriving in fragments (a string split across tokens).
    "one_call": (THINK, "\nThe weather needs a tool.\n", END_THINK, "<tool_call>",
                 '\n{"name": "get_weather", ', '"arguments": {"city": ', '"Paris', ' Nord"',
                 ', "unit": "celsius"}}\n', "</tool_call>", IM_END),
    # Two calls (each body switches the script, so <tool_call> can come again).
    "two_calls": ("Checking both.", "<tool_call>",
                  Switch('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'),
                  "</tool_call>", "<tool_call>",
                  Switch('\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'),
                  "</tool_call>", IM_END),
    # A call written inside the thinking is thinking.
    "call_in_think": (THINK, "\nMaybe I should call ", "<tool_call>",
                      '{"name": "get_weather", "arguments": {"city": "Oslo"}}', "</tool_call>",
                      "\nNo, I know it.\n", END_THINK, "\n\nIt is sunny.", IM_END),
    # Malformed calls: not JSON; JSON missing its last brace; a function nobody declared.
    "malformed": ("<tool_call>", "\nget_weather(city='Paris')\n", "</tool_call>", IM_END),
    "unclosed_json": ("<tool_call>", '\n{"name": "get_time", "arguments": {"zone": "UTC"}\n',
                      "</tool_call>", IM_END),
    "unknown_function": ("<tool_call>", '\n{"name": "launch_rocket", "arguments": {}}\n',
                         "</tool_call>", IM_END),
    # tool_choice named and "required": the answer is constrained JSON, without markers; the
    # first thinks, and the constraint applies after its </think>.
    "forced_named": (THINK, "\nI need the weather.\n", END_THINK, '{"city": ', '"Rome',
                     ' Sud"', ', "unit": "celsius"}', IM_END),
    "forced_required": ('[{"name": "get_weather", "parameters": {"city": ', '"Oslo"}}',
                        ', {"name": "get_time", "parameters": {"zone": ', '"CET"}}]', IM_END),
    # After a tool result in the history.
    "after_tool": ("It is 18 degrees in Rome.", IM_END),
    # A fork: "heads" 2 logits above "tails" (sampling defaults cut "tails" with top_p 0.95).
    "fork": ("Pick:", " heads", IM_END),
}  # fmt: skip
RIVALS = {"fork": (1, " tails", -2.0)}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}},
]  # fmt: skip


def user(name: str, text: str = "Hi") -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{text} <s:{name}>"}]


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    scripts = [Script(f"<s:{name}>", pieces, RIVALS.get(name)) for name, pieces in SCRIPTS.items()]
    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted"), scripts)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--served-model-name", MODEL,
            "--max-model-len", "2048", "--num-kv-blocks", "256", "--reasoning-parser", "qwen3",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(model_dir, log, *args)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="none")


@dataclass
class Reply:
    """One choice, from a full reply or put together from a stream."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    usage: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)  # streamed deltas, in order


def ask(client, name: str, *, stream: bool, messages=None, **kwargs) -> Reply:
    """The reply to `messages` (default: the user message selecting script `name`)."""
    extra = kwargs.pop("extra_body", {})
    request = {"model": MODEL, "messages": messages or user(name), "max_tokens": 64, **kwargs}
    if not stream:
        resp = client.chat.completions.create(**request, extra_body=extra)
        (choice,) = resp.choices
        message = choice.message.model_dump()
        assert message["reasoning"] == message["reasoning_content"]
        return Reply(
            message["content"],
            message["reasoning_content"],
            [
                {"id": c["id"], "type": c["type"], **c["function"]}
                for c in message["tool_calls"] or []
            ],
            choice.finish_reason,
            resp.usage.model_dump(),
        )
    stream_resp = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    chunks, usage, finish = [], None, None
    for chunk in stream_resp:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            if delta:
                chunks.append(delta)
            finish = choice.finish_reason or finish
    reasoning = "".join(d.get("reasoning_content", "") for d in chunks)
    assert reasoning == "".join(d.get("reasoning", "") for d in chunks)
    content = "".join(d.get("content", "") for d in chunks)
    calls: dict[int, dict[str, Any]] = {}
    for d in chunks:
        for call in d.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"arguments": ""})
            fn = call.get("function", {})
            for key in ("id", "type"):
                if key in call:
                    entry[key] = call[key]
            if "name" in fn:
                entry["name"] = fn["name"]
            entry["arguments"] += fn.get("arguments", "")
    return Reply(
        content or None,
        reasoning or None,
        [calls[i] for i in sorted(calls)],
        finish,
        usage,
        chunks,
    )


def both(client, name: str, **kwargs) -> Reply:
    """The full reply, after checking that the streamed one says the same."""
    full = ask(client, name, stream=False, **kwargs)
    streamed = ask(client, name, stream=True, **kwargs)
    strip = [{k: v for k, v in c.items() if k != "id"} for c in full.tool_calls]
    assert [{k: v for k, v in c.items() if k != "id"} for c in streamed.tool_calls] == strip
    assert (streamed.content or None, streamed.reasoning, streamed.finish_reason) == (
        full.content or None,
        full.reasoning,
        full.finish_reason,
    )
    for key in ("completion_tokens", "completion_tokens_details"):
        assert streamed.usage[key] == full.usage[key]
    return full


# -- reasoning ------------------------------------------------------------------------------------


def test_thinking_is_reasoning_content_and_the_answer_content(client):
    reply = both(client, "think")
    assert reply.reasoning == "\nThe user greets me, so I greet back.\n"
    assert reply.content == "\n\nHello! How can I help?"
    assert reply.finish_reason == "stop" and reply.tool_calls == []
    # <think>, 2 thinking tokens, </think>, the answer, <|im_end|>.
    assert reply.usage["completion_tokens"] == 6
    assert reply.usage["completion_tokens_details"]["reasoning_tokens"] == 2


def test_reasoning_streams_first_then_content(client):
    reply = ask(client, "think", stream=True)
    kinds = [
        next(k for k in ("role", "reasoning_content", "content") if k in c) for c in reply.chunks
    ]
    assert kinds[0] == "role"
    assert kinds[1:] == ["reasoning_content"] * 2 + ["content"]
    assert all(c["reasoning"] == c["reasoning_content"] for c in reply.chunks[1:3])


def test_thinking_opened_by_the_template(client):
    reply = both(
        client, "think_open", extra_body={"chat_template_kwargs": {"thinking_in_prompt": True}}
    )
    assert reply.reasoning == "Thinking began in the prompt.\n"
    assert reply.content == "\n\nAn answer after a prompt-opened think."


def test_thinking_off_never_puts_the_answer_in_reasoning(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = both(client, "no_think", extra_body=off)
    assert reply.reasoning is None
    assert reply.content == "The answer is 4.</think> A stray close tag is content."
    assert reply.usage["completion_tokens_details"]["reasoning_tokens"] == 0


def test_output_cut_while_thinking_stays_reasoning(client):
    reply = both(client, "long_think", max_tokens=3)
    assert reply.reasoning == "\nStep one. Step two."
    assert reply.content is None and reply.finish_reason == "length"


def test_chunks_split_around_the_end_of_thinking(client):
    # A stop string holds back its length - 1 characters, so the streamed text arrives in
    # pieces that straddle the token boundaries, </think> included.
    stop = {"stop": ["#" * 11]}
    reply = both(client, "think", **stop)
    assert reply.reasoning == "\nThe user greets me, so I greet back.\n"
    assert reply.content == "\n\nHello! How can I help?"
    streamed = ask(client, "think", stream=True, **stop)
    kinds = [k for c in streamed.chunks[1:] for k in ("reasoning_content", "content") if k in c]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # reasoning, then content
    assert kinds.count("content") > 1  # the answer too came in pieces


# -- the thinking budget (waits on the engine forcing </think>) -----------------------------------


def test_thinking_token_budget_ends_thinking(client):
    reply = both(client, "long_think", extra_body={"thinking_token_budget": 2})
    assert reply.reasoning == "\nStep one. Step two."
    # The model saw </think> as its input: it went on with its answer.
    assert reply.content == "\n\nDone thinking." and reply.finish_reason == "stop"
    assert reply.usage["completion_tokens"] == 6


def test_thinking_token_budget_when_the_template_opened_thinking(client):
    extra = {"chat_template_kwargs": {"thinking_in_prompt": True}, "thinking_token_budget": 1}
    reply = both(client, "think_open", extra_body=extra)
    assert reply.reasoning == "Thinking began"
    assert reply.content == "\n\nAn answer after a prompt-opened think."


def test_thinking_token_budget_0_ends_thinking_at_once(client):
    reply = both(client, "long_think", extra_body={"thinking_token_budget": 0})
    assert reply.reasoning is None
    assert reply.content == "\n\nDone thinking."


def test_a_budget_larger_than_the_thinking_changes_nothing(client):
    reply = both(client, "long_think", extra_body={"thinking_token_budget": 10})
    assert reply.reasoning == "\nStep one. Step two. Step three. Step four."
    assert reply.content == "\n\nDone thinking."


# -- tool calls -----------------------------------------------------------------------------------


def test_one_tool_call(client):
    reply = both(client, "one_call", messages=user("one_call", "Weather in Paris?"), tools=TOOLS)
    assert reply.reasoning == "\nThe weather needs a tool.\n"
    assert reply.content is None and reply.finish_reason == "tool_calls"
    (call,) = reply.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris Nord", "unit": "celsius"}
    assert call["arguments"] == '{"city": "Paris Nord", "unit": "celsius"}'


def test_streamed_call_has_a_header_then_argument_fragments(client):
    reply = ask(client, "one_call", stream=True, tools=TOOLS)
    deltas = [call for c in reply.chunks for call in c.get("tool_calls", [])]
    header, *fragments = deltas
    assert header["index"] == 0 and header["type"] == "function"
    assert header["id"].startswith("call_") and header["function"]["name"] == "get_weather"
    assert len(fragments) >= 3  # the arguments arrived in pieces, as the model wrote them
    for fragment in fragments:
        assert fragment["index"] == 0 and set(fragment) == {"index", "function"}
        assert set(fragment["function"]) == {"arguments"}
    args = header["function"].get("arguments", "") + "".join(
        f["function"]["arguments"] for f in fragments
    )
    assert args == '{"city": "Paris Nord", "unit": "celsius"}'
    # A string value streams while it arrives, not only once complete.
    assert any(f["function"]["arguments"].endswith('"Paris') for f in fragments)


def test_two_tool_calls(client):
    reply = both(client, "two_calls", tools=TOOLS)
    assert reply.content == "Checking both." and reply.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c["id"] for c in reply.tool_calls}) == 2
    streamed = ask(client, "two_calls", stream=True, tools=TOOLS)
    headers = [call for c in streamed.chunks for call in c.get("tool_calls", []) if "id" in call]
    assert [h["index"] for h in headers] == [0, 1]


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    reply = both(client, "two_calls", tools=TOOLS, parallel_tool_calls=False)
    assert [c["name"] for c in reply.tool_calls] == ["get_weather"]
    assert reply.content == "Checking both."


def test_a_tool_call_inside_the_thinking_is_not_a_call(client):
    reply = both(client, "call_in_think", tools=TOOLS)
    assert reply.tool_calls == [] and reply.finish_reason == "stop"
    assert reply.reasoning == (
        '\nMaybe I should call <tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}</tool_call>\nNo, I know it.\n'
    )
    assert reply.content == "\n\nIt is sunny."


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("malformed", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
        ("unknown_function", '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'),
    ],
)  # fmt: skip
def test_a_malformed_call_comes_back_as_content(client, name, text):
    reply = both(client, name, tools=TOOLS)
    assert reply.tool_calls == [] and reply.finish_reason == "stop"
    assert reply.content == text


def test_a_call_whose_json_never_closes_is_content(client):
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}\n</tool_call>'
    reply = ask(client, "unclosed_json", stream=False, tools=TOOLS)
    assert reply.tool_calls == [] and reply.content == text and reply.finish_reason == "stop"
    # Streamed, its name went out before the JSON turned out unfinished (see tool_calls.py);
    # the text and the finish reason still agree.
    streamed = ask(client, "unclosed_json", stream=True, tools=TOOLS)
    assert streamed.content == text and streamed.finish_reason == "stop"


def test_tool_choice_none_leaves_the_call_in_the_content(client):
    reply = both(client, "one_call", tools=TOOLS, tool_choice="none")
    assert reply.tool_calls == [] and reply.finish_reason == "stop"
    assert reply.reasoning == "\nThe weather needs a tool.\n"
    assert reply.content == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris Nord", '
        '"unit": "celsius"}}\n</tool_call>'
    )


def test_a_named_tool_choice_makes_the_answer_its_arguments(client):
    # The constraint (structured outputs) makes the answer the function's arguments, after the
    # thinking; the reply has one call to it, and keeps finish_reason "stop", as OpenAI does.
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = both(client, "forced_named", tools=TOOLS, tool_choice=choice)
    assert reply.reasoning == "\nI need the weather.\n" and reply.content is None
    assert [(c["name"], c["arguments"]) for c in reply.tool_calls] == [
        ("get_weather", '{"city": "Rome Sud", "unit": "celsius"}')
    ]
    assert reply.finish_reason == "stop"
    streamed = ask(client, "forced_named", stream=True, tools=TOOLS, tool_choice=choice)
    calls = [d["tool_calls"][0] for d in streamed.chunks if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"]
    assert len(calls) > 2 and all(set(c) == {"index", "function"} for c in calls[1:])


@pytest.mark.parametrize("parallel", [None, False])
def test_required_tool_choice_makes_the_answer_a_list_of_calls(client, parallel):
    kwargs = {} if parallel is None else {"parallel_tool_calls": parallel}
    reply = both(client, "forced_required", tools=TOOLS, tool_choice="required", **kwargs)
    calls = [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CET"}')]
    # parallel_tool_calls false: the schema allows one call (the model must close the list).
    want = calls[:1] if parallel is False else calls
    assert [(c["name"], c["arguments"]) for c in reply.tool_calls] == want
    assert reply.content is None and reply.finish_reason == "tool_calls"


def test_tool_history_goes_through_the_template(client, server):
    messages = [
        *user("after_tool", "Weather in Rome?"),
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]  # fmt: skip
    reply = both(client, "after_tool", messages=messages, tools=TOOLS)
    assert reply.content == "It is 18 degrees in Rome." and reply.tool_calls == []
    status, resp = server.post("/tokenize", {"model": MODEL, "messages": messages, "tools": TOOLS})
    assert status == 200, resp
    status, text = server.post("/detokenize", {"model": MODEL, "tokens": resp["tokens"]})
    prompt = text["prompt"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in prompt
    assert '"name": "get_time"' in prompt  # the tools, in the system prompt


def test_a_reply_with_calls_goes_back_into_the_history(client, server):
    """The loop of docs/serving.md: the assistant message as the client got it, then the tool's result."""
    messages = user("one_call", "Weather?")
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    message = reply.choices[0].message
    (call,) = message.tool_calls
    messages += [
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C"},
    ]
    again = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"  # the script calls again
    status, resp = server.post("/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, resp
    _, text = server.post("/detokenize", {"tokens": resp["tokens"]})
    assert (
        "<|im_start|>assistant\n<think>\n\nThe weather needs a tool.\n\n</think>\n\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris Nord", "unit": "celsius"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response>"
    ) in text["prompt"]


def test_template_arguments_reach_the_template(server):
    base = {"model": MODEL, "messages": user("think")}
    cases = {
        "chat_template_kwargs": ({"chat_template_kwargs": {"enable_thinking": False}},
                                 "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "documents": ({"documents": [{"title": "Doc", "text": "Facts."}]},
                      '<document>{"title": "Doc", "text": "Facts."}</document>'),
        "add_generation_prompt": ({"add_generation_prompt": False}, None),
    }  # fmt: skip
    for name, (extra, expected) in cases.items():
        status, resp = server.post("/tokenize", {**base, **extra})
        assert status == 200, (name, resp)
        _, text = server.post("/detokenize", {"tokens": resp["tokens"]})
        if expected is None:
            assert not text["prompt"].endswith("<|im_start|>assistant\n"), name
        else:
            assert expected in text["prompt"], name
    # continue_final_message: the prompt ends inside the assistant's message.
    messages = [*user("think"), {"role": "assistant", "content": "<think>\nPartly"}]
    status, resp = server.post(
        "/tokenize", {"model": MODEL, "messages": messages, "continue_final_message": True,
                      "add_generation_prompt": False}
    )  # fmt: skip
    _, text = server.post("/detokenize", {"tokens": resp["tokens"]})
    assert text["prompt"].endswith("<|im_start|>assistant\n<think>\nPartly")


# -- sampling defaults ----------------------------------------------------------------------------


def test_generation_config_defaults_apply_to_chat(client):
    """The fork's "tails" is 2 logits below "heads": at temperature 1 with top_p 1 it comes up
    about one time in eight; at the checkpoint's defaults (temperature 0.6, top_p 0.95, top_k
    20) "heads" alone reaches top_p, so "tails" never does."""
    body = dict(model=MODEL, messages=user("fork"), max_tokens=4, n=64, seed=1)
    defaults = client.chat.completions.create(**body)
    assert {c.message.content for c in defaults.choices} == {"Pick: heads"}
    explicit = client.chat.completions.create(**body, temperature=1.0, top_p=1.0)
    assert {c.message.content for c in explicit.choices} == {"Pick: heads", "Pick: tails"}


# -- bad input ------------------------------------------------------------------------------------

BAD_SCHEMA = [{"type": "function", "function": {
    "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strng"}}}}}]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"tools": BAD_SCHEMA}, "tools.0.function.parameters"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
         "tools.0.function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"extra_body": {"thinking_token_budget": -1}}, "thinking_token_budget"),
        ({"extra_body": {"thinking_token_budget": "many"}}, "thinking_token_budget"),
        ({"extra_body": {"chat_template_kwargs": {"tokenize": True}}}, "chat_template_kwargs"),
    ],
    ids=["bad-schema", "no-name", "duplicate", "unknown-function", "unknown-choice",
         "required-without-tools", "negative-budget", "string-budget", "reserved-kwarg"],
)  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=user("think"), **kwargs)
    assert info.value.param == param, info.value.body


def test_unknown_parser_names_stop_start_up(tmp_path):
    for flags, words in [
        (["--reasoning-parser", "deepthink"], ["--reasoning-parser", "deepthink", "qwen3"]),
        (["--tool-call-parser", "json"], ["--tool-call-parser", "json", "hermes"]),
        (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice", "--tool-call-parser"]),
    ]:
        proc = subprocess.run(
            [sys.executable, "launch/serve.py", *flags], cwd=REPO_ROOT, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert all(w in proc.stderr for w in words), proc.stderr


def test_a_tokenizer_without_think_tokens_stops_start_up(tmp_path):
    from tp_engine.testing import build_random_qwen3

    plain = build_random_qwen3(
        tmp_path / "plain", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, intermediate_size=32,
    )  # fmt: skip
    args = ["--model", str(plain), "--port", "0", "--reasoning-parser", "qwen3",
            "--num-kv-blocks", "16", "--max-model-len", "128"]  # fmt: skip
    log = tmp_path / "server.log"
    srv = Server([sys.executable, "launch/serve.py", *args], dict(os.environ), log)
    try:
        assert srv.proc.wait(timeout=180) != 0
    finally:
        srv.stop()
    assert "--reasoning-parser qwen3: the tokenizer has no '<think>' token" in srv.log()


# -- LLM.chat -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(model_dir):
    from tp_engine import LLM

    engine = LLM(str(model_dir), max_model_len=2048, num_kv_blocks=128, block_size=16)
    yield engine
    engine.shutdown()


def test_llm_chat_takes_tools_documents_and_template_kwargs(llm):
    from tp_engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=16, skip_special_tokens=False)
    (out,) = llm.chat(
        user("no_think"), greedy, use_tqdm=False, tools=TOOLS,
        documents=[{"text": "Facts."}], chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert '"name": "get_weather"' in out.prompt and '{"text": "Facts."}' in out.prompt
    assert out.outputs[0].text == "The answer is 4.</think> A stray close tag is content."


def test_llm_chat_thinking_budget(llm):
    from tp_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, thinking_token_budget=2)
    (out,) = llm.chat(user("long_think"), params, use_tqdm=False)
    ids = llm.tokenizer.convert_tokens_to_ids
    expected = [THINK, "\nStep one.", " Step two.", END_THINK, "\n\nDone thinking.", IM_END]
    assert out.outputs[0].token_ids == [ids(t) for t in expected]
    # `generate` with the same prompt and a bare budget: the engine finds the think tokens.
    (again,) = llm.generate([out.prompt_token_ids], params, use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
