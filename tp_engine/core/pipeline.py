"""The step pipeline: one step of the engine core, schedule → launch → sample → apply.

A step goes through three phases, each its own value:

    ScheduledStep ──launch──► LaunchedStep ──sample──► SampledStep ──apply──► StepOutputs
    (Scheduler.schedule)      (plan handed to the      (sampling and its      (Scheduler.update,
                              executor, forward        host copies queued)    outputs built)
                              queued)

Synchronously, `step()` runs all three. With asynchronous scheduling (`async_scheduling`, on
with a GPU) the pipeline is one step deep, as vLLM's async scheduling and SGLang's overlap
scheduler: `step()` launches step t while step t-1 is in flight, then applies step t-1 (waiting
for its tokens) and returns its outputs, and last queues step t's sampling. The GPU never waits
for rank 0's Python: while it runs step t, rank 0 applies step t-1 and schedules step t+1.
Step t's decodes read step t-1's tokens on the device (placeholder input ids, see
`plan_builder`). A step whose tokens will never be applied (an exception on the way) is undone
with `Scheduler.discard`.

One exception keeps the time to first token from paying for the overlap: a step that computes
the last token of a prompt (its outputs hold a sequence's first token, or a prompt-only
sequence's end; `LaunchedStep.ends_prompt`) is applied by the call that launched it, as
synchronously: that call returns its first tokens, and the next call launches with nothing in
flight. Overlapped, the first token would wait for step t+1's schedule, plan and launch (about
1 ms with a CUDA graph, the whole host-bound forward pass for an eager mixed step, the whole
forward on a CPU). The price: the GPU idles for rank 0's update, schedule and plan once per
step that ends a prompt, not once per token, and the step's other outputs (step t-1's, applied
before it) wait for it too (`benchmarks/results/cpu/first-token/README.md`). SGLang makes the
same trade for a prefill followed by a prefill. The rule depends on the batch alone, never on
timing, so which call returns which token stays reproducible.

Sampling stays on rank 0: `SamplingBatchBuilder` turns the running batch's parameter arrays and
its logits processors' per-row state (it follows the batch's rows) into one step's tensors, and
`tp_engine.core.sampling` draws from the executor's logits rows. Logprobs (raw: log_softmax of the
model's logits) are recorded on the sequences; prompt logprobs ask the plan for more logits rows
(every prompt position of the chunk), placed after the sampled ones. A pooling model's head rows
are copied to the host with the step's other results and finished per request
(`tp_engine.core.pooled_records`).

Ownership: one `StepPipeline` per `EngineCore` (`tp_engine.core.engine_core`), a member given
the scheduler (again after `reconfigure`), the intake (held siblings), the grammar gate, the
sampler, the proposer and the `PlanRunner` through which the executor
(`tp_engine.executor.base.Executor`) runs the plans; it owns the step in flight and the
outputs not delivered yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from shm_ipc import StepPlan
from shm_ipc.block_copies import encode_block_copies
from tp_engine.common.transfers import HostCopies
from tp_engine.core.drafting import schedule_step
from tp_engine.core.outputs import SequenceOutput, StepOutputs
from tp_engine.core.plan_builder import LogitsLayout, plan_step
from tp_engine.core.pooled_records import record_pooled
from tp_engine.core.sampling import LogprobsTensors, sample_batch
from tp_engine.core.sampling.logprob_records import (
    prompt_logprob_tensors,
    record_prompt_logprobs,
    record_sample_logprobs,
)
from tp_engine.core.scheduled_step import ScheduledStep
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.core.spec_verify import accept_drafts

if TYPE_CHECKING:
    from tp_engine.core.grammar_gate import GrammarGate
    from tp_engine.core.hooks import CoreHooks
    from tp_engine.core.intake import RequestIntake
    from tp_engine.core.plan_runner import PlanRunner
    from tp_engine.core.running_batch import RunningBatch
    from tp_engine.core.sampling.batch import SamplingBatchBuilder
    from tp_engine.core.scheduled_step import DraftProposer
    from tp_engine.core.scheduler import Scheduler
    from tp_engine.core.spec_metrics import SpecDecodeStats


@dataclass(frozen=True, eq=False)
class LaunchedStep:
    """Scheduled, sent to every rank, its forward pass queued."""

    step_id: int
    scheduled: ScheduledStep
    # [layout.num_rows, V] on rank 0's device.
    logits: torch.Tensor
    layout: LogitsLayout
    # The step computes a prompt's last token (see the module docstring): asynchronously too,
    # the call that launched it applies it.
    ends_prompt: bool


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


class StepPipeline:
    """One step at a time, overlapped or not (see the module docstring)."""

    def __init__(
        self,
        runner: PlanRunner,
        scheduler: Scheduler,
        intake: RequestIntake,
        grammar_gate: GrammarGate,
        sampling: SamplingBatchBuilder,
        hooks: CoreHooks,
        proposer: DraftProposer | None,
        spec_stats: SpecDecodeStats,
        *,
        num_speculative_tokens: int,
        async_scheduling: bool,
    ) -> None:
        self.runner = runner
        # Replaced by `EngineCore.reconfigure` (a new scheduler, no request running).
        self.scheduler = scheduler
        self.intake = intake
        self.grammar_gate = grammar_gate
        self.sampling = sampling
        self.hooks = hooks
        self.proposer = proposer
        self.spec_stats = spec_stats
        self.num_speculative_tokens = num_speculative_tokens
        self.async_scheduling = async_scheduling
        # Prompt tokens the applied steps computed, since start (metrics).
        self.prompt_tokens_computed = 0
        # The last step whose sampled tokens were waited for: its plan ran on every rank.
        self.applied_step_id = -1
        # The step launched and sampled by the last `step()` call, not applied yet, and outputs
        # of a call that an exception interrupted (the next call returns them).
        self.in_flight: SampledStep | None = None
        self._undelivered = StepOutputs([])

    def step(self) -> StepOutputs:
        """Run one step; returns the outputs it produced.

        With asynchronous scheduling the outputs are those of the step launched by the
        previous call (see the module docstring); a call that launches nothing applies the
        step in flight, so stepping while `has_unfinished()` finishes every request; a step that
        ends a prompt is applied by the call that launches it (its first tokens are that call's
        outputs). A call interrupted by an exception loses nothing: steps whose tokens were not
        applied are undone, and outputs already made are returned by the next call.
        """
        self.runner.check_usable()
        if self.hooks.before_step and self.scheduler.gate.admitting:
            # Closed while paused or asleep: nothing waiting is admitted, and a sleeping rank
            # refuses writes to its slots (LoRA's control calls run here).
            self._before_step()
        if self.intake.holds_siblings:
            self.intake.release_held()
        outputs, self._undelivered = self._undelivered, StepOutputs([])
        if self.grammar_gate.compiling:
            outputs = outputs.then(self._release_compiled())
        previous, self.in_flight = self.in_flight, None
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
                if self.async_scheduling and not launched.ends_prompt:
                    self.in_flight = sampled
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

    def _before_step(self) -> None:
        """The features' chores before scheduling (`CoreHooks.before_step`: LoRA's adapter
        slots, control calls, so before anything of this step is taken); the sequences they
        ended are reported with this step's outputs."""
        ended: list[Sequence] = []
        for hook in self.hooks.before_step:
            ended += hook(self.intake.queued_outside())
        if ended:
            self._undelivered = self._undelivered.then(
                StepOutputs([self._output(seq) for seq in ended])
            )

    def _release_compiled(self) -> StepOutputs:
        """Admit the requests whose grammar is compiled; those whose compilation failed or ran
        out of time end, reported in the outputs (`GrammarGate.release`)."""
        idle = not self.scheduler.has_unfinished() and self.in_flight is None
        admitted, failed = self.grammar_gate.release(idle)
        for seqs in admitted:
            self.intake.admit(seqs)
        return StepOutputs([self._output(seq) for seq in failed])

    def quiesce(self) -> None:
        """Apply the step in flight (asynchronous scheduling), if any, and keep its outputs
        for the next `step()`: afterwards no step is in flight and the next plan reads no
        placeholder tokens. A later `step()` schedules as a call that launched nothing would
        have left it."""
        previous, self.in_flight = self.in_flight, None
        if previous is None:
            return
        try:
            self._undelivered = self._undelivered.then(self._apply(previous))
        except BaseException:
            self.scheduler.discard(previous.scheduled)  # its tokens will never be applied
            raise

    def settle(self) -> None:
        """Apply the step in flight and drop its outputs (`EngineCore.reconfigure`, idle: its
        rows are those of finished requests only, all discarded)."""
        if self.in_flight is not None:
            self._apply(self.in_flight)
            self.in_flight = None

    def _launch(self, in_flight: SampledStep | None) -> LaunchedStep | None:
        """Schedule a step, send its plan to every rank and queue its forward pass; its
        placeholder inputs read `in_flight`'s sampled ids."""
        step_id = self.runner.step_id
        with self.runner.phase("schedule", step_id):
            scheduled = schedule_step(self.scheduler, self.proposer)
        if scheduled.is_empty:
            return None
        # A draft model's DRAFT plans, sent by `schedule_step`, took the ids before this one.
        step_id = self.runner.step_id
        with self.runner.phase("build_plan", step_id):
            plan, layout = plan_step(
                scheduled, step_id, self.scheduler.batch, self.hooks.plan_sections
            )
            # KV blocks moving between tiers (evicted ones down, hits below up): every rank
            # copies them down before this plan's forward pass and up beside it.
            copies = self.scheduler.take_block_copies()
            if copies:
                values = encode_block_copies(copies, scheduled.reads_copies_up)
                plan = plan.with_sections(block_copies=values)
        self.runner.take_step_id()
        # Before anything is applied: the prompt lengths are those of the rows as scheduled.
        ends_prompt = self.async_scheduling and _ends_prompt(scheduled, self.scheduler.batch)
        try:
            logits = self._run_forward(plan, in_flight)
        except BaseException:
            self.scheduler.discard(scheduled)
            raise
        return LaunchedStep(step_id, scheduled, logits, layout, ends_prompt)

    def _run_forward(self, plan: StepPlan, in_flight: SampledStep | None) -> torch.Tensor:
        """Run `plan` on every rank through the executor; its logits rows."""
        return self.runner.run_plan(plan, in_flight.token_ids if in_flight is not None else None)

    def _sample(self, step: LaunchedStep) -> SampledStep:
        """Queue sampling of every sampled logits row of `step` (one token per sampling entry,
        or one per verified position), the logprobs asked for, and their copies to the host;
        nothing here waits for the GPU."""
        scheduled, logits, layout = step.scheduled, step.logits, step.layout
        host = HostCopies(logits.device)
        token_ids = host_token_ids = logprobs = prompt_logprobs = None
        logprob_seqs: list[Sequence] = []
        with self.runner.phase("sample", step.step_id):
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
        with self.runner.phase("update", step.step_id):
            with self.runner.failures_named(f"step {step.step_id}"):
                step.host.wait()  # a failure of the step on the GPU surfaces here
            self.applied_step_id = step.step_id
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
                self.spec_stats.record(
                    step.layout.num_drafts, result.num_appended, self.num_speculative_tokens
                )
                # Drafts that were not output (rejected, or after a stop) decoded nothing.
                output_drafts = np.maximum(result.num_appended - 1, 0)
                num_decode_tokens -= int((step.layout.num_drafts - output_drafts).sum())
            if step.logprobs is not None:
                record_sample_logprobs(step.logprob_seqs, step.logprobs)
            if self.grammar_gate.constrained:
                self.grammar_gate.follow(
                    lambda seq_id: self.scheduler.finish(seq_id, SequenceStatus.FINISHED_ABORTED)
                )
            outputs = [self._output(seq) for seq in result.sampled]
            sampled_ids = {id(seq) for seq in result.sampled}
            # A prompt-only request ends without a token; its caller still has to hear of it.
            outputs += [self._output(s) for s in result.finished if id(s) not in sampled_ids]
        num_prefill_tokens = scheduled.num_batched_tokens - scheduled.num_decodes
        self.prompt_tokens_computed += num_prefill_tokens
        return StepOutputs(outputs, num_prefill_tokens, num_decode_tokens)

    def output_of(self, seq: Sequence) -> SequenceOutput:
        """The news of `seq` since its last output, outside a step (a decode server's first
        token, which the prefill server sampled)."""
        return self._output(seq)

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
            scheduled_at=seq.scheduled_at if first else None,
        )


def _ends_prompt(step: ScheduledStep, batch: RunningBatch) -> bool:
    """Whether `step` computes the last token of some entry's prompt and so reports on it:
    its first token, or the end of a prompt-only sequence. A recomputation after preemption
    ends past the prompt (its outputs count), so it does not; a decode starts past it."""
    rows = step.rows
    ends = step.starts + step.num_scheduled  # [B]
    reports = (step.samples | batch.prompt_only[rows]) if batch.num_prompt_only else step.samples
    return bool(np.any(reports & (ends == batch.prompt_len[rows])))


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
