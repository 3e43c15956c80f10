"""Chat output parsing without a server: thinking by token ids and the prompt's state, tool
calls in Qwen3's Hermes format (whole and streamed), the thinking budget's pure function, the
request checks, and the flags. The tokenizer is the scripted checkpoint's
(`tests/scripted_model.py`): bytes plus Qwen3's special and markup tokens."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.scripted_model import (
    END_THINK,
    END_TOOL_CALL,
    IM_END,
    THINK,
    TOOL_CALL,
    build_tokenizer,
)
from tp_engine.common.thinking import (
    ThinkingState,
    forced_think_end,
    think_tokens,
    thinking_over,
    with_think_tokens,
)
from tp_engine.frontend.detokenizer import IncrementalDetokenizer
from tp_engine.sampling_params import SamplingParams
from tp_engine.server.api.chat_output import ChatOutputParser
from tp_engine.server.api.chat_parsers import ChatParsing
from tp_engine.server.api.http_errors import APIError
from tp_engine.server.api.prompts import PromptBuilder
from tp_engine.server.api.protocol import ChatCompletionRequest
from tp_engine.server.api.tool_calls import ToolCallBlock, ToolPlan, serialize, tool_plan
from tp_engine.server.messages import Hello

MARKERS = (THINK, END_THINK, TOOL_CALL, END_TOOL_CALL, IM_END)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"), [])


@pytest.fixture(scope="module")
def parsing(tokenizer):
    return ChatParsing.resolve(tokenizer, "qwen3", "hermes", True)


def encode(tokenizer, parts: list[str]) -> list[int]:
    """Markers as their single tokens, any other part as its bytes' tokens."""
    ids: list[int] = []
    for part in parts:
        if part in MARKERS:
            ids.append(tokenizer.convert_tokens_to_ids(part))
        else:
            ids += tokenizer(part, add_special_tokens=False)["input_ids"]
    return ids


@pytest.fixture(scope="module")
def tool_names():
    return ToolPlan(frozenset({"get_weather", "get_time"}), parallel=True)


def parse(tokenizer, parsing, ids, *, tools=None, state=ThinkingState.NOT_STARTED, chunks=None,
          holdback=0, text_override=None):  # fmt: skip
    """Run the parser over `ids` as the server does: all at once (chunks None) or in updates
    of the given sizes, with text from an incremental detokenizer whose stop string (never
    matched) holds back `holdback` characters. Returns the parser and the streamed events."""
    stop = ["\x00" * (holdback + 1)] if holdback else []
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True, stop=stop)
    parser = ChatOutputParser(tokenizer, parsing, tools, state, skip_special_tokens=True)
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    sizes = chunks or [len(ids)]
    events: list[tuple[str, Any]] = []
    pos = 0
    for size in sizes:
        new = ids[pos : pos + size]
        pos += size
        finished = pos >= len(ids)
        stopped = finished and bool(new) and new[-1] == eos
        text = detok.update(new, engine_stopped=stopped, finished=finished)
        events += parser.feed(new, text, finished).events
        if finished:
            break
    return parser, events


