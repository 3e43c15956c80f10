"""A request's mutable state on rank 0: its tokens, its KV blocks and where it is in its life.

Token accounting uses one vocabulary throughout the engine:

    token_ids            = prompt tokens + output tokens so far
    num_prompt_tokens    = len(prompt)
    num_computed_tokens  = tokens whose K/V is in the cache (from the prefix cache or computed)
    num_scheduled_tokens = tokens computed in the current step (lives in `SchedulerOutput`)

A sequence needs `num_tokens - num_computed_tokens` more tokens computed. During prefill that is
the rest of the prompt (possibly in chunks); while decoding it is exactly one (the token sampled
last step). Once a step computes the last token, its logits are sampled and one token is appended.

Between `Scheduler.schedule()` and `Scheduler.update()` a step is in flight: its tokens count in
`num_inflight_tokens` and, if it samples, the unknown token it will produce in
`num_placeholders`. With asynchronous scheduling the next step is scheduled while one is in
flight, so the scheduler plans with `num_tokens + num_placeholders` tokens of which
`num_computed_tokens + num_inflight_tokens` are taken care of; a decode whose token is still a
placeholder reads it on the device from the in-flight step's sampled rows.

While a sequence is RUNNING it owns a row of rank 0's `RunningBatch` (`row`), and these three
counters live there alone, where the scheduler updates every running sequence at once
(`RunningBatch.num_computed[row]`, ...). The sequence holds them only while it is not running;
asking it for them while it runs is an error, so no code can read a stale copy.

Status machine:

    WAITING ──admit──► RUNNING ──finish──► FINISHED_{STOPPED, LENGTH_CAPPED, ABORTED}
       ▲                  │
       └────preempt───────┘   (blocks freed, num_computed_tokens reset to 0; recompute later)
    WAITING ──abort──► FINISHED_ABORTED
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tp_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tp_engine.features.structured.grammar import GrammarState
    from tp_engine.pooling_params import PoolingParams

# Serials start at 1: a RunningBatch row whose serial is 0 is free.
_serials = itertools.count(1)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token / stop string
    FINISHED_LENGTH_CAPPED = "finished_length_capped"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # the client went away or the request was cancelled

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's spelling: "stop", "length" or "abort"; None while not finished."""
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH_CAPPED,
        SequenceStatus.FINISHED_ABORTED,
    }
)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


