"""Stop strings: where the first one occurs in a sequence's text.

Matched on detokenized text, so a stop string may span token boundaries; the text returned to
the user ends just before it (vLLM and OpenAI behave the same way).
"""

from __future__ import annotations

from collections.abc import Iterable


def find_stop_string(text: str, stops: Iterable[str]) -> tuple[int, str] | None:
    """(position, stop string) of the earliest stop string in `text`, or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop)
        if position != -1 and (best is None or position < best[0]):
            best = (position, stop)
    return best