def streamed(events) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) put together from stream events."""
    reasoning = "".join(v for k, v in events if k == "reasoning")
    content = "".join(v for k, v in events if k == "content")
    calls: dict[int, list[str]] = {}
    for kind, delta in events:
        if kind == "tool_call":
            entry = calls.setdefault(delta["index"], ["", ""])
            if "name" in delta["function"]:
                assert "id" in delta and delta["type"] == "function"
                entry[0] = delta["function"]["name"]
            entry[1] += delta["function"]["arguments"]
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)]


def random_chunks(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while sum(sizes) < n:
        sizes.append(rng.randint(1, 4))
    return sizes


OUTPUTS = {
    "thinking": [THINK, "\nLet me think: é and ünïcödé.\n", END_THINK, "\n\nThe answer.", IM_END],
    "two_calls": [THINK, "\nTools.\n", END_THINK, "\n\n", TOOL_CALL,
                  '\n{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"", '
                  '"days": [1, 2.5e3, null], "deep": {"x": {}}}}\n', END_TOOL_CALL, "\n",
                  TOOL_CALL, '\n{"name": "get_time", "arguments": {"zone": "日本"}}\n',
                  END_TOOL_CALL, IM_END],
    "text_around_a_call": ["Let me check. ", TOOL_CALL,
                           '{"arguments": {"a": true}, "name": "get_time"}', END_TOOL_CALL,
                           "\nDone.  ", IM_END],
    "call_in_thinking": [THINK, "maybe ", TOOL_CALL, '{"name": "get_time", "arguments": {}}',
                         END_TOOL_CALL, " no", END_THINK, "Answer", IM_END],
    "malformed": ["x ", TOOL_CALL, "\nget_weather(city='Paris')\n", END_TOOL_CALL, IM_END],
    "undeclared": [TOOL_CALL, '{"name": "launch", "arguments": {}}', END_TOOL_CALL, IM_END],
    "stray_markers": ["A ", END_THINK, " B ", END_TOOL_CALL, IM_END],
}  # fmt: skip
EXPECTED = {
    "thinking": ("\nLet me think: é and ünïcödé.\n", "\n\nThe answer.", []),
    "two_calls": ("\nTools.\n", "", [
        ("get_weather", '{"city": "Paris \\"Nord\\"", "days": [1, 2500.0, null], "deep": {"x": {}}}'),
        ("get_time", '{"zone": "日本"}')]),
    "text_around_a_call": ("", "Let me check. \nDone.", [("get_time", '{"a": true}')]),
    "call_in_thinking": ('maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call> no',
                         "Answer", []),
    "malformed": ("", "x <tool_call>\nget_weather(city='Paris')\n</tool_call>", []),
    "undeclared": ("", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),
    "stray_markers": ("", "A </think> B </tool_call>", []),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_any_chunking_gives_the_full_reply(tokenizer, parsing, tool_names, name):
    ids = encode(tokenizer, OUTPUTS[name])
    full, _ = parse(tokenizer, parsing, ids, tools=tool_names)
    calls = [(c.name, c.arguments) for c in full.tool_calls]
    assert (full.reasoning, full.content, calls) == EXPECTED[name]
    rng = random.Random(name)
    for holdback in (0, 3, 11):
        for _ in range(8):
            chunks = random_chunks(len(ids), rng)
            _, events = parse(tokenizer, parsing, ids, tools=tool_names, chunks=chunks,
                              holdback=holdback)  # fmt: skip
            assert streamed(events) == EXPECTED[name], (chunks, holdback)


def test_a_delta_across_the_end_of_thinking_is_split_there(tokenizer, parsing):
    """The detokenizer may release text that lags the tokens: "</th" with one update, "ink>"
    with the next. The marker's place comes from the tokens, so the split is exact."""
    parser = ChatOutputParser(tokenizer, parsing, None, ThinkingState.OPEN, True)
    first = encode(tokenizer, ["ab", END_THINK])
    assert parser.feed(first, "ab</th", False).events == [("reasoning", "ab")]
    assert parser.feed(encode(tokenizer, ["cd"]), "ink>c", False).events == [("content", "c")]
    assert parser.feed([], "d", True).events == [("content", "d")]
    assert (parser.reasoning, parser.content, parser.reasoning_tokens) == ("ab", "cd", 2)


@pytest.mark.parametrize(
    ("state", "reasoning", "content"),
    [
        (ThinkingState.OPEN, "I think", "answer"),  # the template opened <think>
        (ThinkingState.CLOSED, "", "I think</think>answer"),  # thinking off: all answer
        (ThinkingState.NOT_STARTED, "", "I think</think>answer"),  # no <think> from the model
    ],
)
def test_the_prompt_decides_where_the_output_starts(tokenizer, parsing, state, reasoning, content):
    ids = encode(tokenizer, ["I think", END_THINK, "answer", IM_END])
    parser, _ = parse(tokenizer, parsing, ids, state=state)
    assert (parser.reasoning, parser.content) == (reasoning, content)


def test_output_cut_inside_thinking_is_reasoning(tokenizer, parsing):
    ids = encode(tokenizer, [THINK, "still thinking"])
    parser, _ = parse(tokenizer, parsing, ids)
    assert (parser.reasoning, parser.message_content()) == ("still thinking", None)
    assert parser.finish_reason("length") == "length"


