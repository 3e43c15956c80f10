"""`LLM`'s per-prompt arguments: one value for every prompt, or one per prompt."""

from __future__ import annotations

from typing import Any


def per_prompt(value: Any, single: type, n: int, what: str, default: Any = None) -> list[Any]:
    """`value` for each of `n` prompts: repeated when it is one `single` (None: `default`),
    else its items, which must be as many as the prompts (ValueError naming `what`)."""
    if value is None:
        return [default] * n
    if isinstance(value, single):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{len(values)} {what} for {n} prompts")
    return values
