"""Log-probabilities in the shapes OpenAI's two APIs (and vLLM's prompt_logprobs) use.

Input: the engine's raw entries as they cross the wire, one per token:
`[token_ids, logprobs, rank]`, the chosen token first, then the top-k in rank order
(`tp_engine.core.sequence.TokenLogprobs`). Tokens are shown as `tokenizer.decode([id])`, decoded
once per id per response; an id the tokenizer does not know (the padding rows of a checkpoint
whose vocabulary is larger than its tokenizer) is the empty string "", as in vLLM.

    completions: {"tokens", "token_logprobs", "top_logprobs" (dicts, chosen token included),
                  "text_offset"}; with echo (vLLM's shape) the prompt's tokens come first,
                  the first of them with a null logprob and null top_logprobs (nothing
                  predicts it), the others with the prompt logprobs at their position
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
    prompt (vLLM): per prompt token None (the first) or {id: {"logprob", "rank",
                  "decoded_token"}}
"""

from __future__ import annotations

from typing import Any

from tp_engine.core.sequence import TokenLogprobs

Entry = TokenLogprobs  # token_ids (the chosen one first, then the top-k), logprobs, rank


def cut_top(entries: list[Entry | None], num_top: int) -> list[Entry | None]:
    """Each entry with its chosen token and only the first `num_top` of its top-k (prompt
    logprobs computed for more than a completion's `logprobs` asks to show)."""
    return [
        None
        if e is None
        else TokenLogprobs(e.token_ids[: num_top + 1], e.logprobs[: num_top + 1], e.rank)
        for e in entries
    ]


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoded: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        """The token's text: "" for an id the tokenizer does not know (the fast tokenizers'
        `decode` skips such ids)."""
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self._tokenizer.decode([token_id])
        return text

    def completion(
        self,
        entries: list[Entry],
        text_offset: int = 0,
        echo: tuple[list[int], list[Entry | None]] | None = None,
    ) -> dict[str, Any]:
        """`echo`: the prompt's token ids and its entries (None for the first token), shown
        before the generated tokens."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        offsets: list[int] = []
        prompt_ids, prompt_entries = echo or ([], [])
        rows = [
            *zip(prompt_ids, prompt_entries, strict=True),
            *((e.token_ids[0], e) for e in entries),
        ]
        for token_id, entry in rows:
            token = self.token(token_id)
            tokens.append(token)
            offsets.append(text_offset)
            text_offset += len(token)
            if entry is None:
                token_logprobs.append(None)
                top.append(None)
                continue
            ids, logprobs = entry.token_ids, entry.logprobs
            token_logprobs.append(logprobs[0])
            top.append({self.token(t): lp for t, lp in zip(ids, logprobs, strict=True)})
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chat(self, entries: list[Entry]) -> dict[str, Any]:
        content = []
        for entry in entries:
            ids, logprobs = entry.token_ids, entry.logprobs
            item = self._chat_token(ids[0], logprobs[0])
            item["top_logprobs"] = [
                self._chat_token(t, lp) for t, lp in zip(ids[1:], logprobs[1:], strict=True)
            ]
            content.append(item)
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def prompt(self, entries: list[Entry | None]) -> list[dict[str, Any] | None]:
        out: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                out.append(None)
                continue
            ids, logprobs = entry.token_ids, entry.logprobs
            ranks = [entry.rank, *range(1, len(ids))]
            # The chosen token keeps its own rank even when it is also among the top-k.
            per_token: dict[str, Any] = {}
            for t, lp, r in zip(ids, logprobs, ranks, strict=True):
                per_token.setdefault(
                    str(t), {"logprob": lp, "rank": r, "decoded_token": self.token(t)}
                )
            out.append(per_token)
        return out
