"""tool_choice "required" and a named function: a JSON schema built from the tools makes the
model call them (structured outputs), and the constrained answer becomes the reply's calls.

What the schema makes the answer be (vLLM's shapes, so clients see the same calls):

    named      the function's arguments: its `parameters` schema itself
               (no parameters: an empty object)
    required   [{"name": <a declared function>, "parameters": <its arguments>}, ...]: an array
               of at least one call (at most one with parallel_tool_calls false), each item one
               of the tools (`anyOf`, the name a `const`)

Tools' `$defs` (and older `definitions`) move to the array schema's root, where their `$ref`s
("#/$defs/...") point once the parameters are nested; two tools defining one name differently
are a 400.

`ForcedToolCalls` turns the answer into calls as its text arrives, with the stream deltas of
`tool_calls.ToolCallBlock`: a call's first delta (index, id, type, name) once its name is
complete, then fragments of its `arguments` that concatenate to the final string (prefixes of
the re-serialized partial parse, `tool_calls.stable_prefix`). An answer that is not the shape
above at its end (cut by max_tokens, or produced without the constraint) is the reply's content,
never an error; deltas already streamed cannot be taken back, as with a malformed `<tool_call>`.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from typing import Any

from partial_json_parser import loads as partial_loads

from tp_engine.server.api.http_errors import bad_request
from tp_engine.server.api.protocol import Tool
from tp_engine.server.api.tool_calls import (
    PARTIAL_ARGUMENTS,
    PARTIAL_NAME,
    ToolCall,
    ToolChoice,
    ToolPlan,
    encodable,
    new_call_id,
    serialize,
    stable_prefix,
)

logger = logging.getLogger(__name__)

# A function without parameters takes an empty object (vLLM's rule): its arguments are "{}".
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Where JSON schemas keep their named subschemas (draft 2019+, and older drafts).
_DEFS_KEYS = ("$defs", "definitions")


# -- the schema ----------------------------------------------------------------------------------


def tool_choice_schema(tools: list[Tool], plan: ToolPlan) -> dict[str, Any]:
    """The JSON schema that forces `plan`'s calls (named or required; see the module
    docstring). The request's tools are not changed."""
    if plan.choice is ToolChoice.NAMED:
        (name,) = plan.names
        (tool,) = [t for t in tools if t.function.name == name]
        return tool.function.parameters or _NO_PARAMETERS
    if plan.choice is not ToolChoice.REQUIRED:
        raise ValueError(f"tool_choice {plan.choice.value!r} forces no calls")
    defs: dict[str, dict[str, Any]] = {}
    items = []
    for i, tool in enumerate(tools):
        parameters = copy.copy(tool.function.parameters or _NO_PARAMETERS)
        for key in _DEFS_KEYS:
            for def_name, def_schema in (parameters.pop(key, None) or {}).items():
                known = defs.setdefault(key, {}).setdefault(def_name, def_schema)
                if known != def_schema:
                    raise bad_request(
                        f"two tools define {key} {def_name!r} differently; with tool_choice "
                        "'required' their definitions share one namespace",
                        f"tools.{i}.function.parameters",
                    )
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": items},
    }
    if not plan.parallel:
        schema["maxItems"] = 1
    return {**schema, **defs}


# -- the answer ----------------------------------------------------------------------------------


@dataclass
class _Call:
    """One call's streaming progress."""

    id: str
    name: str
    sent_arguments: str = ""


