"""A request's output constraint, from whichever field carried it, as `StructuredOutputsParams`.

    source                                 constraint
    response_format {"type": "text"}       none
                    {"type": "json_object"}  json_object
                    {"type": "json_schema",  json (the schema)
                     "json_schema": {"schema": ...}}
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...}  the same
    guided_json, guided_regex,             json, regex, choice, grammar (vLLM's older names)
    guided_choice, guided_grammar
    tool_choice "required" or named        json: a schema built from the tools
                                           (`forced_tool_calls.tool_choice_schema`)

At most one source per request: two are a 400 naming both. Its size and a JSON schema's
nesting are checked here against the server's `RequestLimits`, without recursion (a schema
nested 900 deep once took xgrammar 75 s), on the API process's constraints pool, within the time
limit (`request_work`). Parsing it (`StructuredOutputsParams.check`, no tokenizer needed, cached
by its text) imports xgrammar, which imports torch, so the API process leaves that to rank 0:
the request carries each parse by the field it names (`AddRequest.constraint_checks`), and rank
0 refuses an invalid schema, regex or grammar before the engine sees it, with a 400 whose
`param` is the field that carried it (`response_format.json_schema.schema`,
`structured_outputs.regex`, `guided_regex`, `tools.0.function.parameters`); then it compiles
it. Called without `deferred` (the offline path, the tests) the parse runs here, with the same
message.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tp_engine.features.structured.grammar import KINDS, StructuredOutputsParams, parse_refusal
from tp_engine.server.api.forced_tool_calls import tool_choice_schema
from tp_engine.server.api.guards import RequestLimits, check_nesting
from tp_engine.server.api.http_errors import bad_request
from tp_engine.server.api.protocol import ChatCompletionRequest, CompletionRequest
from tp_engine.server.api.tool_calls import ToolChoice, ToolPlan

# vLLM's older top-level names -> the StructuredOutputsParams field each one sets.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_DEFAULT_LIMITS = RequestLimits()
# How StructuredOutputsParams names a field in its errors; replaced by the request's field.
_ENGINE_FIELD = re.compile(r"SamplingParams\.structured_outputs(\.\w+)?")


def output_constraint(
    req: CompletionRequest | ChatCompletionRequest,
    tools: ToolPlan | None = None,
    limits: RequestLimits = _DEFAULT_LIMITS,
    deferred: dict[str, dict[str, Any]] | None = None,
) -> StructuredOutputsParams | None:
    """The request's constraint (None: free output); a 400 naming the field if it gives more
    than one, or one that is not valid or over `limits`. `tools`: the chat request's checked
    tools (`tool_calls.tool_plan`), whose "required" or named tool_choice is a constraint too.
    `deferred`: the parses left to rank 0, by the field they name (see `constraint`)."""
    refuse_unsupported_options(req)
    sources = _sources(req, tools)
    if len(sources) > 1:
        first, second = sources[0][0], sources[1][0]
        raise bad_request(
            f"{first} and {second} both constrain the output; give only one of them", second
        )
    if not sources:
        return None
    _, fields, param = sources[0]
    if fields is None:  # the tools: checked one by one first, to name the one at fault
        assert isinstance(req, ChatCompletionRequest) and req.tools and tools is not None
        for i, tool in enumerate(req.tools):
            if tool.function.name in tools.names and tool.function.parameters:
                where = f"tools.{i}.function.parameters"
                constraint({"json": tool.function.parameters}, where, limits, deferred)
        fields = {"json": tool_choice_schema(req.tools, tools)}
    return constraint(fields, param, limits, deferred)


def constraint(
    fields: dict[str, Any],
    param: str,
    limits: RequestLimits = _DEFAULT_LIMITS,
    deferred: dict[str, dict[str, Any]] | None = None,
) -> StructuredOutputsParams:
    """`StructuredOutputsParams(**fields)`, within `limits` and parsed; its errors are 400s
    naming `param`. With `deferred` (the API process) the parse is left to rank 0: `fields`
    goes into `deferred` under `param`, and rank 0 refuses the request with the same 400
    (`grammar.parse_refusal`), since parsing imports xgrammar and with it torch."""
    check_size_and_nesting(fields, param, limits)
    try:
        params = StructuredOutputsParams(**fields)
    except ValueError as exc:
        message = _ENGINE_FIELD.sub(param, str(exc), count=1)
        raise bad_request(message, param) from None
    if deferred is not None:
        deferred[param] = fields
        return params
    why = parse_refusal(fields, param)
    if why is not None:
        raise bad_request(why, param)
    return params


def check_size_and_nesting(fields: dict[str, Any], param: str, limits: RequestLimits) -> None:
    """A 400 naming `param` when a constraint's text is over `limits.max_constraint_bytes` or
    a JSON schema (an object, or text that parses to one) nests deeper than
    `limits.max_constraint_depth`. The depth is measured before anything recursive reads it."""
    for kind, value in fields.items():
        if kind == "json" and not isinstance(value, str):
            check_nesting(value, param, limits.max_constraint_depth)  # before json.dumps
            text = json.dumps(value)
        elif kind == "choice" and isinstance(value, list):
            text = "".join(c for c in value if isinstance(c, str))
        elif isinstance(value, str):
            text = value
        else:
            continue
        if len(text.encode()) > limits.max_constraint_bytes:
            raise bad_request(
                f"{param} is {len(text.encode())} bytes, over this server's limit of "
                f"{limits.max_constraint_bytes} (--max-constraint-bytes)",
                param,
            )
        if kind == "json" and isinstance(value, str):
            try:
                parsed = json.loads(value)
            except RecursionError:
                raise bad_request(
                    f"{param} nests deeper than this server's limit of "
                    f"{limits.max_constraint_depth} levels",
                    param,
                ) from None
            except ValueError:
                continue  # not JSON: `check` says so, naming the field
            check_nesting(parsed, param, limits.max_constraint_depth)


def gives_constraint(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request gives anything whose check takes time (a schema, grammar, regex or
    tools to parse): only those go to the constraints pool. The others (almost every request)
    are checked inline, in microseconds, and so never wait behind a slow constraint in that
    small pool, nor pay its thread hop on the way to their first token."""
    if isinstance(req, ChatCompletionRequest) and (req.tools or req.tool_choice is not None):
        return True
    return bool(_sources(req, None))