def test_without_a_reasoning_parser_thinking_is_content(tokenizer):
    parsing = ChatParsing.resolve(tokenizer, None, "hermes", True)
    ids = encode(tokenizer, [THINK, "hmm", END_THINK, "ok", IM_END])
    parser, _ = parse(tokenizer, parsing, ids)
    assert (parser.reasoning, parser.content) == ("", "<think>hmm</think>ok")
    assert not parser.parses_reasoning


def test_parallel_tool_calls_false_drops_later_calls(tokenizer, parsing):
    ids = encode(tokenizer, OUTPUTS["two_calls"])
    plan = ToolPlan(frozenset({"get_weather", "get_time"}), parallel=False)
    parser, events = parse(tokenizer, parsing, ids, tools=plan, chunks=[1] * len(ids))
    assert [c.name for c in parser.tool_calls] == ["get_weather"]
    assert [n for n, _ in streamed(events)[2]] == ["get_weather"]
    assert parser.finish_reason("stop") == "tool_calls" and parser.message_content() is None


def test_whitespace_around_calls_is_not_content(tokenizer, parsing, tool_names):
    ids = encode(
        tokenizer, ["\n\n", TOOL_CALL, '{"name": "get_time"}', END_TOOL_CALL, "\n", IM_END]
    )
    parser, events = parse(tokenizer, parsing, ids, tools=tool_names, chunks=[1] * len(ids))
    assert parser.message_content() is None and streamed(events)[1] == ""
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("get_time", "{}")]
    # Without calls, trailing whitespace is the answer's.
    ids = encode(tokenizer, ["Hi \n", IM_END])
    parser, events = parse(tokenizer, parsing, ids, tools=tool_names, chunks=[1] * len(ids))
    assert parser.content == streamed(events)[1] == "Hi \n"


# -- tool-call blocks -----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    arguments=st.dictionaries(st.text(max_size=5), json_values, max_size=4),
    spaced=st.booleans(),
    ascii_only=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_streamed_arguments_concatenate_to_the_final_ones(arguments, spaced, ascii_only, seed):
    """Whatever the JSON (escapes, unicode, nesting, numbers) and however its text arrives,
    every fragment extends the last, and together they are the call's `arguments`."""
    separators = (", ", ": ") if spaced else (",", ":")
    args_text = json.dumps(arguments, ensure_ascii=ascii_only, separators=separators)
    body = '\n{"name": "f", "arguments": ' + args_text + "}\n"
    block = ToolCallBlock(ToolPlan(frozenset({"f"}), True), index=0)
    rng = random.Random(seed)
    deltas, pos = [], 0
    while pos < len(body):
        step = rng.randint(1, 5)
        block.append(body[pos : pos + step])
        pos += step
        deltas += block.progress()
    final, call = block.close()
    deltas += final
    assert call is not None and call.arguments == serialize(arguments)
    assert deltas[0]["function"]["name"] == "f" and deltas[0]["id"] == call.id
    assert "".join(d["function"]["arguments"] for d in deltas) == call.arguments


def test_a_block_that_is_not_json_is_rejected_early():
    block = ToolCallBlock(ToolPlan(frozenset({"f"}), True), index=0)
    block.append("\nf(x=1)")
    assert block.progress() == [] and block.rejected
    block.append("\n")
    assert block.close() == ([], None)


def test_arguments_with_a_lone_surrogate_are_not_a_call():
    """JSON allows "\\ud83d" alone; the response's UTF-8 does not, so no fragment or call
    carries it (the block becomes content, as the model wrote it)."""
    block = ToolCallBlock(ToolPlan(frozenset({"f"}), True), index=0)
    block.append('{"name": "f", "arguments": {"a": "x\\ud83dy"}}')
    assert all(d["function"]["arguments"].isascii() for d in block.progress())
    assert block.close() == ([], None)


# -- the thinking budget --------------------------------------------------------------------------

START, END = 7, 8


@pytest.mark.parametrize(
    ("output", "in_prompt", "budget", "forced"),
    [
        ([START, 1, 2], False, 2, END),  # two thinking tokens: the next is </think>
        ([START, 1], False, 2, None),
        ([START, 1, 2, END, 3], False, 2, None),  # thinking already over
        ([1, 2, 3], False, 2, None),  # never started thinking
        ([], True, 0, END),  # the template opened it; a budget of 0 closes it at once
        ([START], False, 0, END),
        ([1, 2], True, 2, END),
        ([1, 2, END], True, 2, None),
        ([5, START, 1, 2, 3], False, 3, END),  # counted from the model's <think>
    ],
)
def test_forced_think_end(output, in_prompt, budget, forced):
    params = SamplingParams(thinking_token_budget=budget, think_start_token_id=START,
                            think_end_token_id=END, thinking_in_prompt=in_prompt)  # fmt: skip
    assert forced_think_end(output, params) == forced
    assert forced_think_end(tuple(output), params) == forced


