"""Tool calling in Qwen3's (Hermes) format: the request's `tools` and `tool_choice`, and each
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block of the output turned into an
OpenAI tool call, whole or streamed.

A block's life while streaming (`ToolCallBlock`):

    opened ──► name complete, declared ──► header sent ──► argument fragments ──► closed
       │        (first delta: index, id, type, name)        (prefixes of the final
       │                                                      arguments string)
       └─► not a JSON object, or a name that is not declared ──► rejected: at its end the
                                                                 block's text is content
    closed: the body must be exactly one JSON object {"name": str, "arguments": object}; the
    call's `arguments` is `json.dumps(arguments)`, and the last fragment completes it.

Fragments come from a partial-JSON parse of the body so far (`partial_json_parser`), with
atoms only once complete except strings, re-serialized, and cut before whatever the parse
closed for it (trailing brackets, the closing quote of a string in progress): what is sent is
then always a prefix of the final serialization, so the fragments concatenate to exactly the
`arguments` of the non-streamed reply.

A body that breaks after its header went out (a JSON prefix that never completes, or garbage
halfway through) cannot be taken back: the stream has sent a call without complete arguments,
and the block's text follows as content (the non-streamed reply has only the content). The
model's malformed calls usually fail before their name completes, where nothing is lost.
"""

from __future__ import annotations

import enum
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for
from partial_json_parser import Allow
from partial_json_parser import loads as partial_loads

from tp_engine.server.api.chat_parsers import ChatParsing
from tp_engine.server.api.guards import RequestLimits, check_nesting
from tp_engine.server.api.http_errors import bad_request
from tp_engine.server.api.protocol import ChatCompletionRequest

logger = logging.getLogger(__name__)

# Partial values the fragments may use: open objects and arrays, and strings in progress (never
# a half number or literal, whose text can still change: "1" -> "1.5e3").
PARTIAL_ARGUMENTS = Allow.OBJ | Allow.ARR | Allow.STR
# The name is taken only once its string is complete.
PARTIAL_NAME = Allow.OBJ | Allow.ARR
_TOOL_CHOICES = ("none", "auto", "required")
_DEFAULT_LIMITS = RequestLimits()


