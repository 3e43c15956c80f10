"""The server side of structured outputs without a server: request fields to
`StructuredOutputsParams` (and the 400s naming the field), the schema that tool_choice
"required" or a named function becomes, and the constrained answer turned into tool calls,
whole and streamed."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scripted_model import END_THINK, IM_END, THINK, build_tokenizer
from tp_engine.common.thinking import ThinkingState
from tp_engine.features.structured.grammar import StructuredOutputsParams
from tp_engine.frontend.detokenizer import IncrementalDetokenizer
from tp_engine.server.api.chat_output import ChatOutputParser
from tp_engine.server.api.chat_parsers import ChatParsing
from tp_engine.server.api.constraints import output_constraint
from tp_engine.server.api.forced_tool_calls import ForcedToolCalls, tool_choice_schema
from tp_engine.server.api.generation import PromptInput
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.prompts import PromptBuilder
from tp_engine.server.api.protocol import ChatCompletionRequest, CompletionRequest, Tool, parse_body
from tp_engine.server.api.tool_calls import ToolChoice, ToolPlan, tool_plan
from tp_engine.server.messages import Hello

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/Zone"}},
        "$defs": {"Zone": {"enum": ["UTC", "CET"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
]  # fmt: skip
NAMES = frozenset({"get_weather", "get_time", "ping"})


def chat_request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "x"}], **fields}
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


def completion_request(**fields: Any) -> CompletionRequest:
    return parse_body(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), [])


@pytest.fixture(scope="module")
def parsing(tokenizer):
    return ChatParsing.resolve(tokenizer, "qwen3", "hermes", True)


def constraint_of(req: ChatCompletionRequest, parsing: ChatParsing) -> StructuredOutputsParams:
    return output_constraint(req, tool_plan(req, parsing))


# -- request fields -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": SCHEMA, "strict": True, "description": "d"}}}, {"json": SCHEMA}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"json": json.dumps(SCHEMA)}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"choice": ["x", "y"]}}, {"choice": ["x", "y"]}),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, {"grammar": 'root ::= "a"'}),
        ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
        # vLLM's hints that change nothing here are ignored.
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, {"regex": "a"}),
        ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, {"json": SCHEMA}),
        ({"guided_regex": "[0-9]"}, {"regex": "[0-9]"}),
        ({"guided_choice": ["x"]}, {"choice": ["x"]}),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ],
)  # fmt: skip
def test_each_source_becomes_its_constraint(fields, expected):
    want = None if expected is None else StructuredOutputsParams(**expected)
    assert output_constraint(chat_request(**fields)) == want
    assert output_constraint(completion_request(**fields)) == want


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
         "response_format.json_schema.schema", "not valid: Unsupported type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema",
         "needs json_schema.schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": "json"}, "response_format", "should be an object"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "not valid"),
        ({"structured_outputs": {"grammar": "x ::= y"}}, "structured_outputs.grammar",
         "not valid"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice",
         "non-empty strings"),
        ({"structured_outputs": {"json": "[]"}}, "structured_outputs.json",
         "must be an object"),
        ({"structured_outputs": {}}, "structured_outputs", "needs exactly one"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object",
         "needs exactly one"),
        ({"structured_outputs": {"regex": "a", "grammar": 'root ::= "a"'}},
         "structured_outputs", "needs exactly one"),
        ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}},
         "structured_outputs.structural_tag", "not supported"),
        ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
         "not supported"),
        ({"guided_json": {"type": "object", "properties": 3}}, "guided_json", "not valid"),
        ({"guided_choice": "a"}, "guided_choice", "valid array"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar", "not valid"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
         "response_format and guided_regex both constrain the output"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice",
         "structured_outputs and guided_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as info:
        output_constraint(chat_request(**fields))
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert words in info.value.message
    # The message names the request's field, never the engine's.
    assert "SamplingParams" not in info.value.message


def test_forced_tool_choices_are_constraints_too(parsing):
    named = {"type": "function", "function": {"name": "get_time"}}
    assert constraint_of(chat_request(tools=TOOLS, tool_choice=named), parsing) == (
        StructuredOutputsParams(json=TOOLS[1]["function"]["parameters"])
    )
    required = constraint_of(chat_request(tools=TOOLS, tool_choice="required"), parsing)
    assert required is not None and required.json["type"] == "array"
    for choice in (None, "auto", "none"):
        assert constraint_of(chat_request(tools=TOOLS, tool_choice=choice), parsing) is None
    # Beside another source, and with a schema xgrammar cannot take: 400s naming the field.
    with pytest.raises(APIError) as info:
        constraint_of(chat_request(tools=TOOLS, tool_choice="required", guided_regex="a"), parsing)
    assert info.value.param == "tool_choice"
    unresolved = {"type": "object", "properties": {"x": {"$ref": "#/$defs/Nope"}}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": unresolved}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        with pytest.raises(APIError) as info:
            constraint_of(chat_request(tools=tools, tool_choice=choice), parsing)
        assert info.value.param == "tools.1.function.parameters", info.value.message


def test_a_function_may_be_named_like_a_tool_choice(parsing):
    tools = [{"type": "function", "function": {"name": name}} for name in ("none", "auto")]
    for name in ("none", "auto"):
        choice = {"type": "function", "function": {"name": name}}
        plan = tool_plan(chat_request(tools=tools, tool_choice=choice), parsing)
        assert plan == ToolPlan(frozenset({name}), True, ToolChoice.NAMED)


def test_a_constraint_brings_the_think_tokens(parsing):
    builder = PromptBuilder(None, Hello("/m", ["m"], 1024, 1000, {}, None, 1), parsing)
    think = parsing.think
    prompt = PromptInput([5, think.start_id])  # the template opened the thinking
    req = chat_request()
    assert builder.thinking_fields(req, prompt) == {}
    fields = builder.thinking_fields(req, prompt, constrained=True)
    assert fields == {
        "think_start_token_id": think.start_id,
        "think_end_token_id": think.end_id,
        "thinking_in_prompt": True,
    }
    # Without --reasoning-parser the constraint starts with the output.
    plain = PromptBuilder(None, Hello("/m", ["m"], 1024, 1000, {}, None, 1), ChatParsing())
    assert plain.thinking_fields(req, prompt, constrained=True) == {}


# -- the tool schema ------------------------------------------------------------------------------


def tools_of(raw: list[dict[str, Any]]) -> list[Tool]:
    return [Tool.model_validate(t) for t in raw]


def test_a_named_function_is_its_parameters():
    tools = tools_of(TOOLS)
    for name, parameters in [
        ("get_weather", TOOLS[0]["function"]["parameters"]),
        ("ping", {"type": "object", "properties": {}}),  # no parameters: an empty object
    ]:
        plan = ToolPlan(frozenset({name}), True, ToolChoice.NAMED)
        assert tool_choice_schema(tools, plan) == parameters


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_to_declared_functions(parallel):
    tools = tools_of(TOOLS)
    before = [t.model_dump() for t in tools]
    schema = tool_choice_schema(tools, ToolPlan(NAMES, parallel, ToolChoice.REQUIRED))
    assert [t.model_dump() for t in tools] == before  # the request is not changed
    assert schema["minItems"] == 1 and schema.get("maxItems") == (None if parallel else 1)
    assert schema["$defs"] == {"Zone": {"enum": ["UTC", "CET"]}}
    StructuredOutputsParams(json=schema).check()  # xgrammar takes it
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_time", "parameters": {"zone": "CET"}}, {"name": "ping", "parameters": {}}]
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(ok[:1]) and validator.is_valid(ok) == parallel
    for bad in (
        [],
        [{"name": "get_time", "parameters": {"zone": "PST"}}],  # the hoisted $ref still applies
        [{"name": "launch", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "ping"}],
        [{"name": "ping", "parameters": {}, "extra": 1}],
    ):
        assert not validator.is_valid(bad), bad


def test_tools_defining_one_name_differently_are_a_400():
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "properties": {"z": {"$ref": "#/$defs/Zone"}},
        "$defs": {"Zone": {"enum": ["JST"]}}}}}  # fmt: skip
    plan = ToolPlan(frozenset({"get_time", "other"}), True, ToolChoice.REQUIRED)
    with pytest.raises(APIError) as info:
        tool_choice_schema(tools_of([TOOLS[1], other]), plan)
    assert info.value.param == "tools.1.function.parameters" and "Zone" in info.value.message
    same = {**other, "function": {**other["function"], "name": "same"}}
    same["function"]["parameters"] = TOOLS[1]["function"]["parameters"]
    plan = ToolPlan(frozenset({"get_time", "same"}), True, ToolChoice.REQUIRED)
    assert tool_choice_schema(tools_of([TOOLS[1], same]), plan)["$defs"]  # equal ones merge


# -- the answer as calls --------------------------------------------------------------------------

REQUIRED_ANSWER = json.dumps([
    {"name": "get_weather", "parameters": {"city": "Paris \"Nord\" 日本", "n": [1, 2.5, None]}},
    {"name": "ping", "parameters": {}},
    {"name": "get_time", "parameters": {"zone": "UTC", "deep": {"x": {"y": []}}}},
], ensure_ascii=False)  # fmt: skip
NAMED_ANSWER = '{"city": "Rome", "days": [1, 2], "deep": {"a": {"b": "}]\\""}}}'


def run(plan: ToolPlan, text: str, sizes: list[int]) -> tuple[list[dict], Any]:
    forced = ForcedToolCalls(plan)
    deltas, pos = [], 0
    for size in sizes:
        deltas += forced.append(text[pos : pos + size])
        pos += size
    last, calls = forced.close()
    return deltas + last, calls


def joined(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) per call index, from stream deltas; checks each call's first delta."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["type"] == "function" and d["id"].startswith("call_")
            assert d["function"]["arguments"] == "" and d["index"] == len(calls)
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(calls[i]) for i in sorted(calls)]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), parallel=st.booleans())
def test_streamed_calls_join_into_the_whole_ones(seed, parallel):
    rng = random.Random(seed)
    for plan, text in [
        (ToolPlan(NAMES, parallel, ToolChoice.REQUIRED), REQUIRED_ANSWER),
        (ToolPlan(frozenset({"get_weather"}), parallel, ToolChoice.NAMED), NAMED_ANSWER),
    ]:
        sizes = [rng.randint(1, 6) for _ in range(len(text))]
        deltas, calls = run(plan, text, sizes)
        whole = [(c.name, c.arguments) for c in calls]
        assert joined(deltas) == whole
        ids = {d["index"]: d["id"] for d in deltas if "id" in d}
        assert [c.id for c in calls] == [ids[i] for i in range(len(calls))]
    expected = [(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
                for i in json.loads(REQUIRED_ANSWER)]  # fmt: skip
    _, calls = run(ToolPlan(NAMES, parallel, ToolChoice.REQUIRED), REQUIRED_ANSWER, [7] * 99)
    assert [(c.name, c.arguments) for c in calls] == (expected if parallel else expected[:1])


@pytest.mark.parametrize(
    ("choice", "text"),
    [
        (ToolChoice.NAMED, '{"city": "Ro'),  # cut by max_tokens
        (ToolChoice.NAMED, "[1]"),
        (ToolChoice.NAMED, ""),
        (ToolChoice.REQUIRED, '[{"name": "get_time", "parameters": {"zone": "U'),
        (ToolChoice.REQUIRED, "[]"),
        (ToolChoice.REQUIRED, '[{"name": "launch", "parameters": {}}]'),
        (ToolChoice.REQUIRED, '[{"name": "ping", "parameters": 3}]'),
        (ToolChoice.REQUIRED, '{"name": "ping", "parameters": {}}'),
        (ToolChoice.REQUIRED, "<tool_call>{}</tool_call>"),
    ],
)
def test_an_answer_that_is_not_calls_makes_none(choice, text):
    names = frozenset({"get_weather"}) if choice is ToolChoice.NAMED else NAMES
    _, calls = run(ToolPlan(names, True, choice), text, [3] * len(text))
    assert calls is None


# -- in the chat output parser --------------------------------------------------------------------


def parse_chat(tokenizer, parsing, plan, parts, state, sizes=None, finish="stop"):
    """The parser over `parts` (markers as their tokens), fed in updates of `sizes` tokens;
    returns (parser, streamed events, finish reason)."""
    ids: list[int] = []
    for part in parts:
        if part in (THINK, END_THINK, IM_END):
            ids.append(tokenizer.convert_tokens_to_ids(part))
        else:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    parser = ChatOutputParser(tokenizer, parsing, plan, state, skip_special_tokens=True)
    events, pos = [], 0
    for size in sizes or [len(ids)]:
        new, pos = ids[pos : pos + size], pos + size
        done = pos >= len(ids)
        text = detok.update(new, engine_stopped=done and finish == "stop", finished=done)
        events += parser.feed(new, text, done).events
        if done:
            break
    return parser, events, parser.finish_reason(finish)


@pytest.mark.parametrize("seed", range(4))
def test_the_answer_after_the_thinking_becomes_the_calls(tokenizer, parsing, seed):
    rng = random.Random(seed)
    thinking = [THINK, "\nI should call them.\n", END_THINK]
    for plan, answer, reason in [
        (ToolPlan(NAMES, True, ToolChoice.REQUIRED), REQUIRED_ANSWER, "tool_calls"),
        (ToolPlan(frozenset({"get_weather"}), True, ToolChoice.NAMED), NAMED_ANSWER, "stop"),
    ]:
        parts = [*thinking, answer, IM_END]
        sizes = [rng.randint(1, 5) for _ in range(200)]
        parser, events, finish = parse_chat(
            tokenizer, parsing, plan, parts, ThinkingState.NOT_STARTED, sizes
        )
        assert finish == reason and parser.message_content() is None
        assert parser.reasoning == "\nI should call them.\n"
        assert "".join(v for k, v in events if k == "reasoning") == parser.reasoning
        assert not [k for k, _ in events if k == "content"]
        calls = [(c.name, c.arguments) for c in parser.tool_calls]
        assert joined([v for k, v in events if k == "tool_call"]) == calls and calls


def test_an_answer_cut_short_is_content(tokenizer, parsing):
    plan = ToolPlan(NAMES, True, ToolChoice.REQUIRED)
    cut = REQUIRED_ANSWER[:30]
    parser, events, finish = parse_chat(
        tokenizer, parsing, plan, [cut], ThinkingState.CLOSED, [4] * 30, finish="length"
    )
    assert finish == "length" and parser.tool_calls == [] and parser.message_content() == cut
    assert "".join(v for k, v in events if k == "content") == cut
    # Cut inside the thinking: reasoning only, no content, no calls.
    parser, _, finish = parse_chat(
        tokenizer, parsing, plan, [THINK, "still thinking"], ThinkingState.NOT_STARTED,
        finish="length",
    )  # fmt: skip
    assert parser.reasoning == "still thinking" and parser.message_content() is None
