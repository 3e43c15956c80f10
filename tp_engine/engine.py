"""Rank 0's engine: requests in, one step at a time, outputs out.

`LLMEngine` owns the control plane (Scheduler, BlockManager), this rank's ModelRunner, the plan
channel to the other ranks and the sampler. Its public surface is what the two front ends
(`LLM`, the server's engine loop) use, and nothing else changes a sequence's state:

    add_request / abort_request / finish_request    requests in, or ended from outside
    step() -> StepOutputs                           one step, and the outputs it produced
    stats() / has_unfinished() / diagnose_stall()   state for metrics, loops and watchdogs
    control.call(op, args)                          a control call to every rank, between
                                                    steps (`tp_engine.control`)
    reconfigure() / shutdown()

A step goes through three phases, each its own value:

    ScheduledStep ──launch──► LaunchedStep ──sample──► SampledStep ──apply──► StepOutputs
    (Scheduler.schedule)      (plan sent to every     (sampling and its      (Scheduler.update,
                              rank, forward queued)   host copies queued)    outputs built)

Synchronously, `step()` runs all three. With asynchronous scheduling (`async_scheduling`, on
with a GPU) the pipeline is one step deep, as vLLM's async scheduling and SGLang's overlap
scheduler: `step()` launches step t while step t-1 is in flight, then applies step t-1 (waiting
for its tokens) and returns its outputs, and last queues step t's sampling. The GPU never waits
for rank 0's Python: while it runs step t, rank 0 applies step t-1 and schedules step t+1.
Step t's decodes read step t-1's tokens on the device (placeholder input ids, see
`plan_builder`). A step whose tokens will never be applied (an exception on the way) is undone
with `Scheduler.discard`.

Sampling stays on rank 0: `SamplingBatchBuilder` turns the running batch's parameter arrays and
its logits processors' per-row state (it follows the batch's rows) into one step's tensors, and
`tp_engine.sampling` draws from the gathered logits. Logprobs (raw:
log_softmax of the model's logits) are recorded on the sequences; prompt logprobs ask the plan
for more logits rows (every prompt position of the chunk), placed after the sampled ones.

A request with a structured-output constraint waits, off the scheduler, until its grammar is
compiled on a background thread (`tp_engine.structured_outputs`); the other requests keep
running meanwhile. One that is not compiled within `structured_outputs_timeout_s` ends, alone. Each of its sequences then gets a matcher, which `_apply` advances with the
sequence's new tokens and the sampling builder asks for the next step's token bitmask. With
asynchronous scheduling that stays exact: step t+1's mask is filled in `_sample`, after step t's
tokens were applied, while step t+1's forward runs on the GPU.

A pooling model (`model_spec`: an embedder or a reranker) takes `PoolingParams` instead: a
prompt-only sequence whose last prompt token is a pooled row of the plan (`plan_builder`); its
head row is copied to the host with the step's other results and finished per request
(`tp_engine.pooling`), and the sequence ends with its blocks freed, `SequenceOutput.pooled` set.

A request with `n > 1` becomes n sequences. The first runs at once; the others are held until
the first has computed its prompt, so that they find its full prompt blocks in the prefix cache
(the block manager registers full blocks after each step) instead of computing them again.

Start-up mirrors `rank_worker.worker.run_worker` on the other ranks (see
`rank_worker.bootstrap` for the order). A failure on another rank surfaces here as
`EngineDeadError` naming that rank and step.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import wait as wait_for_futures
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rank_worker.bootstrap import Bootstrap
from rank_worker.fault_injection import Fault
from rank_worker.model_runner import ModelRunner
from rank_worker.model_spec import HeadSpec, ModelSpec, load_hf_config
from rank_worker.runner_config import RunnerConfig
from rank_worker.step import StepExecutor
from rank_worker.tp import TPInfo
from shm_ipc import ChannelError, PlanBroadcaster, StepPlan
from tp_engine import lora_control, weight_updates
from tp_engine.block_manager import BlockManager
from tp_engine.config import EngineConfig
from tp_engine.control import EngineControl, EngineInconsistentError
from tp_engine.engine_states import Gate, PauseMode
from tp_engine.failures import EngineDeadError, FailureGuard, diagnose_stall
from tp_engine.generation_config import eos_token_ids, sampling_defaults
from tp_engine.lora import LoRARequest
from tp_engine.outputs import EngineStats, SequenceOutput, StepOutputs
from tp_engine.plan_builder import LogitsLayout, plan_step
from tp_engine.pooling import record_pooled
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling import MAX_NUM_LOGPROBS, LogprobsTensors, sample_batch
from tp_engine.sampling.batch import SamplingBatchBuilder
from tp_engine.sampling.logprob_records import (
    prompt_logprob_tensors,
    record_prompt_logprobs,
    record_sample_logprobs,
)
from tp_engine.sampling.profiling import profile_sampling
from tp_engine.sampling_params import SamplingParams, tokenize_bad_words
from tp_engine.scheduler import RequestRejectedError, ScheduledStep, Scheduler
from tp_engine.sequence import Sequence, SequenceStatus
from tp_engine.sleep import EngineSleep
from tp_engine.speculative import NgramProposer, SpecDecodeStats, accept_drafts
from tp_engine.speculative.draft_model import DraftModelProposer
from tp_engine.step_timeline import StepTimeline, gpu_phase_or_null, phase_or_null
from tp_engine.structured_outputs import GrammarCompiler, GrammarState, compile_verdict
from tp_engine.thinking import (
    ThinkTokens,
    needs_think_tokens,
    think_tokens,
    turn_boundary_ids,
    with_think_tokens,
)
from tp_engine.transfers import HostCopies

logger = logging.getLogger(__name__)

__all__ = ["EngineDeadError", "LLMEngine", "RequestRejectedError"]


@dataclass(frozen=True, eq=False)
class LaunchedStep:
    """Scheduled, sent to every rank, its forward pass queued."""

    step_id: int
    scheduled: ScheduledStep
    # [layout.num_rows, V] on rank 0's device.
    logits: torch.Tensor
    layout: LogitsLayout


@dataclass(frozen=True, eq=False)
class SampledStep:
    """Its sampling and the copies of the results to the host are queued; nothing waited."""

    step_id: int
    scheduled: ScheduledStep
    layout: LogitsLayout
    # [sampled rows] int64 on the device: what the next step's placeholder inputs read.
    token_ids: torch.Tensor | None
    # Valid once `host.wait()` returns: the sampled ids, the logprobs of `logprob_seqs` and
    # the prompt logprobs of `prompt_rows`.
    host: HostCopies
    host_token_ids: torch.Tensor | None
    logprobs: LogprobsTensors | None
    logprob_seqs: list[Sequence]
    prompt_logprobs: LogprobsTensors | None
    # [P, head width] fp32 on the host once waited for: the head's rows of `layout.pooled_rows`.
    pooled: torch.Tensor | None = None


def max_logits_rows_per_step(config: EngineConfig) -> int:
    """The most logits rows the scheduler can put in one step (what the memory warm-up must
    budget). A sequence asking for prompt logprobs takes a row per token it computes (its
    prompt rows, then its sampled row), any other a row if it samples. With chunked prefill the
    scheduler gives prompt logprobs at most max_num_seqs tokens per step, and such a sequence
    is one of the max_num_seqs: at most max_num_seqs + (max_num_seqs - 1) rows. Without it, a
    whole prompt's rows: up to every token of the step. Speculative decoding adds a row per
    draft: up to k more per sequence."""
    budget = config.resolved_max_num_batched_tokens
    if not config.enable_chunked_prefill:
        return budget
    return min(budget, (2 + _num_drafts(config)) * config.max_num_seqs - 1)


def max_sampled_rows_per_step(config: EngineConfig) -> int:
    """The most rows one step samples: one per sequence, and one per draft it verifies."""
    rows = (1 + _num_drafts(config)) * config.max_num_seqs
    return min(rows, config.resolved_max_num_batched_tokens)


def _num_drafts(config: EngineConfig) -> int:
    spec = config.speculative_config
    return 0 if spec is None else spec.num_speculative_tokens


def runner_config_for(config: EngineConfig, head: HeadSpec | None = None) -> RunnerConfig:
    """What every rank is told of `config`; `head`: the model's output head (None: LM head)."""
    if config.max_model_len is None:
        raise ValueError("max_model_len is not resolved yet; call with_model_defaults first")
    return RunnerConfig(
        max_model_len=config.max_model_len,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.resolved_max_num_batched_tokens,
        max_num_logits_rows=max_logits_rows_per_step(config),
        max_num_sampled_rows=max_sampled_rows_per_step(config),
        dtype=config.dtype,
        seed=config.seed,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        enforce_eager=config.enforce_eager,
        attention_backend=config.attention_backend,
        enable_expert_parallel=config.enable_expert_parallel,
        kv_cache_dtype=config.kv_cache_dtype,
        gpu_data_paths=config.gpu_data_paths,
        draft_model=_draft_model_dir(config),
        hf_overrides=config.hf_overrides,
        head=None if head is None else head.to_dict(),
        enable_lora=config.enable_lora,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        max_cpu_loras=config.max_cpu_loras,
        lora_dtype=config.lora_dtype,
    )


