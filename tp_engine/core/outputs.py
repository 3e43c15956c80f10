"""What the engine core reports per step (`StepOutputs`): built by the step pipeline, read by
both front ends.

`LLMEngine.step` is the one output path of both front ends: it returns a `SequenceOutput` for
every sequence with news (a new token, or the end of a prompt-only request), carrying the new
tokens, the logprob entries that came with them and, on a sequence's first output, its prompt
logprobs and prefix-cache hit. `LLM` accumulates them into `RequestOutput`s
(`tp_engine.frontend.outputs`); the server's engine loop sends each one to the API process as it
comes. `EngineStats` is the core's state for metrics.

Logprobs stay the raw numbers recorded on the sequence (`TokenLogprobs`); turning them into
vLLM's dicts with decoded tokens is the front end's (`tp_engine.frontend.outputs.logprob_dicts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tp_engine.core.sequence import TokenLogprobs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SequenceOutput:
    """One step's news of one sequence (see the module docstring)."""

    # The engine's sequence id (`f"{i}_{request_id}"` for sample i of an n > 1 request) and
    # the request it belongs to.
    seq_id: str
    request_id: str
    # Which of its request's n samples this is.
    index: int
    new_token_ids: list[int]
    # The entries of the new tokens, when the request asked for logprobs.
    new_logprobs: list[TokenLogprobs] | None
    # "stop", "length" or "abort" once it finished (then `stop_reason` says what stopped it: a
    # stop token id, or a stop string for a sequence finished by its caller).
    finish_reason: str | None
    stop_reason: int | str | None
    # On a sequence's first output only (else None): its prompt logprobs, when asked for; the
    # prompt tokens found in the prefix cache; seconds from arrival to its first scheduling.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None
    queue_time_s: float | None = None
    # A pooling request's result once it finished (`tp_engine.core.pooled_records`): `[dimensions or
    # hidden]` for an embedding, `[num_labels]` probabilities (a reranker: `[1]`), float32 on
    # the host. None for generation and for an aborted pooling request.
    pooled: torch.Tensor | None = None
    # On the first output only: the time.monotonic() of its first scheduling (one clock for
    # every process of the machine), where vLLM's prefill and inference times start.
    scheduled_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutputs:
    """What one `LLMEngine.step` produced."""

    outputs: list[SequenceOutput]
    # Tokens computed (throughput figures, the server's watchdog): prompt chunks, and decodes
    # that stand (a speculative step's drafts count only where they became output tokens).
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def made_progress(self) -> bool:
        return bool(self.num_prefill_tokens or self.num_decode_tokens)

    def then(self, later: StepOutputs) -> StepOutputs:
        """These outputs followed by `later`'s."""
        return StepOutputs(
            self.outputs + later.outputs,
            self.num_prefill_tokens + later.num_prefill_tokens,
            self.num_decode_tokens + later.num_decode_tokens,
        )


@dataclass(frozen=True)
class EngineStats:
    """The scheduler's and the KV pool's state, for metrics."""

    num_running: int
    num_waiting: int
    # Fraction of KV blocks referenced by a running sequence.
    kv_cache_usage: float
    # Prefix-cache queries and hits, in tokens, since start.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # Speculative decoding since start (vLLM's vllm:spec_decode_* counters): verify entries
    # with drafts, draft tokens, accepted ones, and accepted ones per draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # LoRA (vLLM's vllm:lora_requests_info): the device slots (0: LoRA off) and the names of
    # the adapters of running and of waiting requests.
    max_lora: int = 0
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    # The host-memory KV tier (vLLM's vllm:external_prefix_cache_*): prompt tokens looked up
    # below the device pool and found there, since start; the fraction of its blocks in use.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    host_kv_cache_usage: float = 0.0
    # Prompt tokens the forward passes computed, since start (a decode server of prefill/decode
    # disaggregation computes none of a paired request's).
    prompt_tokens_computed: int = 0