@dataclass(frozen=True)
class TokenLogprobs:
    """Raw log-probabilities at one position: the chosen token first, then the top-k.

    The chosen token is the sampled one (output) or the actual next token (prompt); it may
    appear again among the top-k. `rank` is the chosen token's rank (1 = most likely); the
    top-k entries have ranks 1..k in order.
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class Sequence:
    """One generation stream. `n > 1` requests are several sequences sharing a prompt."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id!r}: the prompt is empty")
        # The engine's id of this sequence: its request's id, or `f"{i}_{request_id}"` for
        # sample i of an n > 1 request (the request's id is `group_id`).
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params or SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        # Unique for the engine's life: tells apart the sequences that used one batch row.
        self.serial = next(_serials)
        # The RunningBatch row that owns the counters below while RUNNING; None otherwise.
        self.row: int | None = None
        self._num_computed = 0
        # Tokens scheduled in steps not yet applied by `Scheduler.update`, and the samples those
        # steps will append (see the module docstring).
        self._num_inflight = 0
        self._num_placeholders = 0
        # Tokens of the prompt found in the prefix cache at the last admission (for metrics).
        self.num_cached_tokens = 0
        # Physical KV block ids, one per logical block, owned by the BlockManager's bookkeeping.
        self.block_table: list[int] = []
        # Chained prefix-cache hashes of the full blocks of token_ids (tokens and the chain's
        # root, so they stay valid across preemption) and how many leading blocks of
        # block_table have been offered to the prefix cache. Both are maintained by the
        # BlockManager.
        self.block_hashes: list[int] = []
        self.num_committed_blocks = 0
        # What besides its tokens decides whose K/V this sequence may share (an adapter's load
        # id, a user's salt): tagged pairs such as ("adapter", 7), hashed with the weight epoch
        # into the root of its hash chain (`prefix_cache_root`). Empty: the base model.
        self.cache_tags: tuple[tuple[str, object], ...] = ()
        # The load id of its LoRA adapter (`tp_engine.features.lora.registry`); None: the base model.
        self.adapter_id: int | None = None
        # The BlockManager's weight epoch when this sequence's K/V started (its last
        # admission) and the root its block_hashes were chained from (None: base, epoch 0).
        self.cache_epoch = 0
        self.cache_root: int | None = None
        self.num_preemptions = 0
        # Stop token id or stop string that ended the sequence, if any.
        self.stop_reason: int | str | None = None
        # Prefill/decode disaggregation. A prefill server's sequence keeps its blocks when it
        # finishes, until a decode server has read them (`BlockAllocation.kept`); a decode
        # server's arrives with its prompt's blocks filled by the prefill's ranks
        # (`tp_engine.core.remote_prompts`), and its admission computes none of its prompt.
        self.keeps_blocks = False
        self.prompt_arrived = False

        # -- sampling state (rank 0 only) --
        # The request it belongs to (its own id unless it is one of n > 1 samples) and which of
        # its request's samples this is (`CompletionOutput.index`).
        self.group_id = seq_id
        self.sample_index = 0
        # Seconds from arrival to its first admission, and that admission's time.monotonic()
        # (vLLM's first SCHEDULED event: a preemption moves neither); whether the engine has
        # reported on it.
        self.queue_time_s: float | None = None
        self.scheduled_at: float | None = None
        self.reported = False
        # Output tokens already in an output (a speculative step can add several at once).
        self.num_reported_tokens = 0
        # The seed of its sampling noise (int64 holding 64 bits): its request's seed, or one
        # drawn for it, set at its first row (`tp_engine.core.sampling.batch`) and kept for its life.
        self.noise_seed: int | None = None
        # Its structured-output matcher (`tp_engine.features.structured.grammar.GrammarState`) when its
        # request has a constraint, set once the constraint is compiled.
        self.grammar: GrammarState | None = None
        # A pooling request's params (it samples nothing: `max_tokens` 0), and, once the step
        # that computes its last prompt token is applied, its result on the host (float32:
        # `tp_engine.core.pooled_records.finish_pooled`).
        self.pooling_params: PoolingParams | None = None
        self.pooled: torch.Tensor | None = None
        # One entry per output token when `logprobs` is set, and their sum (chosen tokens).
        self.output_logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        # One entry per prompt token when `prompt_logprobs` is set; the first token has none.
        self.prompt_logprobs: list[TokenLogprobs | None] = (
            [None] if self.sampling_params.prompt_logprobs is not None else []
        )

    # -- token accounting ---------------------------------------------------------------------

    @property
    def num_computed_tokens(self) -> int:
        self._refuse_while_running("num_computed")
        return self._num_computed

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self._refuse_while_running("num_computed")
        self._num_computed = value

    @property
    def num_inflight_tokens(self) -> int:
        self._refuse_while_running("num_inflight")
        return self._num_inflight

    @num_inflight_tokens.setter
    def num_inflight_tokens(self, value: int) -> None:
        self._refuse_while_running("num_inflight")
        self._num_inflight = value

    @property
    def num_placeholders(self) -> int:
        self._refuse_while_running("num_placeholders")
        return self._num_placeholders

    @num_placeholders.setter
    def num_placeholders(self, value: int) -> None:
        self._refuse_while_running("num_placeholders")
        self._num_placeholders = value

    def _refuse_while_running(self, name: str) -> None:
        if self.row is not None:
            raise RuntimeError(
                f"{self.seq_id!r} is running: its {name} is RunningBatch.{name}[{self.row}]"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logits(self) -> bool:
        """True while prompt logprobs are asked for and some prompt position lacks them."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    @property
    def is_prompt_only(self) -> bool:
        """`max_tokens == 0`: the prompt is computed (its prompt logprobs recorded, if asked for)
        and the sequence ends without sampling a token."""
        return self.sampling_params.max_tokens == 0

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether admission may reuse cached blocks. Not while prompt logprobs are missing: a
        cached block's positions would never be computed, so their logits never seen (vLLM
        skips prefix-cache reads for such requests too). Its blocks are still cached for others.
        """
        return not self.needs_prompt_logits

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        where = f"row={self.row}" if self.row is not None else f"computed={self._num_computed}"
        return (
            f"Sequence({self.seq_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"{where}, blocks={self.block_table})"
        )
