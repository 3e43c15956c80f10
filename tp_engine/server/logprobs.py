"""Log-probabilities in the shapes OpenAI's two APIs (and vLLM's prompt_logprobs) use.

Input: the engine's raw entries as they cross the wire, one per token:
`[token_ids, logprobs, rank]`, the chosen token first, then the top-k in rank order
(`tp_engine.sequence.TokenLogprobs`). Tokens are shown as `tokenizer.decode([id])`, decoded
once per id per response.

    completions: {"tokens", "token_logprobs", "top_logprobs" (dicts, chosen token included),
                  "text_offset"}
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
    prompt (vLLM): per prompt token None (the first) or {id: {"logprob", "rank",
                  "decoded_token"}}
"""

from __future__ import annotations

from typing import Any

Entry = list[Any]  # [token_ids, logprobs, rank]


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._decoded: dict[int, str] = {}

    def token(self, token_id: int) -> str:
        text = self._decoded.get(token_id)
        if text is None:
            text = self._decoded[token_id] = self._tokenizer.decode([token_id])
        return text

    def completion(self, entries: list[Entry], text_offset: int = 0) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top: list[dict[str, float]] = []
        offsets: list[int] = []
        for ids, logprobs, _rank in entries:
            token = self.token(ids[0])
            tokens.append(token)
            token_logprobs.append(logprobs[0])
            top.append({self.token(t): lp for t, lp in zip(ids, logprobs, strict=True)})
            offsets.append(text_offset)
            text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def chat(self, entries: list[Entry]) -> dict[str, Any]:
        content = []
        for ids, logprobs, _rank in entries:
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
            ids, logprobs, rank = entry
            ranks = [rank, *range(1, len(ids))]
            # The chosen token keeps its own rank even when it is also among the top-k.
            per_token: dict[str, Any] = {}
            for t, lp, r in zip(ids, logprobs, ranks, strict=True):
                per_token.setdefault(
                    str(t), {"logprob": lp, "rank": r, "decoded_token": self.token(t)}
                )
            out.append(per_token)
        return out
