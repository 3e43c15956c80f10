"""Incremental detokenization and stop strings for one sequence (the API process, `LLM.generate`).

Token ids arrive a few at a time; text leaves as deltas. Decoding token by token is wrong for
byte-level BPE (a character may span tokens, and a lone token decodes to U+FFFD), and decoding
everything each time is quadratic. The window method (vLLM's `detokenize_incrementally`)
decodes only the tokens since the last emitted text, plus the few before them for context, and
emits nothing while the window ends in an incomplete character. When the sequence ends, one
full `decode` gives the authoritative text, so the final text equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` exactly as `LLM.generate` returns it.

Stop strings are matched on the text, so they may span tokens; the returned text ends before
the stop string (or after it with `include_stop_str_in_output`). While streaming, the last
`len(longest stop) - 1` characters are held back, so a client never receives the first half of
a stop string that the next token completes.

When the engine ends a sequence on EOS or a stop token id, that last token is kept in the ids
(and counted in usage) but not in the text, as vLLM does.

Token ids the tokenizer does not know are empty text, as in vLLM. Published checkpoints pad the
embedding and LM head past the tokenizer (Qwen3: 151936 rows, 151669 tokens), so such ids can be
sampled; `convert_ids_to_tokens` gives None for them, which the window drops, and the final
`decode` skips them too.
"""

from __future__ import annotations

import weakref
from typing import Any

from tp_engine.frontend.stop_strings import find_stop_string

# Each tokenizer's special token ids, read once: transformers rebuilds `all_special_ids` from the
# special-token map on every access (tens of microseconds for Qwen3's), and
# `convert_ids_to_tokens(..., skip_special_tokens=True)` reads it on every call, that is, once
# per streamed token. Weak keys: a tokenizer that goes away takes its entry with it.
_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_ids(tokenizer: Any) -> frozenset[int]:
    """`tokenizer.all_special_ids` as a set, computed once per tokenizer (the server and `LLM`
    add no special tokens once they serve)."""
    ids = _SPECIAL_IDS.get(tokenizer)
    if ids is None:
        ids = _SPECIAL_IDS[tokenizer] = frozenset(tokenizer.all_special_ids)
    return ids


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # What `skip_special_tokens` drops, looked up once (see `special_ids`).
        self._skipped = special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        # Characters never sent while streaming, in case they begin a stop string.
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []  # every output token, the engine's stop token included
        self._text_ids: list[int] = []  # the tokens that make up the text
        self._tokens: list[str] = []  # their token strings (special ones dropped if skipped)
        self._prefix_offset = 0  # window start: context for the next decode
        self._read_offset = 0  # tokens before this are already in `text`
        self.text = ""  # decoded so far (may run past a stop string until it is checked)
        self._num_sent = 0  # characters of `text` returned by `update`
        self.finished = False
        self.stop_string: str | None = None  # the stop string that ended the sequence

    def update(self, new_token_ids: list[int], engine_stopped: bool, finished: bool) -> str:
        """Add tokens; returns the text that may be sent now.

        `engine_stopped`: the engine ended the sequence on EOS or a stop token id (the last new
        token). `finished`: this is the sequence's last update from the engine. After the call,
        `self.finished` is also True when a stop string ended the sequence here.

        Several tokens at once (a speculative step) meet the stop strings one by one, as they
        would have arrived without speculation: the tokens after the one that completes a stop
        string are dropped (`token_ids` ends with that one).
        """
        if self.finished:
            return ""
        if self._stop and len(new_token_ids) > 1:
            delta = ""
            for i, token_id in enumerate(new_token_ids):
                last = i == len(new_token_ids) - 1
                delta += self._update([token_id], engine_stopped and last, finished and last)
                if self.finished:
                    break
            return delta
        return self._update(new_token_ids, engine_stopped, finished)

    def _update(self, new_token_ids: list[int], engine_stopped: bool, finished: bool) -> str:
        self.token_ids += new_token_ids
        text_ids = new_token_ids[:-1] if engine_stopped and new_token_ids else new_token_ids
        searched_up_to = len(self.text)
        for token_id in text_ids:
            self._append(token_id)
        if finished:
            self.text = self._final_text()
        if self._stop and len(self.token_ids) >= self._min_tokens:
            longest = max(len(s) for s in self._stop)
            start = max(0, searched_up_to - longest + 1)
            hit = find_stop_string(self.text[start:], self._stop)
            if hit is not None:
                position, stop = hit
                end = start + position + (len(stop) if self._include_stop else 0)
                self.text = self.text[:end]
                self.stop_string = stop
                finished = True
        self.finished = finished
        limit = len(self.text) if finished else max(self._num_sent, len(self.text) - self._holdback)
        delta = self.text[self._num_sent : limit]
        self._num_sent = limit
        return delta

    def _append(self, token_id: int) -> None:
        self._text_ids.append(token_id)
        if token_id not in self._skipped:  # what skip_special_tokens=True would drop
            tokens = self._tokenizer.convert_ids_to_tokens([token_id])
            # None: an id past the tokenizer's vocabulary (padding rows of the LM head).
            self._tokens += [t for t in tokens if t is not None]
        convert = self._tokenizer.convert_tokens_to_string
        prefix_text = convert(self._tokens[self._prefix_offset : self._read_offset])
        new_text = convert(self._tokens[self._prefix_offset :])
        # A window ending in U+FFFD stops in the middle of a character: wait for the rest.
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)

    def _final_text(self) -> str:
        full = self._tokenizer.decode(self._text_ids, skip_special_tokens=self._skip_special)
        # The window method always yields a prefix of the full decode; should a tokenizer ever
        # disagree, what was already sent cannot be taken back, so keep it.
        return full if full.startswith(self.text[: self._num_sent]) else self.text
