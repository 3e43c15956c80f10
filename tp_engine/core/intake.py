"""Request intake: requests in (checked, fanned out to n sequences), and ended from outside.

A request with `n > 1` becomes n sequences. The first runs at once; the others are held until
the first has computed its prompt, so that they find its full prompt blocks in the prefix cache
(the block manager registers full blocks after each step) instead of computing them again.
A request with a structured-output constraint waits in the `GrammarGate` instead.

A pooling model (`model_spec`: an embedder or a reranker) takes `PoolingParams` instead: a
prompt-only sequence whose last prompt token is a pooled row of the plan (`plan_builder`).

Ownership: one `RequestIntake` per `EngineCore` (`tp_engine.core.engine_core`), a member given
the scheduler (again after `reconfigure`), the grammar gate and the request checks' facts; it
owns the held siblings (until handed to the scheduler) and the tokenizer's think-token ids.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from tp_engine.common.thinking import (
    ThinkTokens,
    needs_think_tokens,
    think_tokens,
    with_think_tokens,
)
from tp_engine.core.remote_prompts import RemotePrompts
from tp_engine.core.sampling import MAX_NUM_LOGPROBS
from tp_engine.core.scheduled_step import RequestRejectedError
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling_params import SamplingParams, tokenize_bad_words

if TYPE_CHECKING:
    from tp_engine.core.grammar_gate import GrammarGate
    from tp_engine.core.hooks import CoreHooks
    from tp_engine.core.scheduler import Scheduler
    from tp_engine.lora_request import LoRARequest


class RequestIntake:
    """Requests in and ended from outside (see the module docstring). `model_spec`: the
    model's task (`rank_worker.models.model_spec.ModelSpec`); `generation_defaults`: SamplingParams
    fields the checkpoint sets."""

    def __init__(
        self,
        scheduler: Scheduler,
        grammar_gate: GrammarGate,
        hooks: CoreHooks,
        *,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int] | set[int] | tuple[int, ...],
        model_spec: Any,
        generation_defaults: dict[str, Any],
    ) -> None:
        # Replaced by `EngineCore.reconfigure` (a new scheduler, the same requests: none).
        self.scheduler = scheduler
        self.grammar_gate = grammar_gate
        self.hooks = hooks
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_spec = model_spec
        self.generation_defaults = generation_defaults
        # The tokenizer's <think> / </think> ids, read on the first request with a budget.
        self._think_tokens: ThinkTokens | None = None
        # n > 1: id of a request's first sequence -> its siblings, held until its prompt is
        # computed (see the module docstring).
        self._held: dict[str, tuple[Sequence, list[Sequence]]] = {}
        # A decode server's requests whose prompt another server computes, until it arrives.
        self.remote = RemotePrompts(lambda: self.scheduler, eos_token_ids)

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams from request fields where None means unset: unset fields take the
        checkpoint's generation-config defaults, then vLLM's (`SamplingParams.from_optional`)."""
        return SamplingParams.from_optional(self.generation_defaults, **fields)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        disaggregation: str | None = None,
    ) -> list[str]:
        """Queue a request as `params.n` sequences sharing the prompt; returns their ids, in
        sample order. Raises ValueError (RequestRejectedError) saying what is wrong; nothing is
        queued then. `lora_request`: the LoRA adapter it runs with (None: the base model).
        `disaggregation`: its role in prefill/decode disaggregation. "decode": another server
        computes its prompt, held in `remote` until its K/V arrives (n == 1, no constraint);
        "prefill": its blocks are kept when it finishes, until the decode has them.

        `PoolingParams` (a pooling model only): one prompt-only sequence whose output carries
        `pooled`, its result, once its prompt is computed (`_add_pooling_request`).

        With n == 1 the sequence's id is `request_id`; with n > 1 sample i is `f"{i}_{id}"`
        (vLLM's child ids), its seed is `seed + i` when a seed is given (vLLM's rule, so the
        samples differ), and only sample 0 computes prompt logprobs (they would be the same).
        """
        for check in self.hooks.admission_checks:
            check()  # after sleep(level=2), until new weights
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise RequestRejectedError(
                    f"request {request_id!r}: LoRA adapters serve generation only; a pooling "
                    "request runs on the base model (drop lora_request)"
                )
            return self._add_pooling_request(request_id, prompt_token_ids, params, arrival_time)
        self._check_request(request_id, prompt_token_ids, params)
        # Bad words become token sequences here unless the API server did it already.
        sampling = tokenize_bad_words(params, self.tokenizer)
        sampling.check_vocab(self.vocab_size)
        sampling.check_first_step(self.vocab_size, self.eos_token_ids)
        if needs_think_tokens(sampling):
            # A thinking budget given without the think token ids (`LLM.generate`): this
            # tokenizer's, and where the prompt leaves thinking (ValueError if it has none).
            if self._think_tokens is None:
                self._think_tokens = think_tokens(self.tokenizer)
            sampling = with_think_tokens(sampling, self._think_tokens, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if sampling.n == 1:
            seqs = [Sequence(request_id, prompt_token_ids, sampling, arrival)]
        else:
            seqs = []
            for i in range(sampling.n):
                child = dataclasses.replace(
                    sampling,
                    n=1,
                    seed=None if sampling.seed is None else sampling.seed + i,
                    prompt_logprobs=sampling.prompt_logprobs if i == 0 else None,
                )
                seq = Sequence(f"{i}_{request_id}", prompt_token_ids, child, arrival)
                seq.group_id = request_id
                seq.sample_index = i
                seqs.append(seq)
        taken = [s.seq_id for s in seqs if self._is_known(s.seq_id)]
        if taken:
            raise RequestRejectedError(f"request id {taken[0]!r} is already in use")
        self.scheduler.check_fits(seqs[0])  # the siblings are the same size
        if lora_request is not None:
            if self.hooks.attach_adapter is None:
                raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled!")
            self.hooks.attach_adapter(lora_request, seqs)
        for seq in seqs:
            seq.keeps_blocks = disaggregation == "prefill"
        if disaggregation == "decode":
            _check_remote(request_id, sampling)
            self.remote.hold(seqs[0])
        elif sampling.structured_outputs is not None:
            self.grammar_gate.submit(sampling.structured_outputs, seqs)
        else:
            self.admit(seqs)
        return [seq.seq_id for seq in seqs]

    def _add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        arrival_time: float | None,
    ) -> list[str]:
        """A prompt-only sequence (`max_tokens` 0: it samples nothing and ends, its blocks
        freed, once its prompt is computed) whose last prompt token is a pooled row. Chunked
        prefill and the prefix cache apply as to any prompt; a full hit still computes the
        last token, whose row the head needs."""
        resolved = params.resolve(self.model_spec)
        self._check_token_ids(request_id, prompt_token_ids)
        if self._is_known(request_id):
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(request_id, prompt_token_ids, SamplingParams(max_tokens=0), arrival)
        seq.pooling_params = resolved
        self.scheduler.check_fits(seq)
        self.scheduler.add(seq)
        return [seq.seq_id]

    def admit(self, seqs: list[Sequence]) -> None:
        """Queue a request's first sequence and hold its siblings (see the module docstring)."""
        self.scheduler.add(seqs[0])
        if len(seqs) > 1:
            self._held[seqs[0].seq_id] = (seqs[0], seqs[1:])

    def _check_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: expected SamplingParams, got {params!r}")
        if self.model_spec.is_pooling:
            raise ValueError(
                f"request {request_id!r}: generation is not supported for pooling models (this "
                f"one serves {self.model_spec.task!r}); send PoolingParams, or serve the model "
                "with runner='generate' (--runner generate)"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_NUM_LOGPROBS:
                raise ValueError(
                    f"SamplingParams.{name}={value} exceeds the maximum of {MAX_NUM_LOGPROBS} "
                    "log-probabilities per token"
                )
        # A structured-output constraint was parsed by the caller (the API process within its
        # time limit, or LLM.generate); a bad one that gets here fails its compilation, which
        # ends that request alone.
        self._check_token_ids(request_id, prompt_token_ids)

    def _check_token_ids(self, request_id: str, prompt_token_ids: list[int]) -> None:
        if not isinstance(prompt_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids
        ):
            raise ValueError(f"request {request_id!r}: prompt token ids must be a list of integers")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token ids {bad[:5]} are outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    def is_compiling(self, seq_id: str) -> bool:
        """Whether the request whose first sequence is `seq_id` waits for its grammar."""
        return seq_id in self.grammar_gate.compiling

    def _is_known(self, seq_id: str) -> bool:
        return self.scheduler.get(seq_id) is not None or any(
            seq.seq_id == seq_id for seq in self.queued_outside()
        )

    def queued_outside(self) -> Iterator[Sequence]:
        """Sequences not in the scheduler yet: held siblings and requests being compiled."""
        for _, held in self._held.values():
            yield from held
        yield from self.grammar_gate.queued()
        yield from self.remote.held()

    def waiting(self) -> list[Sequence]:
        """The scheduler's waiting queue, first come first served (features read it: LoRA
        loads the adapters it needs)."""
        return list(self.scheduler.waiting)

    def abort_request(self, seq_id: str) -> bool:
        """Abort one sequence (a held n > 1 sibling included); False if unknown or finished."""
        return self.finish_request(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish_request(
        self,
        seq_id: str,
        status: SequenceStatus,
        stop_reason: int | str | None = None,
    ) -> bool:
        """End one sequence from outside the step loop: an abort, or a stop string its caller
        found in its text (`FINISHED_STOPPED` with the string as `stop_reason`). False if it is
        unknown or finished already."""
        for _, held in self._held.values():
            for seq in held:
                if seq.seq_id == seq_id:
                    held.remove(seq)
                    seq.status = status
                    seq.stop_reason = stop_reason
                    return True
        if self.grammar_gate.remove(seq_id, status, stop_reason):
            return True
        if self.remote.drop(seq_id, status) is not None:
            return True
        return self.scheduler.finish(seq_id, status, stop_reason) is not None

    def abort_unfinished(self) -> list[str]:
        """Abort every unfinished sequence (running, waiting, held, compiling); returns their
        ids. Call it quiesced: a step in flight would still compute for them."""
        running = [seq.seq_id for seq in self.scheduler.running]
        waiting = [seq.seq_id for seq in self.scheduler.waiting]
        outside = [seq.seq_id for seq in self.queued_outside()]
        return [sid for sid in running + waiting + outside if self.abort_request(sid)]

    def has_unfinished(self, *, remote: bool = True) -> bool:
        """Whether any request is unfinished (`remote` False: not counting those whose prompt
        another server computes, for which no step can do anything yet). (A step still in
        flight once every request has finished carries nothing anyone waits for; the next
        step or `reconfigure` retires it.)"""
        return (
            self.scheduler.has_unfinished()
            or any(held for _, held in self._held.values())
            or bool(self.grammar_gate.compiling)
            or (remote and bool(len(self.remote)))
        )

    @property
    def holds_siblings(self) -> bool:
        """Whether some n > 1 request's siblings are held (`release_held` has work)."""
        return bool(self._held)

    def release_held(self) -> None:
        """Queue the held siblings of every first sample whose prompt has been computed (it
        has an output token) or that ended; its full prompt blocks are in the prefix cache."""
        for first_id, (first, held) in list(self._held.items()):
            if first.num_output_tokens or first.is_finished:
                del self._held[first_id]
                for seq in held:
                    self.scheduler.add(seq)


def _check_remote(request_id: str, sampling: SamplingParams) -> None:
    """What a request whose prompt another server computes cannot ask for (yet)."""
    why = None
    if sampling.n != 1:
        why = f"n={sampling.n} (one sample per request)"
    elif sampling.structured_outputs is not None:
        why = "a structured-output constraint"
    elif sampling.prompt_logprobs is not None:
        why = "prompt_logprobs (the prompt is computed on the prefill server)"
    if why is not None:
        raise RequestRejectedError(
            f"request {request_id!r}: a disaggregated decode server does not serve {why}"
        )
