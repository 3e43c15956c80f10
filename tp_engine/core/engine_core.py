"""The engine core on rank 0: requests in, one step at a time through an executor, outputs out.

`EngineCore` owns every request's state, composed of members that each own their part (plain
classes, built here with what they work on, no mixins):

    scheduler       the waiting queue, the running batch and KV manager (`scheduler`, itself
                    composed of managers); rebuilt by `reconfigure`
    intake          requests in, n > 1 fan-out, held siblings (`intake.RequestIntake`)
    pipeline        one step: schedule -> launch -> sample -> apply, the step in flight
                    (`pipeline.StepPipeline`)
    plan_runner     the step-id counter, the dead and inconsistent states, the timeline
                    (`plan_runner.PlanRunner`)
    grammar_gate    requests waiting for their grammar, the sequences with a matcher
    sampling        the sampler's per-row state; `proposer`, speculative decoding's

and the engine's states (pause, the gate). It drives an executor
(`tp_engine.executor.base.Executor`) that it does not build: the bring-up
(`tp_engine.engine.LLMEngine`) starts the ranks and hands it over, and tests hand over a
stand-in. Its public surface is what the front ends (`LLM`, the server's engine loop) and the
features use, and nothing else changes a sequence's state:

    add_request / abort_request / finish_request    requests in, or ended from outside
                                                    (`intake`)
    step() -> StepOutputs                           one step, and the outputs it produced
                                                    (`pipeline`)
    stats() / has_unfinished() / has_work()         state for metrics, loops and watchdogs
    pause / resume / update_gate / quiesce          the engine's states, between steps
    waiting() / reset_prefix_cache() /              what features read and change
    advance_kv_epoch() / follow_batch()             (`hooks.CoreAccess`; `hooks.CoreHooks`
                                                    names where they plug in)
    reconfigure() / shutdown()

A failure on a rank surfaces as `EngineDeadError` naming that rank and step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from tp_engine.common.failures import EngineDeadError
from tp_engine.common.step_timeline import StepTimeline
from tp_engine.config import EngineConfig
from tp_engine.core.engine_states import Gate, PauseMode
from tp_engine.core.grammar_gate import GrammarGate
from tp_engine.core.hooks import CoreHooks
from tp_engine.core.intake import RequestIntake
from tp_engine.core.kv.block_manager import BlockManager
from tp_engine.core.kv.host_tier import HostTier
from tp_engine.core.outputs import EngineStats, StepOutputs
from tp_engine.core.pipeline import StepPipeline
from tp_engine.core.plan_runner import PlanRunner
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.sampling.batch import SamplingBatchBuilder
from tp_engine.core.scheduled_step import DraftProposer
from tp_engine.core.scheduler import Scheduler
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.core.spec_metrics import SpecDecodeStats
from tp_engine.features.structured.grammar import GrammarCompiler
from tp_engine.pooling_params import PoolingParams
from tp_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tp_engine.core.kv.file_tier import FileTier
    from tp_engine.executor.base import Executor
    from tp_engine.executor.control import EngineInconsistentError
    from tp_engine.lora_request import LoRARequest

logger = logging.getLogger(__name__)

__all__ = ["EngineCore"]


class EngineCore:
    """Rank 0's engine core over `executor` (see the module docstring).

    `config`: resolved (`EngineConfig.with_model_defaults`); `model_spec`: the model's task
    and head (`rank_worker.models.model_spec.ModelSpec`, read for `is_pooling` and `task`, and by
    `PoolingParams.resolve`); `generation_defaults`: SamplingParams fields the checkpoint sets
    for requests that leave them unset; `hooks`: what the features plug in (none by default).

    Its members, each owning its state: `plan_runner` (`PlanRunner`: the step-id counter, the dead
    and inconsistent states), `scheduler` (request state), `intake` (requests in), `pipeline`
    (`StepPipeline`: the step in flight), `grammar_gate`, `sampling`, `proposer`.
    """

    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        *,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int] | set[int] | tuple[int, ...],
        model_spec: Any,
        generation_defaults: dict[str, Any] | None = None,
        hooks: CoreHooks | None = None,
        file_tier: FileTier | None = None,
    ) -> None:
        self.config = config
        self._launch_config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_spec = model_spec
        self.generation_defaults = {} if generation_defaults is None else generation_defaults
        self.hooks = CoreHooks() if hooks is None else hooks
        self.num_kv_blocks = executor.num_kv_blocks
        # The host-memory KV tier below the device pool (`kv_offloading_size`): rank 0's index
        # of what every rank's host pool holds, and of the file tier below it (`file_tier`).
        # Kept across `reconfigure`.
        self.host_tier = (
            HostTier(executor.num_host_blocks, file_tier) if executor.num_host_blocks else None
        )
        self.plan_runner = PlanRunner(executor)
        # Requests waiting for their grammar, and the sequences with a matcher.
        self.grammar_gate = GrammarGate(
            GrammarCompiler(tokenizer, vocab_size, eos_token_ids),
            config.structured_outputs_timeout_s,
            tokenizer,
        )
        self.sampling = SamplingBatchBuilder(
            vocab_size, eos_token_ids, executor.device, config.seed
        )
        self.spec = config.speculative_config
        self.proposer = self._build_proposer()
        # Drafts proposed and accepted since start (vLLM's spec_decode metrics).
        self.spec_stats = SpecDecodeStats()
        # Paused (`pause`), and how; None while serving.
        self.pause_mode: PauseMode | None = None
        self.scheduler = self._build_scheduler(config)
        self.intake = RequestIntake(
            self.scheduler,
            self.grammar_gate,
            self.hooks,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            model_spec=model_spec,
            generation_defaults=self.generation_defaults,
        )
        self.pipeline = StepPipeline(
            self.plan_runner,
            self.scheduler,
            self.intake,
            self.grammar_gate,
            self.sampling,
            self.hooks,
            self.proposer,
            self.spec_stats,
            num_speculative_tokens=self.proposer_k,
            async_scheduling=self._resolve_async(config),
        )
        self.sampling.follow(self.scheduler.batch)

    # -- requests (`intake`) and steps (`pipeline`) ----------------------------------------------

    def default_sampling_params(self, **fields: Any) -> SamplingParams:
        """SamplingParams from request fields where None means unset (`RequestIntake`)."""
        return self.intake.default_sampling_params(**fields)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        disaggregation: str | None = None,
    ) -> list[str]:
        """Queue a request as `params.n` sequences; their ids (`RequestIntake.add_request`)."""
        return self.intake.add_request(
            request_id, prompt_token_ids, params, arrival_time, lora_request, disaggregation
        )

    def abort_request(self, seq_id: str) -> bool:
        """Abort one sequence; False if unknown or finished."""
        return self.intake.abort_request(seq_id)

    def finish_request(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> bool:
        """End one sequence from outside the step loop (`RequestIntake.finish_request`)."""
        return self.intake.finish_request(seq_id, status, stop_reason)

    def abort_unfinished(self) -> list[str]:
        """Abort every unfinished sequence; their ids (call it quiesced)."""
        return self.intake.abort_unfinished()

    def has_unfinished(self) -> bool:
        return self.intake.has_unfinished()

    def is_compiling(self, seq_id: str) -> bool:
        """Whether the request whose first sequence is `seq_id` waits for its grammar."""
        return self.intake.is_compiling(seq_id)

    def waiting(self) -> list[Sequence]:
        """The scheduler's waiting queue, first come first served (features read it: LoRA
        loads the adapters it needs)."""
        return self.intake.waiting()

    def step(self) -> StepOutputs:
        """Run one step; the outputs it produced (`StepPipeline.step`)."""
        return self.pipeline.step()

    def quiesce(self) -> None:
        """Apply the step in flight, if any, keeping its outputs for the next `step()`."""
        self.pipeline.quiesce()

    @property
    def async_scheduling(self) -> bool:
        return self.pipeline.async_scheduling

    # -- the ranks (`plan_runner`) ---------------------------------------------------------------

    @property
    def step_id(self) -> int:
        """The id the next plan or control call takes."""
        return self.plan_runner.step_id

    @property
    def timeline(self) -> StepTimeline | None:
        """Where each step's time goes, when set (launch/bench.py)."""
        return self.plan_runner.timeline

    @timeline.setter
    def timeline(self, timeline: StepTimeline | None) -> None:
        self.plan_runner.timeline = timeline

    def check_usable(self, repairing: bool = False) -> None:
        """Raise why the engine cannot step, if it cannot (`PlanRunner.check_usable`)."""
        self.plan_runner.check_usable(repairing)

    def take_step_id(self) -> int:
        """The next step id, for a control call (plans and calls share one counter)."""
        return self.plan_runner.take_step_id()

    def failures_named(self, what: str) -> AbstractContextManager[None]:
        """Turn a failure inside into EngineDeadError naming the rank at fault."""
        return self.plan_runner.failures_named(what)

    def mark_inconsistent(self, error: EngineInconsistentError) -> None:
        """From now on every step raises `error` (a control call's commit failed)."""
        self.plan_runner.inconsistent = error

    def diagnose_stall(self) -> EngineDeadError | None:
        """For a watchdog thread while `step()` is stuck (`PlanRunner.diagnose_stall`)."""
        return self.plan_runner.diagnose_stall()

    @property
    def grammars(self) -> GrammarCompiler:
        return self.grammar_gate.compiler

    @property
    def compile_verdicts(self) -> dict[str, str | None] | None:
        """Set by the server's engine loop: the verdict on each constraint, by the request's
        first sequence id (None: compiled; else why not), until it takes them."""
        return self.grammar_gate.verdicts

    @compile_verdicts.setter
    def compile_verdicts(self, verdicts: dict[str, str | None] | None) -> None:
        self.grammar_gate.verdicts = verdicts

    # -- the engine's states ---------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether `step()` can make progress now: unfinished requests that the engine's state
        lets run (paused: the running ones in "wait" mode only), or a step in flight."""
        if self.pipeline.in_flight is not None:
            return True
        gate = self.scheduler.gate  # the one reading of pause and sleep (`update_gate`)
        if self.plan_runner.inconsistent is not None or not gate.stepping:
            # Ranks that may disagree, asleep, weights lost, or frozen: nothing runs until a
            # load of every weight, a wake or a resume.
            return False
        if not gate.admitting:
            return len(self.scheduler.batch) > 0
        return self.intake.has_unfinished(remote=False)

    def pause(self, mode: PauseMode) -> list[str]:
        """Stop serving new work (`tp_engine.core.engine_states`): nothing is admitted until `resume`;
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

    def update_gate(self) -> None:
        """Set the scheduler's gate from the engine's states: closed while a feature holds
        every request (asleep, or the weights are lost), else as the pause mode says."""
        self.scheduler.gate = self._gate()

    def _gate(self) -> Gate:
        if any(hold() for hold in self.hooks.holds_requests):
            return Gate(admitting=False, stepping=False)
        return Gate.for_pause(self.pause_mode, self.hooks.admits)

    @property
    def inconsistent(self) -> EngineInconsistentError | None:
        """Why the ranks may hold different models (a failed commit), until a full weight
        load repairs it; None while they agree."""
        return self.plan_runner.inconsistent

    def note_consistent(self) -> None:
        """A weight load wrote every weight on every rank: the ranks agree again."""
        self.plan_runner.inconsistent = None

    # -- state for metrics -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        scheduler, kv = self.scheduler, self.scheduler.block_manager
        extra: dict[str, Any] = {}
        for source in self.hooks.stats:
            extra.update(source())
        return EngineStats(
            num_running=len(scheduler.batch),
            num_waiting=len(scheduler.waiting) + sum(1 for _ in self.intake.queued_outside()),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            external_prefix_cache_queries=kv.external_queries,
            external_prefix_cache_hits=kv.external_hits,
            host_kv_cache_usage=0.0 if self.host_tier is None else self.host_tier.usage,
            num_preemptions=scheduler.num_preemptions,
            prompt_tokens_computed=self.pipeline.prompt_tokens_computed,
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.accepted_per_pos),
            **extra,
        )

    # -- the KV manager, for features ------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached block; True when nothing stays cached (vLLM's answer:
        False while running requests still hold cached blocks)."""
        self.drop_cached_blocks()
        return self.num_cached_blocks == 0

    def drop_cached_blocks(self) -> int:
        """Drop every unreferenced cached block (and what the tiers below hold); how many
        device blocks were dropped (SGLang's answer)."""
        return self.scheduler.block_manager.reset_prefix_cache()

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, referenced or not (running requests keep theirs)."""
        return self.scheduler.block_manager.num_cached_blocks

    def advance_kv_epoch(self, flush: bool = True) -> None:
        """New weights: K/V computed before now is never a prefix-cache hit again (`flush`:
        free the unreferenced cached blocks at once)."""
        self.scheduler.block_manager.advance_epoch(flush=flush)

    def follow_batch(self, follow: Callable[[RunningBatch], None]) -> None:
        """Have `follow` follow the running batch, now and after every `reconfigure` (a
        feature's per-row state: LoRA's slots)."""
        self.hooks.batch_followers.append(follow)
        follow(self.scheduler.batch)

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
        self.pipeline.settle()  # rows of finished requests only: all discarded
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
        self.intake.scheduler = self.pipeline.scheduler = self.scheduler
        self.pipeline.async_scheduling = self._resolve_async(config)

    def _resolve_async(self, config: EngineConfig) -> bool:
        if config.speculative_config is not None:
            return False  # EngineConfig refuses async_scheduling=True with it
        if config.async_scheduling is not None:
            return config.async_scheduling
        return self.executor.device.type == "cuda"

    def _build_scheduler(self, config: EngineConfig, num_blocks: int | None = None) -> Scheduler:
        kv = BlockManager(
            num_blocks or self.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            lower=self.host_tier,
        )
        scheduler = Scheduler(config, kv, self.eos_token_ids)
        scheduler.gate = self._gate()
        if self.proposer is not None:
            self.proposer.follow(scheduler.batch)
        for follow in self.hooks.batch_followers:
            follow(scheduler.batch)
        return scheduler

    def _build_proposer(self) -> DraftProposer | None:
        """The draft proposer of `speculative_config`, from the speculative feature's hook
        (None without speculative decoding)."""
        if self.spec is None:
            return None
        if self.hooks.build_proposer is None:
            raise ValueError(
                "speculative_config is set but no proposer is plugged in "
                "(tp_engine.features.speculative.plug_in)"
            )
        return self.hooks.build_proposer(self.plan_runner.run_draft_plan, self._may_draft)

    def _may_draft(self, rows: np.ndarray) -> np.ndarray:
        return self.sampling.may_draft(rows)

    @property
    def proposer_k(self) -> int:
        return 0 if self.spec is None else self.spec.num_speculative_tokens

    def shutdown(self) -> None:
        """Release the executor (the ranks exit and give back their device memory) and the
        grammar compiler's thread. Idempotent."""
        self.grammar_gate.compiler.shutdown()
        self.pipeline.in_flight = None  # its tensors live on the device
        self.plan_runner.shutdown()