class LLMEngine:
    """The engine on rank 0 of a process group of `tp.size` ranks."""

    def __init__(self, config: EngineConfig, tp: TPInfo, fault: Fault | None = None):
        from transformers import AutoTokenizer  # deferred: slow to import

        if not tp.is_first:
            raise ValueError("LLMEngine runs on rank 0; other ranks run rank_worker.run_worker")
        if config.tensor_parallel_size != tp.size:
            raise ValueError(
                f"tensor_parallel_size ({config.tensor_parallel_size}) does not match the "
                f"process group's size ({tp.size})"
            )
        model_dir = Path(config.model) if config.model else _demo_model_dir()
        hf_config = load_hf_config(model_dir, config.hf_overrides)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or str(model_dir))
        # Task, head and context length, decided once here and shipped to every rank.
        self.model_spec = ModelSpec.resolve(
            model_dir, hf_config, config.runner, config.convert, self._token_id
        )
        _check_pooling_config(self.model_spec, config)
        # The same rope spec sizes every rank's cos/sin table (rank_worker/qwen3.py).
        rope = self.model_spec.rope
        self.config = config.with_model_defaults(rope.max_positions, rope.max_positions_source)
        self._launch_config = self.config
        self.model_dir = model_dir
        self.tp = tp
        self.vocab_size = int(hf_config.vocab_size)
        draft_dir = _draft_model_dir(self.config)
        if draft_dir is not None:
            check_draft_model(draft_dir, self.vocab_size, self.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, model_dir)
        # SamplingParams fields the checkpoint sets for requests that leave them unset.
        self.generation_defaults = sampling_defaults(model_dir)
        # The tokenizer's <think> / </think> ids, read on the first request with a budget.
        self._think_tokens: ThinkTokens | None = None
        # n > 1: id of a request's first sequence -> its siblings, held until its prompt is
        # computed (see the module docstring).
        self._held: dict[str, tuple[Sequence, list[Sequence]]] = {}
        # Requests with a structured-output constraint whose grammar is being compiled: the id
        # of the first sequence -> the compilation and the request's sequences. And the
        # sequences with a matcher that have not finished.
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self._compiling: dict[str, tuple[Future, list[Sequence]]] = {}
        # When each compilation must be done by (`structured_outputs_timeout_s` after submit).
        self._compile_deadlines: dict[str, float] = {}
        # Set by the server's engine loop: the verdict on each constraint, by the request's
        # first sequence id (None: compiled; else why not), until it takes them.
        self.compile_verdicts: dict[str, str | None] | None = None
        self._constrained: set[Sequence] = set()
        self._turn_boundaries: tuple[int, ...] | None = None
        runner_config = runner_config_for(self.config, self.model_spec.head)

        self.channel: PlanBroadcaster | None = None
        self.step_id = 0
        # Once a step has failed, every later call raises this.
        self._dead: EngineDeadError | None = None
        # Once a control call's commit has failed, every later step raises this (the ranks
        # may hold different weights), but the channel works: shutdown still sends EXIT.
        self._inconsistent: EngineInconsistentError | None = None
        try:
            if tp.size > 1:
                self.channel = PlanBroadcaster(num_readers=tp.size - 1)
                Bootstrap(str(model_dir), runner_config, self.channel.handle).send(tp)
                self.channel.wait_for_readers()
            with self.failures_named("start-up"):
                self.runner = ModelRunner(model_dir, runner_config, tp, tp.device)
                # A pooling model samples nothing: no sampler to leave room for.
                self.num_kv_blocks = self.runner.determine_num_kv_blocks(
                    None if self.model_spec.is_pooling else profile_sampling
                )
                self.runner.init_kv_cache(self.num_kv_blocks)
            self.executor = StepExecutor(self.runner, tp, fault)
        except BaseException:
            if self.channel is not None:
                self.channel.close()  # the workers see CLOSE and exit non-zero
            raise
        self.sampling = SamplingBatchBuilder(
            self.vocab_size, self.eos_token_ids, self.runner.device, self.config.seed
        )
        self.spec = self.config.speculative_config
        self.proposer = self._build_proposer()
        # Drafts proposed and accepted since start (vLLM's spec_decode metrics).
        self.spec_stats = SpecDecodeStats()
        # Paused (`pause`), and how; None while serving.
        self.pause_mode: PauseMode | None = None
        # Sleep mode (`tp_engine.sleep`): what sleeps on every rank; it closes the gate too.
        self.sleep_state = EngineSleep(self)
        # Control calls to every rank (`tp_engine.control`), run between steps.
        self.control = EngineControl(self)
        # LoRA adapters' slots and pins (`tp_engine.lora`); None without enable_lora.
        self.lora = lora_control.build_registry(self.config, self.control)
        self.scheduler = self._build_scheduler(self.config)
        self.async_scheduling = self._resolve_async(self.config)
        if self.spec is not None:
            logger.info(
                "speculative decoding (%s, k=%d): synchronous scheduling; verify steps run "
                "eagerly%s",
                self.spec.method,
                self.spec.num_speculative_tokens,
                " (the decode CUDA graphs replay only steps without drafts)"
                if self.runner.graph_runner is not None
                else "",
            )
        # The step launched and sampled by the last `step()` call, not applied yet, and outputs
        # of a call that an exception interrupted (the next call returns them).
        self._in_flight: SampledStep | None = None
        self._undelivered = StepOutputs([])
        # Set to a StepTimeline to record where each step's time goes (launch/bench.py).
        self.timeline: StepTimeline | None = None
        self.sampling.follow(self.scheduler.batch)
        # The label of the weights in use (SGLang's `weight_version`); set by weight updates.
        self.weight_version = "default"

    # -- requests --------------------------------------------------------------------------------

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams from request fields where None means unset: unset fields take the
        checkpoint's generation-config defaults, then vLLM's (`SamplingParams.from_optional`)."""
        return SamplingParams.from_optional(self.generation_defaults, **fields)

    def _token_id(self, text: str) -> int | None:
        """The tokenizer's id of the single token `text`, None if it is not one."""
        tid = self.tokenizer.convert_tokens_to_ids(text)
        return None if tid is None or tid == self.tokenizer.unk_token_id else int(tid)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[str]:
        """Queue a request as `params.n` sequences sharing the prompt; returns their ids, in
        sample order. Raises ValueError (RequestRejectedError) saying what is wrong; nothing is
        queued then. `lora_request`: the LoRA adapter it runs with (None: the base model).

        `PoolingParams` (a pooling model only): one prompt-only sequence whose output carries
        `pooled`, its result, once its prompt is computed (`_add_pooling_request`).

        With n == 1 the sequence's id is `request_id`; with n > 1 sample i is `f"{i}_{id}"`
        (vLLM's child ids), its seed is `seed + i` when a seed is given (vLLM's rule, so the
        samples differ), and only sample 0 computes prompt logprobs (they would be the same).
        """
        self.sleep_state.check_can_generate()  # after sleep(level=2), until new weights
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise RequestRejectedError(
                    f"request {request_id!r}: LoRA adapters serve generation only; a pooling "
                    "request runs on the base model (drop lora_request)"
                )
            return self._add_pooling_request(request_id, prompt_token_ids, params, arrival_time)
        self._check_request(request_id, prompt_token_ids, params)
        # Bad words become token sequences here unless the API server did it already.
        params = tokenize_bad_words(params, self.tokenizer)
        params.check_vocab(self.vocab_size)
        params.check_first_step(self.vocab_size, self.eos_token_ids)
        if needs_think_tokens(params):
            # A thinking budget given without the think token ids (`LLM.generate`): this
            # tokenizer's, and where the prompt leaves thinking (ValueError if it has none).
            if self._think_tokens is None:
                self._think_tokens = think_tokens(self.tokenizer)
            params = with_think_tokens(params, self._think_tokens, prompt_token_ids)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            seqs = [Sequence(request_id, prompt_token_ids, params, arrival)]
        else:
            seqs = []
            for i in range(params.n):
                child = dataclasses.replace(
                    params,
                    n=1,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None,
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
            lora_control.attach(self, lora_request, seqs)
        if params.structured_outputs is not None:
            future = self.grammars.submit(params.structured_outputs)
            self._compiling[seqs[0].seq_id] = (future, seqs)
            self._compile_deadlines[seqs[0].seq_id] = (
                time.monotonic() + self.config.structured_outputs_timeout_s
            )
        else:
            self._admit(seqs)
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

    def _admit(self, seqs: list[Sequence]) -> None:
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
        return seq_id in self._compiling

    def _is_known(self, seq_id: str) -> bool:
        return self.scheduler.get(seq_id) is not None or any(
            seq.seq_id == seq_id for seq in self._queued_outside()
        )

    def _queued_outside(self) -> Iterator[Sequence]:
        """Sequences not in the scheduler yet: held siblings and requests being compiled."""
        for _, held in self._held.values():
            yield from held
        for _, seqs in self._compiling.values():
            yield from seqs

    def abort_request(self, seq_id: str) -> bool:
        """Abort one sequence (a held n > 1 sibling included); False if unknown or finished."""
        return self.finish_request(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish_request(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> bool:
        """End one sequence from outside the step loop: an abort, or a stop string its caller
        found in its text (`FINISHED_STOPPED` with the string as `stop_reason`). False if it is
        unknown or finished already."""
        for waiting in [held for _, held in self._held.values()] + [
            seqs for _, seqs in self._compiling.values()
        ]:
            for seq in waiting:
                if seq.seq_id == seq_id:
                    waiting.remove(seq)
                    seq.status = status
                    seq.stop_reason = stop_reason
                    self._compiling = {k: v for k, v in self._compiling.items() if v[1]}
                    self._compile_deadlines = {
                        k: d for k, d in self._compile_deadlines.items() if k in self._compiling
                    }
                    return True
        return self.scheduler.finish(seq_id, status, stop_reason) is not None

    def has_unfinished(self) -> bool:
        """Whether any request is unfinished. (A step still in flight once every request has
        finished carries nothing anyone waits for; the next step or `reconfigure` retires it.)"""
        return (
            self.scheduler.has_unfinished()
            or any(held for _, held in self._held.values())
            or bool(self._compiling)
        )

    def has_work(self) -> bool:
        """Whether `step()` can make progress now: unfinished requests that the engine's state
        lets run (paused: the running ones in "wait" mode only), or a step in flight."""
        if self._in_flight is not None:
            return True
        gate = self.scheduler.gate  # the one reading of pause and sleep (`update_gate`)
        if self._inconsistent is not None or not gate.stepping:
            # Ranks that may disagree, asleep, weights lost, or frozen: nothing runs until a
            # load of every weight, a wake or a resume.
            return False
        return self.has_unfinished() if gate.admitting else len(self.scheduler.batch) > 0

    def pause(self, mode: PauseMode) -> list[str]:
        """Stop serving new work (`tp_engine.engine_states`): nothing is admitted until `resume`;
        "abort" ends every unfinished sequence now (returns their ids: their outputs say
        FINISHED_ABORTED with what they had), "wait" lets the running ones finish, "keep" also
        freezes those. The step in flight is applied first, so nothing runs on the ranks once
        this returns in "abort" and "keep" mode; its outputs come with the next `step()`."""
        self.quiesce()
        aborted = self.abort_unfinished() if mode is PauseMode.ABORT else []
        self.pause_mode = mode
        self.update_gate()
        return aborted

    def resume(self) -> None:
        """Serve again after `pause`: waiting requests are admitted, frozen ones continue
        (unless the engine sleeps: `wake_up` then lets them run)."""
        self.pause_mode = None
        self.update_gate()

    def abort_unfinished(self) -> list[str]:
        """Abort every unfinished sequence (running, waiting, held, compiling); returns their
        ids. Call it quiesced: a step in flight would still compute for them."""
        running = [seq.seq_id for seq in self.scheduler.running]
        waiting = [seq.seq_id for seq in self.scheduler.waiting]
        outside = [seq.seq_id for seq in self._queued_outside()]
        return [sid for sid in running + waiting + outside if self.abort_request(sid)]

    def update_gate(self) -> None:
        """Set the scheduler's gate from the engine's states: closed while asleep (or the
        weights are lost), else as the pause mode says."""
        self.scheduler.gate = self._gate()

    def _gate(self) -> Gate:
        if self.sleep_state.holds_requests:
            return Gate(admitting=False, stepping=False)
        return Gate.for_pause(self.pause_mode, None if self.lora is None else self.lora.admits)

    # -- LoRA adapters (`tp_engine.lora_control`) --------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return lora_control.add_lora(self, lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return lora_control.remove_lora(self, lora_int_id)

    def list_loras(self) -> set[int]:
        return lora_control.list_loras(self)

    def _prepare_adapter_slots(self) -> None:
        """Slots for the adapters the waiting requests need (control calls, so before anything
        of this step is taken); requests whose adapter the ranks refused end here."""
        failed = lora_control.prepare_slots(self, self._queued_outside())
        if failed:
            self._undelivered = self._undelivered.then(
                StepOutputs([self._output(seq) for seq in failed])
            )

    # -- sleep mode (`tp_engine.sleep`) -----------------------------------------------------------

    def sleep(self, level: int = 1, mode: str = "abort") -> list[str]:
        """Release the weights (level 1: kept on the host; 2: discarded) and the KV cache on
        every rank; aborts the unfinished requests (returns their ids)."""
        return self.sleep_state.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore "weights", "kv_cache" or both (None) on every rank."""
        self.sleep_state.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.sleep_state.is_sleeping

    def note_weights_loaded(self) -> None:
        """A full weight update wrote every parameter: serve again after sleep(level=2)."""
        self.sleep_state.note_weights_loaded()

    def stats(self) -> EngineStats:
        scheduler, bm = self.scheduler, self.scheduler.block_manager
        return EngineStats(
            num_running=len(scheduler.batch),
            num_waiting=len(scheduler.waiting) + sum(1 for _ in self._queued_outside()),
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=scheduler.num_preemptions,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.accepted_per_pos),
            **lora_control.adapter_stats(self),
        )

    def _release_held(self) -> None:
        """Queue the held siblings of every first sample whose prompt has been computed (it
        has an output token) or that ended; its full prompt blocks are in the prefix cache."""
        for first_id, (first, held) in list(self._held.items()):
            if first.num_output_tokens or first.is_finished:
                del self._held[first_id]
                for seq in held:
                    self.scheduler.add(seq)

    def _release_compiled(self) -> StepOutputs:
        """Admit the requests whose grammar is compiled, each sequence with its matcher; a
        compilation that failed, or is not done by its deadline, ends its request (aborted,
        reported in the outputs and, for the server, in `compile_verdicts`). Waits a little for
        a compilation when there is nothing else to do."""
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            wait_for_futures([f for f, _ in self._compiling.values()], timeout=0.05,
                             return_when="FIRST_COMPLETED")  # fmt: skip
        failed = []
        for first_id, (future, seqs) in list(self._compiling.items()):
            settled, why = compile_verdict(
                future, self._compile_deadlines[first_id], self.config.structured_outputs_timeout_s
            )
            if not settled:
                continue
            del self._compiling[first_id]
            del self._compile_deadlines[first_id]
            if self.compile_verdicts is not None:
                self.compile_verdicts[first_id] = why
            if why is not None:
                logger.error("request %r: %s", seqs[0].group_id or first_id, why)
                for seq in seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                failed += seqs
                continue
            for seq in seqs:
                seq.grammar = self._grammar_state(seq, future.result())
                self._constrained.add(seq)
            self._admit(seqs)
        return StepOutputs([self._output(seq) for seq in failed])

    def _grammar_state(self, seq: Sequence, compiled: object) -> GrammarState:
        """A matcher for `seq`; with the think token ids set, the constraint applies after the
        thinking, from where the prompt leaves it (`tp_engine.structured_outputs`)."""
        params = seq.sampling_params
        if params.think_end_token_id is None:
            return GrammarState(compiled)
        if self._turn_boundaries is None:
            self._turn_boundaries = turn_boundary_ids(self.tokenizer)
        think = ThinkTokens(
            -1 if params.think_start_token_id is None else params.think_start_token_id,
            params.think_end_token_id,
            self._turn_boundaries,
        )
        prompt_state = think.prompt_state(seq.token_ids[: seq.num_prompt_tokens])
        return GrammarState(
            compiled, params.think_start_token_id, params.think_end_token_id, prompt_state
        )

    def _follow_grammars(self) -> None:
        """Advance the matchers with the tokens just applied. A sequence whose token its
        matcher rejects (the mask makes that impossible for a sampled token) is aborted."""
        for seq in list(self._constrained):
            if seq.is_finished:
                self._constrained.discard(seq)
                continue
            assert seq.grammar is not None
            if not seq.grammar.advance(seq.token_ids, seq.num_prompt_tokens):
                logger.error("request %r: output token %d breaks its constraint; aborted",
                             seq.seq_id, seq.token_ids[-1])  # fmt: skip
                self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_ABORTED)
                self._constrained.discard(seq)

    # -- stepping --------------------------------------------------------------------------------

    def step(self) -> StepOutputs:
        """Run one step; returns the outputs it produced.

        With asynchronous scheduling the outputs are those of the step launched by the
        previous call (see the module docstring); a call that launches nothing applies the
        step in flight, so stepping while `has_unfinished()` finishes every request. A call
        interrupted by an exception loses nothing: steps whose tokens were not applied are
        undone, and outputs already made are returned by the next call.
        """
        self.check_usable()
        if self.lora is not None and self.scheduler.gate.admitting:
            # Closed while paused or asleep: nothing waiting is admitted, and a sleeping rank
            # refuses writes to its slots.
            self._prepare_adapter_slots()
        if self._held:
            self._release_held()
        outputs, self._undelivered = self._undelivered, StepOutputs([])
        if self._compiling:
            outputs = outputs.then(self._release_compiled())
        previous, self._in_flight = self._in_flight, None
        pending: list[ScheduledStep] = [previous.scheduled] if previous else []
        try:
            launched = self._launch(previous)
            if launched is not None:
                pending.append(launched.scheduled)
            if previous is not None:
                outputs = outputs.then(self._apply(previous))
                pending.remove(previous.scheduled)
            if launched is not None:
                # After `_apply`: penalties and min_tokens see the tokens it appended.
                sampled = self._sample(launched)
                if self.async_scheduling:
                    self._in_flight = sampled
                else:
                    outputs = outputs.then(self._apply(sampled))
                pending.clear()
            return outputs
        except BaseException:
            # Steps whose tokens will never be applied: their sequences compute them again.
            for scheduled in pending:
                self.scheduler.discard(scheduled)
            self._undelivered = outputs
            raise

    def check_usable(self, repairing: bool = False) -> None:
        """Raise why the engine cannot step, if it cannot (a rank failed, or a control call's
        commit failed; `repairing`: a weight load, which an inconsistent engine still takes)."""
        if self._dead is not None:
            raise self._dead
        if self._inconsistent is not None and not repairing:
            raise self._inconsistent

    @property
    def inconsistent(self) -> EngineInconsistentError | None:
        """Why the ranks may hold different models (a failed commit), until a full weight
        load repairs it; None while they agree."""
        return self._inconsistent

    def note_consistent(self) -> None:
        """A weight load wrote every weight on every rank: the ranks agree again."""
        self._inconsistent = None

    def quiesce(self) -> None:
        """Apply the step in flight (asynchronous scheduling), if any, and keep its outputs
        for the next `step()`: afterwards no step is in flight and the next plan reads no
        placeholder tokens. A later `step()` schedules as a call that launched nothing would
        have left it."""
        previous, self._in_flight = self._in_flight, None
        if previous is None:
            return
        try:
            self._undelivered = self._undelivered.then(self._apply(previous))
        except BaseException:
            self.scheduler.discard(previous.scheduled)  # its tokens will never be applied
            raise

    def take_step_id(self) -> int:
        """The next step id, for a message sent to every rank outside `step()` (a control
        call): plans and calls share one counter, so ids give their order on the channel."""
        step_id = self.step_id
        self.step_id += 1
        return step_id

    def mark_inconsistent(self, error: EngineInconsistentError) -> None:
        self._inconsistent = error

    def _launch(self, in_flight: SampledStep | None) -> LaunchedStep | None:
        """Schedule a step, send its plan to every rank and queue its forward pass; its
        placeholder inputs read `in_flight`'s sampled ids."""
        step_id = self.step_id
        with self._phase("schedule", step_id):
            scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return None
        # A draft model's DRAFT plans, sent while scheduling, took the ids before this one.
        step_id = self.step_id
        with self._phase("build_plan", step_id):
            plan, layout = plan_step(scheduled, step_id, self.scheduler.batch)
        self.step_id += 1
        try:
            logits = self._run_forward(plan, in_flight)
        except BaseException:
            self.scheduler.discard(scheduled)
            raise
        return LaunchedStep(step_id, scheduled, logits, layout)

    def _run_forward(self, plan: StepPlan, in_flight: SampledStep | None) -> torch.Tensor:
        """Send `plan` to the other ranks and run rank 0's forward pass over it."""
        return self._run_plan(plan, in_flight.token_ids if in_flight is not None else None)

    def _run_draft_plan(self, plan: StepPlan, sampled: torch.Tensor | None) -> torch.Tensor:
        """A DRAFT plan of the draft-model proposer (numbered here), run on every rank."""
        plan = dataclasses.replace(plan, step_id=self.step_id)
        self.step_id += 1
        with self._phase("draft", plan.step_id):
            return self._run_plan(plan, sampled)

    def _run_plan(self, plan: StepPlan, sampled: torch.Tensor | None) -> torch.Tensor:
        """Publish `plan` and run rank 0's pass; `sampled`: what its placeholder ids read."""
        step_id = plan.step_id
        with self.failures_named(f"step {step_id}"):
            if self.channel is not None:
                with self._phase("broadcast", step_id):
                    self.channel.publish(plan)
                    # A worker that died since the last step would leave rank 0 waiting in the
                    # forward's first collective; find out now, with its rank and report.
                    self.channel.check_readers()
            with self._phase("forward", step_id), self._gpu_phase("gpu_forward", step_id):
                logits = self.executor.run(plan, sampled)
        assert logits is not None  # rank 0 always gets the gathered logits
        return logits

    def _sample(self, step: LaunchedStep) -> SampledStep:
        """Queue sampling of every sampled logits row of `step` (one token per sampling entry,
        or one per verified position), the logprobs asked for, and their copies to the host;
        nothing here waits for the GPU."""
        scheduled, logits, layout = step.scheduled, step.logits, step.layout
        host = HostCopies(logits.device)
        token_ids = host_token_ids = logprobs = prompt_logprobs = None
        logprob_seqs: list[Sequence] = []
        with self._phase("sample", step.step_id):
            if layout.num_sampled_rows:
                rows = scheduled.rows[scheduled.samples]
                live = self.scheduler.batch.live(rows, scheduled.serials[scheduled.samples])
                ahead = drafts = None
                if layout.num_drafts is not None:
                    # A verify entry samples each of its positions: its row once per position.
                    counts = layout.num_drafts + 1
                    rows, live = np.repeat(rows, counts), np.repeat(live, counts)
                    ahead = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
                    drafts = _drafts_per_row(layout.num_drafts, scheduled.draft_tokens)
                batch = self.sampling.build(self.scheduler.batch, rows, live, ahead, drafts)
                result = sample_batch(logits[layout.sampled], batch.metadata)
                token_ids = result.token_ids
                host_token_ids = host.copy(result.token_ids)
                if result.logprobs is not None:
                    logprobs = host.copy_fields(result.logprobs)
                    logprob_seqs = batch.logprob_seqs
            if layout.prompt_rows:
                tensors = prompt_logprob_tensors(logits[layout.prompt], layout.prompt_rows)
                prompt_logprobs = host.copy_fields(tensors)
            pooled = host.copy(logits[layout.pooled]) if layout.pooled_rows else None
            host.record()
        return SampledStep(
            step.step_id, scheduled, layout, token_ids, host, host_token_ids,
            logprobs, logprob_seqs, prompt_logprobs, pooled,
        )  # fmt: skip

    def _apply(self, step: SampledStep) -> StepOutputs:
        """Wait for `step`'s tokens and apply them: logprobs, Scheduler.update, outputs.

        A sequence that stopped running since `step` was scheduled (aborted, preempted or
        already finished) gets nothing from it (its draws are counter-based: sampling that
        position again draws the same, so there is nothing to undo).
        """
        scheduled = step.scheduled
        with self._phase("update", step.step_id):
            with self.failures_named(f"step {step.step_id}"):
                step.host.wait()  # a failure of the step on the GPU surfaces here
            tokens = (
                np.zeros(0, dtype=np.int64)
                if step.host_token_ids is None
                else step.host_token_ids.numpy()
            )
            num_emitted = None
            if step.layout.num_drafts is not None:
                assert scheduled.draft_tokens is not None
                verdict = accept_drafts(tokens, step.layout.num_drafts, scheduled.draft_tokens)
                tokens, num_emitted = verdict.token_ids, verdict.num_emitted
            if step.prompt_logprobs is not None:
                record_prompt_logprobs(step.prompt_logprobs, step.layout.prompt_rows)
            if step.pooled is not None:
                record_pooled(step.pooled, step.layout.pooled_rows)
            result = self.scheduler.update(scheduled, tokens, num_emitted)
            num_decode_tokens = scheduled.num_decodes
            if step.layout.num_drafts is not None:
                # Counted once applied: only drafts that became output tokens are accepted.
                self.spec_stats.record(step.layout.num_drafts, result.num_appended, self.proposer_k)
                # Drafts that were not output (rejected, or after a stop) decoded nothing.
                output_drafts = np.maximum(result.num_appended - 1, 0)
                num_decode_tokens -= int((step.layout.num_drafts - output_drafts).sum())
            if step.logprobs is not None:
                record_sample_logprobs(step.logprob_seqs, step.logprobs)
            if self._constrained:
                self._follow_grammars()
            outputs = [self._output(seq) for seq in result.sampled]
            sampled_ids = {id(seq) for seq in result.sampled}
            # A prompt-only request ends without a token; its caller still has to hear of it.
            outputs += [self._output(s) for s in result.finished if id(s) not in sampled_ids]
        num_prefill_tokens = scheduled.num_batched_tokens - scheduled.num_decodes
        return StepOutputs(outputs, num_prefill_tokens, num_decode_tokens)

    def _output(self, seq: Sequence) -> SequenceOutput:
        """The news of `seq` since its last output: its new tokens (several after a
        speculative step; none at the end of a prompt-only request)."""
        first = not seq.reported
        seq.reported = True
        params = seq.sampling_params
        new = seq.token_ids[seq.num_prompt_tokens + seq.num_reported_tokens :]
        seq.num_reported_tokens = seq.num_output_tokens
        new_logprobs = None
        if params.logprobs is not None:
            new_logprobs = seq.output_logprobs[len(seq.output_logprobs) - len(new) :]
        return SequenceOutput(
            seq_id=seq.seq_id,
            request_id=seq.group_id,
            index=seq.sample_index,
            new_token_ids=new,
            new_logprobs=new_logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            prompt_logprobs=list(seq.prompt_logprobs)
            if first and params.prompt_logprobs is not None
            else None,
            num_cached_tokens=seq.num_cached_tokens if first else None,
            queue_time_s=seq.queue_time_s if first else None,
            pooled=seq.pooled,
        )

    def diagnose_stall(self) -> EngineDeadError | None:
        """For a watchdog thread while `step()` is stuck: what the workers say about the step
        in progress (see `failures.diagnose_stall`), or None when every worker is silent and
        alive (a rank is truly hung)."""
        return diagnose_stall(self.channel, self.step_id - 1)

    def _phase(self, name: str, step_id: int) -> Any:
        return phase_or_null(self.timeline, name, step_id)

    def _gpu_phase(self, name: str, step_id: int) -> Any:
        """Device time between two CUDA events (nothing on CPU, where `_phase` is the work)."""
        return gpu_phase_or_null(self.timeline, name, step_id)

    @contextmanager
    def failures_named(self, what: str) -> Iterator[None]:
        """Turn a failure into EngineDeadError naming the rank at fault; the engine is dead
        from then on."""
        try:
            with FailureGuard(self.channel, what):
                yield
        except EngineDeadError as exc:
            self._dead = exc
            raise

    # -- configuration of rank-0-only knobs --------------------------------------------------------

    def reconfigure(self, **changes: Any) -> None:
        """Change scheduling knobs that only rank 0 uses (prefix caching, chunked prefill, token
        budget, sequence cap, or a pool smaller than the allocated one) between batches. Changes
        apply to the configuration the engine was launched with (earlier calls are forgotten),
        and the new block manager starts with an empty prefix cache.

        The workers are not involved: their caches keep the same shape and whatever the new
        block manager hands out is overwritten before it is read.
        """
        if self.has_unfinished():
            raise RuntimeError("reconfigure needs an idle engine")
        if self._in_flight is not None:
            self._apply(self._in_flight)  # rows of finished requests only: all discarded
            self._in_flight = None
        allowed = {
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "max_num_batched_tokens",
            "max_num_seqs",
            "num_kv_blocks",
            "async_scheduling",
        }
        if set(changes) - allowed:
            raise ValueError(f"only {sorted(allowed)} can change at run time")
        num_blocks = changes.get("num_kv_blocks") or self.num_kv_blocks
        if num_blocks > self.num_kv_blocks:
            raise ValueError(
                f"num_kv_blocks {num_blocks} exceeds the allocated {self.num_kv_blocks}"
            )
        config = dataclasses.replace(self._launch_config, **changes)
        if config.max_num_seqs > self._launch_config.max_num_seqs:
            raise ValueError(
                f"max_num_seqs cannot grow past the launch value ({self._launch_config.max_num_seqs})"
            )
        launch_budget = self._launch_config.resolved_max_num_batched_tokens
        if config.resolved_max_num_batched_tokens > launch_budget:
            raise ValueError(
                f"the token budget cannot grow past the launch budget ({launch_budget})"
            )
        pending = self.scheduler.batch.take_changes()
        self.config = config
        self.scheduler = self._build_scheduler(config, num_blocks)
        # Rows given up since the last plan: the workers' mirrors still have to hear of it.
        self.scheduler.batch.changes = pending
        self.sampling.follow(self.scheduler.batch)
        self.async_scheduling = self._resolve_async(config)

    def _resolve_async(self, config: EngineConfig) -> bool:
        if config.speculative_config is not None:
            return False  # EngineConfig refuses async_scheduling=True with it
        if config.async_scheduling is not None:
            return config.async_scheduling
        return self.runner.device.type == "cuda"

    def _build_scheduler(self, config: EngineConfig, num_blocks: int | None = None) -> Scheduler:
        bm = BlockManager(
            num_blocks or self.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        scheduler = Scheduler(config, bm, self.eos_token_ids, self.proposer)
        scheduler.gate = self._gate()
        if self.proposer is not None:
            self.proposer.follow(scheduler.batch)
        if self.lora is not None:
            self.lora.follow(scheduler.batch)
        return scheduler

    def _build_proposer(self) -> NgramProposer | DraftModelProposer | None:
        """The draft proposer of `speculative_config` (None without one)."""
        spec = self.spec
        if spec is None:
            return None
        if spec.method == "draft_model":
            return DraftModelProposer(
                spec.num_speculative_tokens, self._run_draft_plan, may_draft=self._may_draft
            )
        return NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
            may_draft=self._may_draft,
        )  # fmt: skip

    def _may_draft(self, rows: np.ndarray) -> np.ndarray:
        return self.sampling.may_draft(rows)

    @property
    def proposer_k(self) -> int:
        return 0 if self.spec is None else self.spec.num_speculative_tokens

    # -- shutdown --------------------------------------------------------------------------------

    # -- weight updates (`tp_engine.weight_updates`) ---------------------------------------------

    def load_weights(self, weights: Any, **kwargs: Any) -> int:
        return weight_updates.load_weights(self, weights, **kwargs)

    def update_weights_from_disk(self, model_path: str | Path, **kwargs: Any) -> None:
        weight_updates.update_weights_from_disk(self, model_path, **kwargs)

    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        weight_updates.init_weights_update_group(self, *args, **kwargs)

    def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> None:
        weight_updates.update_weights_from_distributed(self, *args, **kwargs)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        weight_updates.destroy_weights_update_group(self, group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return weight_updates.get_weights_by_name(self, name, truncate_size)

    def reset_prefix_cache(self) -> bool:
        return weight_updates.reset_prefix_cache(self)

    def shutdown(self) -> None:
        """Tell the workers to exit, release the channel and give back this rank's device
        memory (weights, KV cache, graphs, buffers). Idempotent."""
        self.grammars.shutdown()
        self._in_flight = None  # its tensors live on the device
        try:
            if self.channel is not None:
                channel, self.channel = self.channel, None
                try:
                    if self._dead is None:
                        channel.publish(StepPlan.exit(self.step_id))
                except ChannelError as exc:
                    logger.warning("workers could not be told to exit: %s", exc)
                finally:
                    channel.close()
        finally:
            self.runner.release()


def _check_pooling_config(spec: ModelSpec, config: EngineConfig) -> None:
    """A pooling model computes prompts only: nothing to draft or verify."""
    if spec.is_pooling and config.speculative_config is not None:
        raise ValueError(
            f"speculative decoding cannot run with a pooling model (it serves {spec.task!r} "
            "and generates no tokens); leave speculative_config unset"
        )


def _drafts_per_row(
    num_drafts: np.ndarray, draft_tokens: np.ndarray | None
) -> list[np.ndarray | None]:
    """Each sampled row's entry's drafts (None without), for `num_drafts` [S] per sampled
    entry and their tokens, entry after entry."""
    assert draft_tokens is not None
    ends = np.cumsum(num_drafts).tolist()
    per_row: list[np.ndarray | None] = []
    for n, end in zip(num_drafts.tolist(), ends, strict=True):
        per_row += [draft_tokens[end - n : end] if n else None] * (n + 1)
    return per_row


def _draft_model_dir(config: EngineConfig) -> str | None:
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    return spec.model


def check_draft_model(draft_dir: str, vocab_size: int, tokenizer: Any) -> None:
    """Refuse a draft model whose vocabulary is not the target's (its drafts would be other
    tokens): the same number of logits rows and the same tokenizer vocabulary."""
    from transformers import AutoTokenizer

    path = Path(draft_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: the draft model {draft_dir!r} has no config.json")
    draft_vocab = int(load_hf_config(path).vocab_size)
    if draft_vocab != vocab_size:
        raise ValueError(
            f"speculative_config: the draft model's vocabulary ({draft_vocab} logits rows) "
            f"differs from the target's ({vocab_size}); a draft must share the target's "
            "tokenizer and vocabulary (e.g. Qwen3-0.6B for any larger Qwen3)"
        )
    if AutoTokenizer.from_pretrained(str(path)).get_vocab() != tokenizer.get_vocab():
        raise ValueError(
            "speculative_config: the draft model's tokenizer differs from the target's; a draft "
            "must share the target's vocabulary"
        )


def _demo_model_dir() -> Path:
    from tp_engine.checkpoints import demo_checkpoint_dir

    return demo_checkpoint_dir()