class ToolChoice(enum.Enum):
    """How the output calls tools."""

    # The model decides: calls are the output's `<tool_call>` blocks (this module).
    AUTO = "auto"
    # The output is a JSON array of calls, `[{"name", "parameters"}, ...]`, and a named
    # function's output is its arguments object: both constrained by a schema built from the
    # tools, and parsed by `forced_tool_calls`.
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of the output."""

    # Functions a call may name (just the one for a named tool_choice).
    names: frozenset[str]
    # parallel_tool_calls: False keeps only the first call.
    parallel: bool
    choice: ToolChoice = ToolChoice.AUTO


# -- the request ---------------------------------------------------------------------------------


def tool_plan(
    req: ChatCompletionRequest, parsing: ChatParsing, limits: RequestLimits = _DEFAULT_LIMITS
) -> ToolPlan | None:
    """Check `tools` and `tool_choice` (a 400 naming the field otherwise); None when the output
    is not parsed for calls (no tools, or tool_choice "none"). tool_choice "required" and a
    named function are enforced by a schema (`forced_tool_calls.tool_choice_schema`). A
    parameter schema nested deeper than `limits.max_constraint_depth` is refused before
    jsonschema (recursive) reads it."""
    tools = req.tools or []
    names = [tool.function.name for tool in tools]
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not name:
            raise bad_request("a function name must not be empty", f"tools.{i}.function.name")
        if names.index(name) != i:
            raise bad_request(f"two tools are named {name!r}", f"tools.{i}.function.name")
        param = f"tools.{i}.function.parameters"
        check_nesting(tool.function.parameters, param, limits.max_constraint_depth)
        _check_schema(tool.function.parameters, param)
    choice, named = _tool_choice(req.tool_choice, names)
    if choice == "none" or not tools:
        return None
    if parsing.tool_markers is None:
        raise bad_request(
            "tools need a server started with --tool-call-parser hermes (and "
            "--enable-auto-tool-choice for tool_choice 'auto', the default)",
            "tools",
        )
    if choice == "auto" and not parsing.enable_auto_tool_choice:
        raise bad_request(
            "tool_choice 'auto' needs a server started with --enable-auto-tool-choice",
            "tool_choice",
        )
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    if named is not None:
        return ToolPlan(frozenset([named]), parallel, ToolChoice.NAMED)
    return ToolPlan(frozenset(names), parallel, ToolChoice(choice))


def _tool_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    """("none" | "auto" | "required", None), or ("named", the one function to call): a
    function may be named "auto"."""
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise bad_request(
                f"tool_choice must be one of {list(_TOOL_CHOICES)} or "
                '{"type": "function", "function": {"name": ...}}, got ' + repr(choice),
                "tool_choice",
            )
        if choice == "required" and not names:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in names:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the tools ({names})",
            "tool_choice",
        )
    return "named", name


def _check_schema(schema: dict[str, Any] | None, param: str) -> None:
    if schema is None:
        return
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        at = f" at {where!r}" if where else ""
        raise bad_request(f"not a valid JSON schema{at}: {exc.message}", param) from None


# -- the output ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, serialized

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallBlock:
    """One `<tool_call>` block: its text arrives in pieces (`append`); `progress` returns the
    stream deltas it now allows, `close` the last ones and the call (None: not a call)."""

    def __init__(self, plan: ToolPlan, index: int) -> None:
        self._plan = plan
        self.index = index  # the call's position among this choice's calls, if it becomes one
        self.body = ""
        self.call_id: str | None = None  # set once the header is sent
        self.name: str | None = None
        self.rejected = False  # not a call: its text will be content
        self._sent_arguments = ""

    @property
    def header_sent(self) -> bool:
        return self.call_id is not None

    def append(self, text: str) -> None:
        self.body += text

    def progress(self) -> list[dict[str, Any]]:
        if self.rejected or not self.body.strip():
            return []
        deltas = []
        if not self.header_sent:
            name = self._complete_name()
            if name is None:
                return []
            self.call_id, self.name = new_call_id(), name
            deltas.append(self._header())
        fragment = self._arguments_fragment()
        if fragment:
            deltas.append(self._arguments_delta(fragment))
        return deltas

    def close(self) -> tuple[list[dict[str, Any]], ToolCall | None]:
        """The block ended (its end marker, or the output's end)."""
        parsed = None if self.rejected else _parse_call(self.body, self._plan)
        if parsed is None:
            return [], None
        name, arguments = parsed
        deltas = []
        if not self.header_sent:
            self.call_id, self.name = new_call_id(), name
            deltas.append(self._header())
        sent = self._sent_arguments
        if not arguments.startswith(sent):  # cannot happen: every fragment is a sure prefix
            logger.warning("streamed arguments %r are no prefix of %r", sent, arguments)
        elif len(arguments) > len(sent):
            deltas.append(self._arguments_delta(arguments[len(sent) :]))
        assert self.call_id is not None
        return deltas, ToolCall(self.call_id, name, arguments)

    def _complete_name(self) -> str | None:
        try:
            value = partial_loads(self.body, PARTIAL_NAME)
        except Exception:  # the library raises several types on a body that is not JSON
            value = None
        if not isinstance(value, dict):
            self.rejected = True
            return None
        name = value.get("name")
        if name is None:
            return None
        if not isinstance(name, str) or name not in self._plan.names:
            self.rejected = True
            return None
        return name

    def _arguments_fragment(self) -> str:
        try:
            value = partial_loads(self.body, PARTIAL_ARGUMENTS)
        except Exception:
            return ""
        arguments = value.get("arguments") if isinstance(value, dict) else None
        if not isinstance(arguments, dict):
            return ""
        text = stable_prefix(arguments)
        if not text.startswith(self._sent_arguments) or len(text) <= len(self._sent_arguments):
            return ""
        fragment = text[len(self._sent_arguments) :]
        return fragment if encodable(fragment) else ""

    def _header(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": ""},
        }

    def _arguments_delta(self, fragment: str) -> dict[str, Any]:
        self._sent_arguments += fragment
        return {"index": self.index, "function": {"arguments": fragment}}


def stable_prefix(partial_arguments: dict[str, Any]) -> str:
    """The part of a partially parsed object's serialization that the complete object's
    serialization is sure to start with: without the closers the parse added at the end (the
    brackets of open objects and arrays, the quote of a string still arriving)."""
    text = serialize(partial_arguments).rstrip("}]")
    if text.endswith('"'):
        text = text[:-1]
    # Half of a surrogate pair (a \\ud83d escape whose partner has not arrived) is no character.
    while text and "\ud800" <= text[-1] <= "\udbff":
        text = text[:-1]
    return text


def serialize(arguments: dict[str, Any]) -> str:
    """A call's `arguments` string, as vLLM writes it."""
    return json.dumps(arguments, ensure_ascii=False)


def _parse_call(body: str, plan: ToolPlan) -> tuple[str, str] | None:
    """(name, serialized arguments) of a complete block body; None if it is not a call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or name not in plan.names or not isinstance(arguments, dict):
        return None
    text = serialize(arguments)
    return (name, text) if encodable(text) else None


def encodable(text: str) -> bool:
    """No lone surrogate (JSON allows "\\ud83d" alone; UTF-8, and so the response, does not)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def history_tool_calls(tool_calls: Sequence[Any], param: str) -> list[dict[str, Any]]:
    """Assistant tool calls of the request's history, for the chat template: arguments that are
    a JSON object in a string become the object (Qwen3's template writes them with `tojson`).
    `param`: the field of the calls (`messages.3.tool_calls`), for the 400 of arguments nested
    too deep for the json module."""
    calls = []
    for j, call in enumerate(tool_calls):
        arguments: Any = call.function.arguments
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except RecursionError:
                where = f"{param}.{j}.function.arguments"
                raise bad_request(f"{where} nests too deeply to be read as JSON", where) from None
            except ValueError:
                decoded = None
            if isinstance(decoded, dict):
                arguments = decoded
        calls.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
        )
    return calls
