"""Qwen3's thinking block, by token ids: where a prompt leaves it, and when a budget ends it.

Qwen3 thinks between `<think>` and `</think>`, each a single token of its vocabulary. Whether
the output starts inside a thinking block depends on the chat template, so it is read from the
prompt's last turn, never guessed from text:

    ... <|im_start|>assistant\\n                       NOT_STARTED: the model may open one
    ... <|im_start|>assistant\\n<think>\\n              OPEN: the output starts thinking
                                                      (Qwen3's thinking-only templates)
    ... <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n   CLOSED: thinking is off
                                                      (`enable_thinking=false`)

A thinking budget (`SamplingParams.thinking_token_budget`) is enforced while sampling, on rank
0: `forced_think_end` says, from a sequence's output token ids and its parameters, whether its
next token must be `</think>` rather than a sampled one. The API server and `LLM.chat` fill in
the token ids and the prompt's state (`with_think_tokens`); the engine only calls the function.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"
# Tokens that start or end a chat turn in Qwen3's template: the prompt's last turn starts after
# the last of them.
TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


class ThinkingState(enum.Enum):
    NOT_STARTED = "not_started"  # the prompt's last turn has no think token
    OPEN = "open"  # its last think token is <think>: the output starts inside the block
    CLOSED = "closed"  # its last think token is </think>: thinking is over (or off)


@dataclass(frozen=True)
class ThinkTokens:
    """Token ids of a tokenizer's thinking markers and turn boundaries."""

    start_id: int
    end_id: int
    turn_boundary_ids: tuple[int, ...]

    def prompt_state(self, prompt_token_ids: Sequence[int]) -> ThinkingState:
        """Where the prompt's last turn leaves thinking (see the module docstring)."""
        for token in reversed(prompt_token_ids):
            if token == self.start_id:
                return ThinkingState.OPEN
            if token == self.end_id:
                return ThinkingState.CLOSED
            if token in self.turn_boundary_ids:
                break
        return ThinkingState.NOT_STARTED


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` if the tokenizer has it as one token (an added or vocabulary token)."""
    vocab = tokenizer.get_vocab()
    token_id = vocab.get(text)
    if token_id is None:
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return int(token_id) if list(ids) == [token_id] else None


def think_tokens(tokenizer: Any) -> ThinkTokens:
    """The tokenizer's `<think>` / `</think>` ids; ValueError if either is not one token."""
    ids = {}
    for text in (THINK_START, THINK_END):
        token_id = single_token_id(tokenizer, text)
        if token_id is None:
            raise ValueError(f"the tokenizer has no {text!r} token (Qwen3 has it as one token)")
        ids[text] = token_id
    return ThinkTokens(ids[THINK_START], ids[THINK_END], turn_boundary_ids(tokenizer))


def turn_boundary_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of the tokenizer's turn boundaries that are single tokens."""
    return tuple(
        token_id
        for token_id in (single_token_id(tokenizer, t) for t in TURN_BOUNDARIES)
        if token_id is not None
    )


def budget_fields(think: ThinkTokens, prompt_token_ids: Sequence[int]) -> dict[str, Any]:
    """The SamplingParams fields that a thinking budget needs, for this prompt."""
    return {
        "think_start_token_id": think.start_id,
        "think_end_token_id": think.end_id,
        "thinking_in_prompt": think.prompt_state(prompt_token_ids) is ThinkingState.OPEN,
    }


def needs_think_tokens(params: Any) -> bool:
    """A thinking budget whose token ids are still unset."""
    return params.thinking_token_budget is not None and params.think_end_token_id is None


def with_think_tokens(params: Any, think: ThinkTokens, prompt_token_ids: Sequence[int]) -> Any:
    """`params` (a SamplingParams) with the think token ids and the prompt's thinking state
    filled in if it has a budget without them (a copy), else `params` itself."""
    if not needs_think_tokens(params):
        return params
    return dataclasses.replace(params, **budget_fields(think, prompt_token_ids))


def forced_think_end(output_token_ids: Sequence[int], params: Any) -> int | None:
    """The token id that must be this sequence's next token because its thinking budget is
    spent, or None to sample as usual.

    `params` is the sequence's `SamplingParams`. Thinking starts at the first output token when
    `params.thinking_in_prompt`, else after the first `think_start_token_id` in the output;
    once `thinking_token_budget` tokens have been generated since, and none of them was
    `think_end_token_id`, the next token is `think_end_token_id`. A budget of 0 ends the
    thinking at once. O(len(output)) per call, in C (`list.index`); it returns None at
    once for a request without a budget.
    """
    budget = params.thinking_token_budget
    end = params.think_end_token_id
    if budget is None or end is None:  # no budget, or one whose ids nobody filled in
        return None
    ids = output_token_ids if isinstance(output_token_ids, list) else list(output_token_ids)
    if params.thinking_in_prompt:
        start = 0
    else:
        try:
            start = ids.index(params.think_start_token_id) + 1
        except ValueError:
            return None  # not thinking (yet)
    if len(ids) - start < budget:
        return None
    return None if _contains(ids, end, start) else end


def thinking_over(output_token_ids: Sequence[int], params: Any) -> bool:
    """Whether a thinking budget can force nothing more: there is none, or the output has
    closed its thinking block (`think_end_token_id` after thinking started), after which
    `forced_think_end` returns None whatever follows. False while thinking may still start
    (not in the prompt, no `think_start_token_id` in the output yet)."""
    end = params.think_end_token_id
    if params.thinking_token_budget is None or end is None:
        return True
    ids = output_token_ids if isinstance(output_token_ids, list) else list(output_token_ids)
    start = 0
    if not params.thinking_in_prompt:
        try:
            start = ids.index(params.think_start_token_id) + 1
        except ValueError:
            return False
    return _contains(ids, end, start)


def _contains(ids: list[int], token: int, start: int) -> bool:
    try:
        ids.index(token, start)
    except ValueError:
        return False
    return True
