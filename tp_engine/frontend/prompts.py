"""The offline API's prompts: what `LLM.generate` and the pooling methods accept, made into
token ids, and `LLM.chat`'s conversations rendered into prompts.

A prompt is a string (tokenized with the tokenizer's special tokens), a list of token ids (used
as given), or a dict with `prompt_token_ids` and / or `prompt` (the ids win; the text is what
the output's `prompt` shows).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any, cast

PromptType = str | list[int] | dict[str, Any]
ChatMessage = dict[str, Any]


def as_prompt_list(prompts: PromptType | SequenceOf[PromptType]) -> list[PromptType]:
    """One prompt or a list of them -> a list (a list of ints is one prompt's token ids)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [cast(list[int], items)]  # a single prompt given as token ids
    if not items:
        raise ValueError("no prompts given")
    return cast(list[PromptType], items)


def prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text, None when it is given as token ids only."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return None


def prompt_token_ids(prompt: PromptType, tokenizer: Any) -> list[int]:
    """Token ids of a prompt; `prompt_token_ids` wins over `prompt` in a dict."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ValueError(
        "a prompt must be a string, a list of integer token ids, or a dict with "
        f"'prompt_token_ids' or 'prompt'; got {type(prompt).__name__}"
    )