@pytest.mark.parametrize(
    ("output", "in_prompt", "over"),
    [
        ([START, 1, 2, END, 3], False, True),
        ([START, 1, 2], False, False),
        ([1, END, 2], False, False),  # a </think> before any <think> closes nothing
        ([1, 2, 3], False, False),  # may still start thinking
        ([1, END], True, True),
        ([1, 2], True, False),
    ],
)
def test_thinking_over_means_nothing_is_forced_whatever_follows(output, in_prompt, over):
    params = SamplingParams(thinking_token_budget=1, think_start_token_id=START,
                            think_end_token_id=END, thinking_in_prompt=in_prompt)  # fmt: skip
    assert thinking_over(output, params) is over
    if over:  # no continuation gets a forced token
        for more in ([], [START], [START, 4, 5, 6], [4] * 5):
            assert forced_think_end(output + more, params) is None
    assert thinking_over(output, SamplingParams())  # no budget: nothing to wait for


def test_no_budget_or_no_ids_forces_nothing():
    assert forced_think_end([START, 1, 2, 3], SamplingParams()) is None
    assert forced_think_end([START, 1, 2, 3], SamplingParams(thinking_token_budget=1)) is None


def test_budget_fields_come_from_the_tokenizer_and_the_prompt(tokenizer):
    think = think_tokens(tokenizer)
    assert (think.start_id, think.end_id) == tuple(
        tokenizer.convert_tokens_to_ids(t) for t in (THINK, END_THINK)
    )
    params = SamplingParams(thinking_token_budget=4)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True,
        thinking_in_prompt=True,
    )  # fmt: skip
    open_prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    filled = with_think_tokens(params, think, open_prompt)
    assert filled.thinking_in_prompt and filled.think_end_token_id == think.end_id
    assert params.think_end_token_id is None  # a copy
    assert with_think_tokens(SamplingParams(), think, open_prompt).think_end_token_id is None


@pytest.mark.parametrize(
    ("kwargs", "state"),
    [
        ({}, ThinkingState.NOT_STARTED),
        ({"enable_thinking": False}, ThinkingState.CLOSED),
        ({"thinking_in_prompt": True}, ThinkingState.OPEN),
    ],
)
def test_prompt_state_from_the_template(tokenizer, kwargs, state):
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "old thoughts"},
        {"role": "user", "content": "Again"},
    ]
    text = tokenizer.apply_chat_template(
        history, tokenize=False, add_generation_prompt=True, **kwargs
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert "<think>\nold thoughts\n</think>" in text
    assert think_tokens(tokenizer).prompt_state(ids) is state  # history's think blocks ignored


@pytest.mark.parametrize(
    ("field", "value"),
    [("thinking_token_budget", -1), ("thinking_token_budget", 1.5), ("think_end_token_id", -2),
     ("thinking_in_prompt", 1)],
)  # fmt: skip
def test_thinking_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


# -- requests -------------------------------------------------------------------------------------


def chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 **fields})  # fmt: skip


TOOLS = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "b"}}]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "enable_auto", "param"),
    [
        ({"tools": TOOLS}, True, None),
        ({"tools": TOOLS, "tool_choice": "none"}, True, "no-plan"),
        ({"tools": TOOLS}, False, "tool_choice"),  # auto needs --enable-auto-tool-choice
        ({"tools": TOOLS, "tool_choice": "required"}, False, None),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": 5}}}]},
         True, "tools.0.function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "c"}}}, True,
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"function": {"name": "a"}}}, True, "tool_choice"),
        ({"tool_choice": "required"}, True, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, True,
         "tools.0.function.name"),
    ],
)  # fmt: skip
def test_tool_plan(tokenizer, fields, enable_auto, param):
    parsing = ChatParsing.resolve(tokenizer, None, "hermes", enable_auto)
    req = chat_request(**fields)
    if param in (None, "no-plan"):
        plan = tool_plan(req, parsing)
        assert (plan is None) == (param == "no-plan")
        if plan is not None:
            assert plan.names == {"a", "b"} and plan.parallel
        return
    with pytest.raises(APIError) as info:
        tool_plan(req, parsing)
    assert info.value.status == 400 and info.value.param == param


