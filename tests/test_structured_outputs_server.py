"""Structured outputs through the official `openai` client, streamed and not: OpenAI's
`response_format`, vLLM's `structured_outputs` and `guided_*`, the constraint after the
thinking (`--reasoning-parser qwen3`), and tool_choice "required" or a named function enforced
by a schema built from the tools (`--enable-auto-tool-choice --tool-call-parser hermes`).

The model has random weights and decodes greedily, so whatever it says is arbitrary: only the
constraint makes it valid. Schemas are bounded (enums, booleans, integers with a range, strings
with maxLength, arrays with maxItems), so that every output completes within max_tokens. The
tokenizer is the demo's BPE with Qwen3's markup tokens and a Qwen3-like chat template
(`tests/scripted_model.py`). One server (one rank) serves the whole module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import openai
import pytest

from tests.scripted_model import MARKUP_TOKENS, QWEN3_LIKE_TEMPLATE
from tests.server_harness import serving

pytestmark = pytest.mark.slow

MODEL = "random-qwen3"
MAX_TOKENS = 96

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "admin": {"type": "boolean"},
        "role": {"enum": ["user", "staff", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "role", "tags"],
}
CODE = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
# xgrammar's EBNF; the same language as a regex, to check the output.
GRAMMAR = 'root ::= ("yes" | "no") ", " [0-9] [0-9]?'
GRAMMAR_RE = r"(yes|no), [0-9][0-9]?"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    # Its $defs move to the root of the "required" schema, where the $ref points.
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}},
                       "required": ["zone"], "$defs": {"Zone": {"enum": ["UTC", "CET", "JST"]}}}}},
]  # fmt: skip
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from tp_engine.demo import DEMO_SHAPE
    from tp_engine.testing import build_random_qwen3

    # Rows for the markup tokens (added below), as Qwen3's vocabulary exceeds its tokenizer.
    out = build_random_qwen3(tmp_path_factory.mktemp("model"), vocab_size=704, **DEMO_SHAPE)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tok.chat_template = QWEN3_LIKE_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    args = ["--served-model-name", MODEL,
            "--max-model-len", "1024", "--num-kv-blocks", "128", "--reasoning-parser", "qwen3",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # fmt: skip
    log = tmp_path_factory.mktemp("log") / "server.log"
    yield from serving(model_dir, log, *args)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="none")


# -- helpers --------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One chat choice, from a full reply or put together from a stream."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    call_deltas: list[dict[str, Any]] = field(default_factory=list)  # streamed, in order


def chat(client, *, stream: bool, extra_body=None, **kwargs) -> Reply:
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about a person."}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **kwargs,
    }
    extra = {**NO_THINKING, **(extra_body or {})}
    if not stream:
        (choice,) = client.chat.completions.create(**request, extra_body=extra).choices
        message = choice.message.model_dump()
        calls = [{"id": c["id"], **c["function"]} for c in message["tool_calls"] or []]
        return Reply(message["content"], message["reasoning_content"], calls, choice.finish_reason)
    chunks = client.chat.completions.create(**request, stream=True, extra_body=extra)
    content, reasoning, deltas, finish = "", "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_dump(exclude_none=True)
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            deltas += delta.get("tool_calls", [])
            finish = choice.finish_reason or finish
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        entry = calls.setdefault(d["index"], {"arguments": ""})
        if "id" in d:
            entry["id"] = d["id"]
        if "name" in d.get("function", {}):
            entry["name"] = d["function"]["name"]
        entry["arguments"] += d.get("function", {}).get("arguments", "")
    return Reply(
        content or None, reasoning or None, [calls[i] for i in sorted(calls)], finish, deltas
    )


def both(client, **kwargs) -> Reply:
    """The full reply, after checking that the streamed one says the same (greedy)."""
    full = chat(client, stream=False, **kwargs)
    streamed = chat(client, stream=True, **kwargs)
    assert (streamed.content, streamed.reasoning, streamed.finish_reason) == (
        full.content,
        full.reasoning,
        full.finish_reason,
    )
    strip = [{k: v for k, v in c.items() if k != "id"} for c in full.tool_calls]
    assert [{k: v for k, v in c.items() if k != "id"} for c in streamed.tool_calls] == strip
    return full


def complete(client, prompt: str, **kwargs) -> str:
    """The text of one completion, full and streamed (they must agree)."""
    request = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    full = client.completions.create(**request, **kwargs).choices[0]
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**request, stream=True, **kwargs)
        if c.choices
    )  # fmt: skip
    assert streamed == full.text and full.finish_reason == "stop"
    return full.text


# -- every kind of constraint ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "how",
    [
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
        {"extra_body": {"structured_outputs": {"json": PERSON}}},
        {"extra_body": {"guided_json": json.dumps(PERSON)}},
    ],
    ids=["response_format", "structured_outputs", "guided_json-text"],
)  # fmt: skip
def test_json_schema_output_validates(client, how):
    reply = both(client, **how)
    assert reply.finish_reason == "stop" and reply.reasoning is None
    jsonschema.validate(json.loads(reply.content), PERSON)


def test_json_object_is_an_object(client):
    reply = both(client, response_format={"type": "json_object"})
    assert reply.finish_reason == "stop"
    assert isinstance(json.loads(reply.content), dict)
    obj = both(client, extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(obj.content), dict)


def test_regex_choice_and_grammar_in_chat(client):
    for body, check in [
        ({"structured_outputs": {"regex": CODE}}, lambda t: re.fullmatch(CODE, t)),
        ({"guided_regex": CODE}, lambda t: re.fullmatch(CODE, t)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"grammar": GRAMMAR}}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
        ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_RE, t)),
    ]:
        reply = both(client, extra_body=body)
        assert reply.finish_reason == "stop" and check(reply.content), (body, reply)


def test_completions_take_every_kind(client):
    prompt = "Hello, my name is"
    assert re.fullmatch(CODE, complete(client, prompt, extra_body={"guided_regex": CODE}))
    choice = complete(client, prompt, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert choice in CHOICES
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    text = complete(client, prompt, extra_body={"response_format": response_format})
    jsonschema.validate(json.loads(text), PERSON)
    grammar = complete(client, prompt, extra_body={"guided_grammar": GRAMMAR})
    assert re.fullmatch(GRAMMAR_RE, grammar)


def test_the_constraint_applies_after_the_thinking(client):
    # The template opens <think>; the budget closes it after 6 tokens of free thinking.
    thinking = {"chat_template_kwargs": {"thinking_in_prompt": True}, "thinking_token_budget": 6}
    reply = both(client, extra_body={**thinking, "guided_json": PERSON})
    assert reply.reasoning, reply
    jsonschema.validate(json.loads(reply.content), PERSON)
    choice = both(client, extra_body={**thinking, "guided_choice": CHOICES})
    assert choice.reasoning and choice.content in CHOICES


def test_output_cut_by_max_tokens_is_returned_as_is(client):
    reply = both(client, max_tokens=3, extra_body={"guided_json": PERSON})
    assert reply.finish_reason == "length" and reply.content.startswith('{"')


# -- tool_choice ----------------------------------------------------------------------------------


def test_a_named_tool_choice_calls_that_function(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = both(client, tools=TOOLS, tool_choice=choice)
    # OpenAI (and vLLM) end a forced named call with "stop", not "tool_calls".
    assert reply.finish_reason == "stop" and reply.content is None
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), PARAMETERS["get_weather"])
    streamed = chat(client, stream=True, tools=TOOLS, tool_choice=choice)
    first, *rest = streamed.call_deltas
    assert first["index"] == 0 and first["type"] == "function" and first["id"]
    assert first["function"]["name"] == "get_weather"
    assert rest and all(set(d) == {"index", "function"} for d in rest)
    assert all(set(d["function"]) == {"arguments"} for d in rest)


@pytest.mark.parametrize(
    ("text", "parallel"),
    [("What time is it in Tokyo?", None), ("Weather in Paris, then the time in Oslo.", None),
     ("Weather in Paris, then the time in Oslo.", False)],
)  # fmt: skip
def test_required_tool_choice_calls_declared_functions(client, text, parallel):
    kwargs = {} if parallel is None else {"parallel_tool_calls": parallel}
    messages = [{"role": "user", "content": text}]
    reply = both(client, tools=TOOLS, tool_choice="required", messages=messages, **kwargs)
    assert reply.finish_reason == "tool_calls" and reply.content is None
    assert len(reply.tool_calls) >= 1
    if parallel is False:
        assert len(reply.tool_calls) == 1
    for call in reply.tool_calls:
        assert call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


def test_a_forced_call_cut_by_max_tokens_is_content(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(client, stream=False, tools=TOOLS, tool_choice=choice, max_tokens=3)
    assert reply.finish_reason == "length" and reply.tool_calls == []
    assert reply.content.startswith("{")
    required = chat(client, stream=False, tools=TOOLS, tool_choice="required", max_tokens=3)
    assert required.finish_reason == "length" and required.content.startswith("[")


# -- bad input ------------------------------------------------------------------------------------

# jsonschema takes it (an unresolved $ref is no schema error); xgrammar does not.
UNRESOLVED_REF = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"$ref": "#/$defs/Nope"}}}}}]  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex"),
        ({"extra_body": {"structured_outputs": {"grammar": 'start ::= "a"'}}},
         "structured_outputs.grammar"),
        ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
        ({"extra_body": {"structured_outputs": {}}}, "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
         "structured_outputs"),
        ({"extra_body": {"structured_outputs": {"json": "{not json"}}}, "structured_outputs.json"),
        ({"extra_body": {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}},
         "structured_outputs.whitespace_pattern"),
        ({"extra_body": {"guided_regex": "[a-"}}, "guided_regex"),
        ({"extra_body": {"guided_json": {"type": "object", "required": "x"}}}, "guided_json"),
        ({"extra_body": {"guided_choice": ["a", 1]}}, "guided_choice.1"),
        ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
         "guided_regex"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": UNRESOLVED_REF, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools.0.function.parameters"),
    ],
    ids=["bad-schema", "no-schema", "unknown-type", "bad-regex", "no-root-rule", "no-choices",
         "no-kind", "two-kinds", "schema-not-json", "whitespace-pattern", "bad-guided-regex",
         "bad-guided-json", "non-string-choice", "bad-guided-grammar", "two-sources",
         "tools-and-format", "unresolved-tool-ref"],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=False, **kwargs)
    assert info.value.param == param, info.value.body


def test_completions_name_the_field_too_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", extra_body={"guided_regex": "(("})
    assert info.value.param == "guided_regex"
    assert re.fullmatch(CODE, complete(client, "Hi", extra_body={"guided_regex": CODE}))
