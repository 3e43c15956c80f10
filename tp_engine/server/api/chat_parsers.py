"""Which chat-output parsers the server runs (`--reasoning-parser`, `--tool-call-parser`), and
their markers resolved to token ids of the served tokenizer.

Both parsers decide by token ids: Qwen3 writes `<think>`, `</think>`, `<tool_call>` and
`</tool_call>` as single tokens, so a marker in the output is that token, never the same
characters spelled by other tokens (a model quoting "<tool_call>" in prose makes no call). A
tokenizer without one of the markers as a single token cannot be served with that parser: the
API process refuses to start and says why (`ChatParsing.resolve`).

Names follow vLLM: `--reasoning-parser qwen3`, `--tool-call-parser hermes` (Qwen3's tool-call
format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), and
`--enable-auto-tool-choice` for `tool_choice: "auto"`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tp_engine.common.thinking import ThinkTokens, single_token_id, think_tokens

# --reasoning-parser name -> how the markers are found (one kind today).
REASONING_PARSERS = ("qwen3",)
# --tool-call-parser name -> (start marker, end marker).
TOOL_CALL_PARSERS = {"hermes": ("<tool_call>", "</tool_call>")}


@dataclass(frozen=True)
class ToolMarkers:
    start_id: int
    end_id: int


@dataclass(frozen=True)
class ChatParsing:
    """The server's chat-output parsing, fixed at start-up."""

    # --reasoning-parser: the thinking markers; None = thinking stays in the content.
    think: ThinkTokens | None = None
    # --tool-call-parser: the tool-call markers; None = requests with tools are refused.
    tool_markers: ToolMarkers | None = None
    # --enable-auto-tool-choice: tool_choice "auto" (the default with tools) is allowed.
    enable_auto_tool_choice: bool = False

    @classmethod
    def resolve(
        cls,
        tokenizer: Any,
        reasoning_parser: str | None,
        tool_call_parser: str | None,
        enable_auto_tool_choice: bool,
    ) -> ChatParsing:
        """Raises ValueError (the API process then exits with the message) when a parser is
        unknown or the tokenizer lacks its markers as single tokens."""
        think = None
        if reasoning_parser is not None:
            if reasoning_parser not in REASONING_PARSERS:
                raise ValueError(
                    f"unknown --reasoning-parser {reasoning_parser!r}; "
                    f"choose from {list(REASONING_PARSERS)}"
                )
            try:
                think = think_tokens(tokenizer)
            except ValueError as exc:
                raise ValueError(f"--reasoning-parser {reasoning_parser}: {exc}") from None
        markers = None
        if tool_call_parser is not None:
            if tool_call_parser not in TOOL_CALL_PARSERS:
                raise ValueError(
                    f"unknown --tool-call-parser {tool_call_parser!r}; "
                    f"choose from {sorted(TOOL_CALL_PARSERS)}"
                )
            ids = []
            for text in TOOL_CALL_PARSERS[tool_call_parser]:
                token_id = single_token_id(tokenizer, text)
                if token_id is None:
                    raise ValueError(
                        f"--tool-call-parser {tool_call_parser}: the tokenizer has no {text!r} "
                        "token (Qwen3 has it as one token)"
                    )
                ids.append(token_id)
            markers = ToolMarkers(*ids)
        if enable_auto_tool_choice and markers is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        return cls(think, markers, enable_auto_tool_choice)
