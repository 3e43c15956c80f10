"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    cumulative_logprob: float | None = None
    logprobs: list[dict] | None = None

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
    # Prompt tokens that came from the prefix cache at the last admission.
    num_cached_tokens: int = 0