def test_tools_need_a_tool_parser(tokenizer):
    with pytest.raises(APIError) as info:
        tool_plan(chat_request(tools=TOOLS), ChatParsing())
    assert info.value.param == "tools" and "--tool-call-parser" in info.value.message
    assert tool_plan(chat_request(tools=TOOLS, tool_choice="none"), ChatParsing()) is None


def test_parsers_need_their_tokens(tmp_path):
    from tp_engine.testing import build_tokenizer as plain_tokenizer

    plain = plain_tokenizer(tmp_path)
    with pytest.raises(
        ValueError, match="--reasoning-parser qwen3: the tokenizer has no '<think>'"
    ):
        ChatParsing.resolve(plain, "qwen3", None, False)
    with pytest.raises(ValueError, match="no '<tool_call>' token"):
        ChatParsing.resolve(plain, None, "hermes", False)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatParsing.resolve(plain, None, None, True)


def test_flags():
    from tp_engine.server.args import build_parser, server_args

    parser = build_parser()
    args = parser.parse_args(["--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                              "--enable-auto-tool-choice"])  # fmt: skip
    sargs = server_args(args)
    assert (sargs.reasoning_parser, sargs.tool_call_parser, sargs.enable_auto_tool_choice) == (
        "qwen3", "hermes", True)  # fmt: skip
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        server_args(parser.parse_args(["--enable-auto-tool-choice"]))


def test_chat_requests_take_the_checkpoints_sampling_defaults(tokenizer):
    hello = Hello("/m", ["m"], 4096, len(tokenizer),
                  {"temperature": 0.6, "top_p": 0.95, "top_k": 20}, None, 1)  # fmt: skip
    builder = PromptBuilder(tokenizer, hello)
    params = builder.sampling_params(chat_request(), 16)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    params = builder.sampling_params(chat_request(temperature=0.0, top_k=5), 16)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, 5)


def test_template_inputs(tokenizer):
    hello = Hello("/m", ["m"], 4096, len(tokenizer), {}, None, 1)
    builder = PromptBuilder(tokenizer, hello)
    req = chat_request(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "a", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
        tools=TOOLS, documents=[{"text": "D"}], chat_template_kwargs={"enable_thinking": False},
    )  # fmt: skip
    text = builder.chat_prompt(req).text
    assert '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert '<document>{"text": "D"}</document>' in text and '"name": "b"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(APIError) as info:
        builder.chat_prompt(chat_request(chat_template_kwargs={"add_generation_prompt": False}))
    assert info.value.param == "chat_template_kwargs"


# -- the scripted checkpoint itself ---------------------------------------------------------------


def test_the_scripted_checkpoint_follows_its_scripts_in_transformers(tmp_path):
    """The test tool, checked against the reference implementation: every script comes out
    greedily (shared tokens such as </think> and <tool_call>, a repeat after a switch)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from tests.scripted_model import Script, Switch, build_scripted_checkpoint

    scripts = {
        "<s:a>": (THINK, "\nhmm", END_THINK, "\n\nA.", IM_END),
        "<s:b>": (THINK, "\nwell", END_THINK, TOOL_CALL, Switch('{"name": "x"}'), END_TOOL_CALL,
                  TOOL_CALL, Switch('{"name": "y"}'), END_TOOL_CALL, IM_END),
        "<s:c>": ("B.", END_THINK, "C.", IM_END),
    }  # fmt: skip
    path = build_scripted_checkpoint(tmp_path, [Script(k, v) for k, v in scripts.items()])
    tok = AutoTokenizer.from_pretrained(path)
    model = Qwen3ForCausalLM.from_pretrained(path)
    for selector, pieces in scripts.items():
        for kwargs in ({}, {"enable_thinking": False}):
            text = tok.apply_chat_template(
                [{"role": "user", "content": f"Hi {selector}"}], tokenize=False,
                add_generation_prompt=True, **kwargs,
            )  # fmt: skip
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
            assert tok.convert_ids_to_tokens(out[0, len(ids) :].tolist()) == list(pieces)
