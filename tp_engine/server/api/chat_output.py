"""One chat choice's output split into reasoning, content and tool calls, as tokens arrive.

The split is decided by token ids, against the prompt's state (`tp_engine.common.thinking`): the
markers `<think>`, `</think>`, `<tool_call>`, `</tool_call>` are single tokens, and what one
means depends on where the output is when it comes:

    state        on token                      becomes       the marker's text
    PENDING      <think> (as the first token)  THINKING      dropped
                 anything else                 ANSWER        (the token is the answer's)
    THINKING     </think>                      ANSWER        dropped
    ANSWER       <tool_call> (tools parsed)    IN_CALL       dropped (kept if not a call)
    IN_CALL      </tool_call>                  ANSWER        dropped (kept if not a call)

The prompt sets the first state: OPEN thinking starts in THINKING, CLOSED (thinking off) and a
server without a reasoning parser in ANSWER, NOT_STARTED in PENDING. Everything else is text of
the current state: a `<tool_call>` while thinking is reasoning, a stray `</think>` in the
answer is content. Output cut short while thinking stays reasoning.

Text comes from the choice's incremental detokenizer, which may hold characters back (stop
strings, incomplete characters), so a text delta does not line up with the tokens that came
with it. Each marker's place in the text is therefore computed when its token arrives (the
length of the decoded output before and after it), and the text is routed by those offsets:
a delta that runs across `</think>` is split there, whatever the chunking.

A `<tool_call>` block becomes a call (`tool_calls.ToolCallBlock`), or, if it is not one (not
JSON, an undeclared function), content as the model wrote it; with parallel_tool_calls false,
blocks after the first call are dropped. With tools parsed, whitespace at the end of the content
is held back until more content follows: Qwen3 writes newlines around its calls, which are not
content. A reply with calls ends its content without them; one without calls gets them at the
end.

With tool_choice "required" or a named function, the answer (what would be content) is the
calls as constrained JSON, without markers: `forced_tool_calls.ForcedToolCalls` makes them
calls, or, if the answer is not calls at its end (cut by max_tokens), content.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from typing import Any

from tp_engine.common.thinking import ThinkingState
from tp_engine.server.api.chat_parsers import ChatParsing
from tp_engine.server.api.forced_tool_calls import ForcedToolCalls
from tp_engine.server.api.tool_calls import ToolCall, ToolCallBlock, ToolChoice, ToolPlan

logger = logging.getLogger(__name__)


class _State(enum.Enum):
    PENDING = enum.auto()
    THINKING = enum.auto()
    ANSWER = enum.auto()
    IN_CALL = enum.auto()


class _Channel(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    CALL = enum.auto()


class _Kind(enum.Enum):
    OPEN_THINK = enum.auto()
    CLOSE_THINK = enum.auto()
    OPEN_CALL = enum.auto()
    CLOSE_CALL = enum.auto()


@dataclass
class _Marker:
    """A marker token's characters [start, end) in the output text."""

    start: int
    end: int
    kind: _Kind


@dataclass
class ChatDelta:
    """What one update adds, in order: ("reasoning" | "content", text) and ("tool_call",
    OpenAI's delta of one call) events; adjacent texts of one kind are joined."""

    events: list[tuple[str, Any]] = field(default_factory=list)

    def add(self, kind: str, value: Any) -> None:
        if kind != "tool_call" and self.events and self.events[-1][0] == kind:
            self.events[-1] = (kind, self.events[-1][1] + value)
        elif kind == "tool_call" or value:
            self.events.append((kind, value))