def refuse_unsupported_options(req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's options that would change what a constraint allows: refused, never ignored."""
    if req.guided_whitespace_pattern is not None:
        raise bad_request(
            "guided_whitespace_pattern is not supported (JSON is generated with fixed whitespace)",
            "guided_whitespace_pattern",
        )
    options = req.structured_outputs
    if options is not None:
        for name in ("structural_tag", "whitespace_pattern"):
            if getattr(options, name) is not None:
                raise bad_request(
                    f"structured_outputs.{name} is not supported", f"structured_outputs.{name}"
                )


def _sources(
    req: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None
) -> list[tuple[str, dict[str, Any] | None, str]]:
    """Each constraint the request gives: (its field, StructuredOutputsParams fields or None
    for the tools' schema, the field that errors name)."""
    found: list[tuple[str, dict[str, Any] | None, str]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        param = "response_format.json_schema.schema"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request(
                'response_format {"type": "json_schema"} needs json_schema.schema', param
            )
        found.append(("response_format", {"json": fmt.json_schema.schema_}, param))
    options = req.structured_outputs
    if options is not None:
        fields = {
            kind: value
            for kind in KINDS
            if (value := getattr(options, "json_" if kind == "json" else kind)) is not None
        }
        param = f"structured_outputs.{next(iter(fields))}" if len(fields) == 1 else None
        found.append(("structured_outputs", fields, param or "structured_outputs"))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}, name))
    if tools is not None and tools.choice is not ToolChoice.AUTO:
        found.append(("tool_choice", None, "tools"))
    return found
