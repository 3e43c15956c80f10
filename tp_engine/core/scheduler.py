"""Continuous batching on rank 0: which sequences run this step and how many tokens each gets.

`Scheduler` is the core's one handle on request state, composed of managers that each own
their part (members, built here, each given what it works on):

    RequestQueue      the waiting queue and the table of unfinished sequences (`request_queue`)
    RunningBatch      one row per running sequence, the arrays a decode step reads
                      (`running_batch`)
    BlockAllocation   blocks for scheduled tokens, preemption (`block_allocation`)
    VerifyPlanner     speculative decoding's verify entries (`verify_entries`)
    StepPlanner       one step's batch: decodes, prefill chunks, admissions (`step_planner`)
    StepUpdater       applying a step's tokens, stop checks, undoing a discarded step
                      (`scheduler_update`)

and the values it hands over are `scheduled_step`'s. It never runs a proposer: the step
pipeline asks one between `draft_slots()` and `schedule(drafts)` (`drafting`). It drives the KV
manager (`kv`) through the `KVTier` interface.

`update()` takes the sampled token of every sequence that finished its uncomputed tokens this
step, advances the token accounting, registers newly full blocks in the prefix cache and
finishes sequences on EOS, a stop token id, max_tokens or max_model_len. A prompt-only sequence
(max_tokens 0) never samples: it finishes ("length") once its prompt is computed. `discard()`
undoes a scheduled step whose tokens will never be applied (an exception between the two).

Asynchronous scheduling calls `schedule()` for step t+1 before `update()` of step t: a sequence
sampled in step t then decodes a placeholder (its token is read on the device from step t's
sampled rows). A sequence whose placeholder is sure to be its last token (max_tokens,
max_model_len) is not scheduled again; one that stops on EOS or a stop token has its extra row
discarded by the next `update()`. Since every rank runs the steps in order, a block freed while
a step still writes to it is only reused by later steps. A row is recognised by the serial of
the sequence it held when the step was scheduled, so a row given to another sequence meanwhile
is never mistaken for the old one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np

from shm_ipc.block_copies import BlockCopy
from shm_ipc.step_plan import batch_rows
from tp_engine.config import EngineConfig
from tp_engine.core.block_allocation import BlockAllocation
from tp_engine.core.engine_states import Gate
from tp_engine.core.kv.base import KVTier
from tp_engine.core.request_queue import RequestQueue
from tp_engine.core.running_batch import RunningBatch
from tp_engine.core.scheduled_step import (
    Drafts,
    DraftSlots,
    RequestRejectedError,
    ScheduledStep,
    UpdateResult,
)
from tp_engine.core.scheduler_update import StepUpdater
from tp_engine.core.sequence import Sequence, SequenceStatus
from tp_engine.core.step_planner import StepPlanner
from tp_engine.core.verify_entries import VerifyPlanner

__all__ = ["Scheduler"]


class Scheduler:
    """Owns the waiting queue and the running batch; drives the KV manager (see the module
    docstring for its managers)."""

    def __init__(
        self,
        config: EngineConfig,
        block_manager: KVTier,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        if config.max_model_len is None:
            raise ValueError("the scheduler needs a resolved max_model_len")
        self.max_model_len = config.max_model_len
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.batch = RunningBatch(
            batch_rows(config.max_num_seqs),
            math.ceil(config.max_model_len / block_manager.block_size),
            config.max_model_len,
        )
        self.queue = RequestQueue()
        self.allocation = BlockAllocation(self.batch, block_manager, self.queue)
        self.verify = VerifyPlanner(self.batch, block_manager, self.allocation)
        self.planner = StepPlanner(
            config, self.batch, block_manager, self.queue, self.allocation, self.verify
        )
        self.updater = StepUpdater(
            self.batch, block_manager, self.queue, self.allocation, eos_token_ids
        )

    # -- state -----------------------------------------------------------------------------------

    @property
    def waiting(self) -> deque[Sequence]:
        """Waiting sequences, first come first served (read only: `add`, `finish`)."""
        return self.queue.waiting

    @property
    def running(self) -> list[Sequence]:
        """Running sequences in admission order."""
        seqs = self.batch.seqs
        return [seqs[row] for row in self.batch.order.tolist()]  # type: ignore[misc]

    @property
    def gate(self) -> Gate:
        """What the engine's state allows (paused: no admissions; paused "keep": no steps)."""
        return self.planner.gate

    @gate.setter
    def gate(self, gate: Gate) -> None:
        self.planner.gate = gate

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start (vLLM's num_preemptions_total)."""
        return self.allocation.num_preemptions

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.updater.eos_token_ids

    @property
    def max_num_seqs(self) -> int:
        return self.planner.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.planner.max_num_batched_tokens

    @property
    def enable_chunked_prefill(self) -> bool:
        return self.planner.enable_chunked_prefill

    def check_integrity(self) -> None:
        """The block manager's invariants, with the running sequences' tables and counters
        (AssertionError if one is broken; for tests)."""
        self.block_manager.check_integrity(
            self.running, self.batch.num_computed[self.batch.order].tolist()
        )

    def has_unfinished(self) -> bool:
        return bool(self.queue.waiting) or len(self.batch) > 0

    def get(self, seq_id: str) -> Sequence | None:
        return self.queue.get(seq_id)

    # -- requests --------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, or raise RequestRejectedError if it could never be served."""
        self.check_fits(seq)
        self.queue.add(seq)

    def abort(self, seq_id: str) -> Sequence | None:
        """End a sequence in any state and free its blocks; None if it is unknown or finished."""
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> Sequence | None:
        """End a request from outside the step loop (an abort, or a stop string the caller saw);
        None if it is unknown or finished already."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        seq = self.queue.pop(seq_id)
        if seq is None:
            return None
        if seq.status != SequenceStatus.WAITING:
            self.allocation.retire(seq)
        elif seq.block_table:  # its prompt arrived from a prefill server (`remote_prompts`)
            self.block_manager.free(seq)
        seq.status = status
        if stop_reason is not None:
            seq.stop_reason = stop_reason
        return seq

    def check_fits(self, seq: Sequence) -> None:
        """Raise RequestRejectedError if `seq` could never be served (too long for the model
        or the whole KV cache)."""
        max_tokens = seq.sampling_params.max_tokens
        prompt_len = seq.num_prompt_tokens
        if max_tokens is None:
            if prompt_len >= self.max_model_len:
                raise RequestRejectedError(
                    f"this model's maximum context length is {self.max_model_len} tokens, and the "
                    f"prompt has {prompt_len} tokens, leaving no room to generate"
                )
            total = self.max_model_len
        else:
            total = prompt_len + max_tokens
            if total > self.max_model_len:
                raise RequestRejectedError(
                    f"this model's maximum context length is {self.max_model_len} tokens, but "
                    f"{total} were requested ({prompt_len} in the prompt and {max_tokens} for the "
                    "completion); shorten the prompt or lower max_tokens"
                )
        # The last sampled token is never fed back, so it needs no KV slot; a prompt-only
        # request computes its whole prompt and samples nothing.
        blocks = self.block_manager.blocks_needed(max(total - 1, prompt_len))
        if blocks > self.block_manager.num_blocks:
            raise RequestRejectedError(
                f"the request needs up to {total} tokens = {blocks} KV blocks of "
                f"{self.block_manager.block_size} tokens, but the whole KV cache has "
                f"{self.block_manager.num_blocks} blocks"
            )

    def take_block_copies(self) -> list[BlockCopy]:
        """KV blocks moving between tiers since the last call, for the next plan
        (`KVTier.take_copies`)."""
        return self.block_manager.take_copies()

    # -- one step --------------------------------------------------------------------------------

    def draft_slots(self, num_speculative_tokens: int) -> DraftSlots | None:
        """The decodes the next `schedule()` may turn into verify entries, and the most drafts
        each may have (None: none may). The step pipeline asks a proposer for them and hands
        the drafts to `schedule`; nothing changes in between."""
        _, single, start, num_known, _, _ = self.planner.split_running()
        return self.verify.draft_slots(single, start, num_known, num_speculative_tokens)

    def schedule(self, drafts: Drafts | None = None) -> ScheduledStep:
        """Pick this step's batch (`StepPlanner.schedule`); `drafts`: what a proposer made for
        rows that `draft_slots` offered."""
        return self.planner.schedule(drafts)

    def fill_drafts(self, step: ScheduledStep, tokens: np.ndarray) -> ScheduledStep:
        """`step` with the drafts a proposer made after allocation (`VerifyPlanner`)."""
        return self.verify.fill_drafts(step, tokens)

    def update(
        self,
        step: ScheduledStep,
        sampled_token_ids: np.ndarray,
        num_emitted: np.ndarray | None = None,
    ) -> UpdateResult:
        """Apply a finished step's tokens (`StepUpdater.update`)."""
        return self.updater.update(step, sampled_token_ids, num_emitted)

    def discard(self, step: ScheduledStep) -> None:
        """Undo a scheduled step whose tokens will never be applied (`StepUpdater.discard`)."""
        self.updater.discard(step)