class ChatOutputParser:
    """Feed it each update's token ids and text (`feed`); it returns the pieces in order and
    keeps the totals for the non-streamed reply (`reasoning`, `content`, `tool_calls`)."""

    def __init__(
        self,
        tokenizer: Any,
        parsing: ChatParsing,
        tools: ToolPlan | None,
        prompt_state: ThinkingState,
        skip_special_tokens: bool,
    ) -> None:
        self._tokenizer = tokenizer
        self._think = parsing.think
        self._tools = tools
        # tool_choice "required" or named: the answer is the calls (no markers).
        self._forced = None
        if tools is not None and tools.choice is not ToolChoice.AUTO:
            self._forced = ForcedToolCalls(tools)
        self._tool_markers = None
        if tools is not None and self._forced is None:
            self._tool_markers = parsing.tool_markers
        self._skip_special = skip_special_tokens
        if self._think is None or prompt_state is ThinkingState.CLOSED:
            self._state, self._channel = _State.ANSWER, _Channel.CONTENT
        elif prompt_state is ThinkingState.OPEN:
            self._state, self._channel = _State.THINKING, _Channel.REASONING
        else:
            self._state, self._channel = _State.PENDING, _Channel.CONTENT
        self._ids: list[int] = []
        self._markers: list[_Marker] = []  # markers the routed text has not passed yet
        self._pos = 0  # characters of the output text routed so far
        self._marker_text = ""  # the text of the marker being passed
        self._held = ""  # trailing whitespace of the content, held back (tools only)
        self._block: ToolCallBlock | None = None
        self._block_text = ""  # the open block's text, its markers included
        self._block_dropped = False  # a call past the first with parallel_tool_calls false
        self._num_headers = 0  # calls whose first delta was produced
        # Totals.
        self.reasoning_tokens = 0
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[ToolCall] = []

    @property
    def parses_reasoning(self) -> bool:
        return self._think is not None

    def message_content(self) -> str | None:
        """The reply's content: None rather than empty beside tool calls or reasoning."""
        if not self.content and (self.tool_calls or self.reasoning):
            return None
        return self.content

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """ "tool_calls" for a reply that ended by itself after calling tools; a named
        tool_choice's call keeps "stop", as OpenAI answers (and vLLM since its PR 25054)."""
        named = self._tools is not None and self._tools.choice is ToolChoice.NAMED
        if self.tool_calls and engine_reason == "stop" and not named:
            return "tool_calls"
        return engine_reason

    def feed(self, token_ids: list[int], text: str, finished: bool) -> ChatDelta:
        """One update: new token ids and the text the detokenizer released with them;
        `finished` on the choice's last update."""
        delta = ChatDelta()
        for token_id in token_ids:
            self._on_token(token_id)
        self._route(text, delta)
        if finished:
            if self._forced is not None:
                self._close_forced(delta)
            if self._block is not None:
                self._close_block(delta)
            held, self._held = self._held, ""
            if not self.tool_calls:  # trailing whitespace of an answer without calls is its own
                self.content += held
                delta.add("content", held)
        return delta

    # -- tokens ------------------------------------------------------------------------------------

    def _on_token(self, token_id: int) -> None:
        self._ids.append(token_id)
        think, tool = self._think, self._tool_markers
        if self._state is _State.PENDING:
            if think is not None and token_id == think.start_id:
                self._mark(_Kind.OPEN_THINK)
                self._state = _State.THINKING
                return
            self._state = _State.ANSWER
        if self._state is _State.THINKING:
            if think is not None and token_id == think.end_id:
                self._mark(_Kind.CLOSE_THINK)
                self._state = _State.ANSWER
            else:
                self.reasoning_tokens += 1
        elif self._state is _State.ANSWER:
            if tool is not None and token_id == tool.start_id:
                self._mark(_Kind.OPEN_CALL)
                self._state = _State.IN_CALL
        elif tool is not None and token_id == tool.end_id:
            self._mark(_Kind.CLOSE_CALL)
            self._state = _State.ANSWER

    def _mark(self, kind: _Kind) -> None:
        """Where the marker token that just arrived (the last id) sits in the output text."""
        decode = self._tokenizer.decode
        start = len(decode(self._ids[:-1], skip_special_tokens=self._skip_special))
        end = len(decode(self._ids, skip_special_tokens=self._skip_special))
        self._markers.append(_Marker(start, max(start, end), kind))

    # -- text --------------------------------------------------------------------------------------

    def _route(self, text: str, delta: ChatDelta) -> None:
        i = 0
        while True:
            while self._markers and self._markers[0].end <= self._pos:
                self._switch(self._markers.pop(0).kind, delta)
            if i == len(text):
                return
            marker = self._markers[0] if self._markers else None
            if marker is None:
                take = len(text) - i
            elif self._pos < marker.start:
                take = min(len(text) - i, marker.start - self._pos)
            else:  # inside the marker's own text
                take = min(len(text) - i, marker.end - self._pos)
                self._marker_text += text[i : i + take]
                i += take
                self._pos += take
                continue
            self._emit(text[i : i + take], delta)
            i += take
            self._pos += take

    def _switch(self, kind: _Kind, delta: ChatDelta) -> None:
        marker_text, self._marker_text = self._marker_text, ""
        if kind is _Kind.OPEN_THINK:
            self._channel = _Channel.REASONING
        elif kind is _Kind.CLOSE_THINK:
            self._channel = _Channel.CONTENT
        elif kind is _Kind.OPEN_CALL:
            assert self._tools is not None
            self._block = ToolCallBlock(self._tools, self._num_headers)
            self._block_text = marker_text
            self._block_dropped = not self._tools.parallel and bool(self.tool_calls)
            self._channel = _Channel.CALL
        else:
            self._block_text += marker_text
            self._close_block(delta)
            self._channel = _Channel.CONTENT

    def _emit(self, text: str, delta: ChatDelta) -> None:
        if self._channel is _Channel.REASONING:
            self.reasoning += text
            delta.add("reasoning", text)
        elif self._channel is _Channel.CONTENT:
            self._emit_content(text, delta)
        else:
            assert self._block is not None
            self._block_text += text
            self._block.append(text)
            if not self._block_dropped:
                for call_delta in self._block.progress():
                    delta.add("tool_call", call_delta)

    def _emit_content(self, text: str, delta: ChatDelta) -> None:
        if self._forced is not None:
            for call_delta in self._forced.append(text):
                delta.add("tool_call", call_delta)
            return
        if self._tools is not None:
            text = self._held + text
            kept = text.rstrip()
            self._held = text[len(kept) :]
            text = kept
        self.content += text
        delta.add("content", text)

    def _close_forced(self, delta: ChatDelta) -> None:
        assert self._forced is not None
        deltas, calls = self._forced.close()
        for call_delta in deltas:
            delta.add("tool_call", call_delta)
        if calls is not None:
            self.tool_calls = calls
        else:  # not calls: the answer as the model wrote it
            self.content += self._forced.text
            delta.add("content", self._forced.text)

    def _close_block(self, delta: ChatDelta) -> None:
        block, text = self._block, self._block_text
        assert block is not None
        self._block, self._block_text = None, ""
        if self._block_dropped:
            return
        deltas, call = block.close()
        for call_delta in deltas:
            delta.add("tool_call", call_delta)
        if block.header_sent:
            self._num_headers += 1
        if call is not None:
            self.tool_calls.append(call)
        else:
            if block.header_sent:
                logger.warning("a tool call was streamed before its body turned out malformed")
            self._emit_content(text, delta)