class ForcedToolCalls:
    """The constrained answer of one choice: `append` its text as it arrives (returns the
    stream deltas it now allows), `close` at its end (the last deltas, and the calls or None
    when the answer is not calls: it is then content)."""

    def __init__(self, plan: ToolPlan) -> None:
        if plan.choice is ToolChoice.AUTO:
            raise ValueError("tool_choice 'auto' forces no calls")
        self._plan = plan
        self.text = ""
        self._calls: list[_Call] = []  # calls whose first delta went out, in index order

    def append(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if not self.text.strip():
            return []
        if self._plan.choice is ToolChoice.NAMED:
            return self._progress_named()
        return self._progress_required()

    def close(self) -> tuple[list[dict[str, Any]], list[ToolCall] | None]:
        parsed = self._parse()
        if parsed is None:
            if self._calls:
                logger.warning("forced tool calls were streamed before the answer broke off")
            return [], None
        deltas: list[dict[str, Any]] = []
        calls = []
        for index, (name, arguments) in enumerate(parsed):
            if index == len(self._calls):
                deltas.append(self._header(name))
            call = self._calls[index]
            if call.name != name or not arguments.startswith(call.sent_arguments):
                # Cannot happen: names are sent complete and fragments are sure prefixes.
                logger.warning("streamed call %r(%r) differs from the answer", call.name, name)
            elif len(arguments) > len(call.sent_arguments):
                deltas.append(self._fragment(index, arguments[len(call.sent_arguments) :]))
            calls.append(ToolCall(call.id, name, arguments))
        return deltas, calls

    # -- streaming ---------------------------------------------------------------------------------

    def _progress_named(self) -> list[dict[str, Any]]:
        arguments = _partial(self.text, PARTIAL_ARGUMENTS)
        if not isinstance(arguments, dict):
            return []
        deltas = []
        if not self._calls:
            (name,) = self._plan.names
            deltas.append(self._header(name))
        deltas += self._advance(0, arguments, complete=False)
        return deltas

    def _progress_required(self) -> list[dict[str, Any]]:
        names = _partial(self.text, PARTIAL_NAME)
        items = _partial(self.text, PARTIAL_ARGUMENTS)
        if not isinstance(names, list) or not isinstance(items, list):
            return []
        limit = None if self._plan.parallel else 1
        deltas = []
        for index, item in enumerate(names[:limit]):
            if index == len(self._calls):
                name = item.get("name") if isinstance(item, dict) else None
                if not (isinstance(name, str) and name in self._plan.names):
                    break  # incomplete, or not a declared function (then close() finds no calls)
                deltas.append(self._header(name))
            full = items[index] if index < len(items) else None
            parameters = full.get("parameters") if isinstance(full, dict) else None
            # An item followed by another one is complete: all of its arguments can go.
            deltas += self._advance(index, parameters, complete=index + 1 < len(items))
        return deltas

    def _advance(self, index: int, arguments: Any, complete: bool) -> list[dict[str, Any]]:
        """The fragment that the (partial, unless `complete`) arguments now allow."""
        if not isinstance(arguments, dict):
            return []
        text = serialize(arguments) if complete else stable_prefix(arguments)
        sent = self._calls[index].sent_arguments
        if not text.startswith(sent) or len(text) <= len(sent) or not encodable(text):
            return []
        return [self._fragment(index, text[len(sent) :])]

    def _header(self, name: str) -> dict[str, Any]:
        call = _Call(new_call_id(), name)
        self._calls.append(call)
        return {
            "index": len(self._calls) - 1,
            "id": call.id,
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }

    def _fragment(self, index: int, fragment: str) -> dict[str, Any]:
        self._calls[index].sent_arguments += fragment
        return {"index": index, "function": {"arguments": fragment}}

    # -- the whole answer --------------------------------------------------------------------------

    def _parse(self) -> list[tuple[str, str]] | None:
        """(name, serialized arguments) of each call; None if the answer is not calls."""
        try:
            value = json.loads(self.text)
        except ValueError:
            return None
        if self._plan.choice is ToolChoice.NAMED:
            if not isinstance(value, dict):
                return None
            (name,) = self._plan.names
            items = [{"name": name, "parameters": value}]
        elif isinstance(value, list) and value:
            items = value if self._plan.parallel else value[:1]
        else:
            return None
        calls = []
        for item in items:
            if not isinstance(item, dict):
                return None
            name, arguments = item.get("name"), item.get("parameters", {})
            if not (isinstance(name, str) and name in self._plan.names):
                return None
            if not isinstance(arguments, dict):
                return None
            text = serialize(arguments)
            if not encodable(text):
                return None
            calls.append((name, text))
        return calls


def _partial(text: str, allow: Any) -> Any:
    try:
        return partial_loads(text, allow)
    except Exception:  # the library raises several types on text that is not JSON
        return None
