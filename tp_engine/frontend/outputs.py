"""What `LLM.generate` builds from the engine core's step outputs
(`tp_engine.core.outputs.SequenceOutput`), shaped like vLLM's `RequestOutput`.

Logprobs have vLLM's shape: per generated token a dict `{token_id: Logprob}` holding the top-k
tokens and the sampled one (k or k + 1 entries); prompt logprobs are the same per prompt token,
with None for the first token (nothing predicts it). The engine records raw numbers on the
sequence (`TokenLogprobs`); `logprob_dicts` turns them into these dicts with decoded tokens.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Any

from tp_engine.core.sequence import TokenLogprobs


@dataclass
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`)."""

    logprob: float
    # 1 = most likely token at that position.
    rank: int | None = None
    # The token alone, detokenized (`tokenizer.decode([token_id])`): "" for an id the tokenizer
    # does not know (a padding row of the LM head past the tokenizer's vocabulary), as in vLLM.
    decoded_token: str | None = None


# Per generated token; per prompt token (None for the first).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    # "stop", "length" or "abort"; None while the sequence is still running.
    finish_reason: str | None = None
    # The stop token id or stop string that ended it, if one did.
    stop_reason: int | str | None = None
    # Sum of the sampled tokens' logprobs; None unless logprobs were asked for.
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # Prompt tokens that came from the prefix cache at the last admission (first sample).
    num_cached_tokens: int = 0
    # None unless prompt_logprobs were asked for.
    prompt_logprobs: PromptLogprobs | None = None


def logprob_dicts(
    entries: SequenceOf[TokenLogprobs | None], tokenizer: Any
) -> list[dict[int, Logprob] | None]:
    """Recorded entries -> vLLM's dicts, decoding every distinct token once (`batch_decode`
    gives "" for ids the tokenizer does not know)."""
    distinct = sorted({t for e in entries if e is not None for t in e.token_ids})
    # (batch_decode of an empty list is not an empty list.)
    pieces = tokenizer.batch_decode([[t] for t in distinct]) if distinct else []
    decoded = dict(zip(distinct, pieces, strict=True))
    out: list[dict[int, Logprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        # The chosen token first, then the top-k (which keep their rank when they repeat it).
        chosen = entry.token_ids[0]
        d = {chosen: Logprob(entry.logprobs[0], entry.rank, decoded[chosen])}
        for rank, (t, lp) in enumerate(
            zip(entry.token_ids[1:], entry.logprobs[1:], strict=True), start=1
        ):
            d[t] = Logprob(lp, rank, decoded[t])
        out.append(d)
    return out
