"""The interface between the engine core and whatever runs its plans.

The core (`tp_engine.core`) owns request state and decides each step; an executor owns the
model and the ranks. Per step the core hands over a `StepPlan` (bytes, immutable) and gets back
a `StepResult`; between steps it hands over a `ControlCall` to be run on every rank. This
module imports no `rank_worker`, so the core may depend on it and a stand-in executor (tests,
no model) implements it as well as `tp_engine.executor.tp.TPExecutor` does.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from shm_ipc import ControlCall, StepPlan
    from tp_engine.common.failures import EngineDeadError
    from tp_engine.common.step_timeline import StepTimeline

__all__ = ["Executor", "StepResult"]


@dataclass(frozen=True, eq=False)
class StepResult:
    """What one plan's forward pass produced, on the executor's `device`."""

    # [num_logits_rows, V] the rows the plan asked for, in the plan's order (sampled rows,
    # prompt-logprob rows, pooled rows: `plan_builder.LogitsLayout`). For a pooling model the
    # head replaces the LM head and its pooled rows are these rows (V is the head's width).
    # A DRAFT plan's: the draft model's logits [R, V], or an EAGLE-3 head's whole chain of
    # drafts [R, k] int64 target ids (`rank_worker.spec.eagle3_runner`).
    logits: torch.Tensor
    # [num_rows, 3 * hidden] an EAGLE-3 head's target states (its three captured layers,
    # concatenated low to high, before any norm) of the tokens the plan's `hidden_rows`
    # section names, in that order; None when it names none. The head itself reads them on
    # the ranks, where they already are (`rank_worker.spec.eagle3_runner`): this is the copy rank 0
    # asked for.
    hidden_states: torch.Tensor | None = None


class Executor(Protocol):
    """Runs the core's plans and control calls on every rank. Called from the core's thread
    only, one call at a time, plans in step-id order."""

    # Where `StepResult` tensors live; the core samples there.
    device: torch.device
    # KV blocks every rank allocated: the size of the core's block pool.
    num_kv_blocks: int
    # Blocks of every rank's host-memory KV tier (`kv_offloading_size`); 0: none.
    num_host_blocks: int

    def execute(
        self, plan: StepPlan, sampled: torch.Tensor | None, timeline: StepTimeline | None
    ) -> StepResult:
        """Run `plan` on every rank. `sampled`: [rows] int64 on `device`, the tokens sampled
        from the step in flight, which the plan's placeholder input ids read (None: no
        placeholders). `timeline`: where to record the step's phases (None: nowhere)."""

    def control(self, call: ControlCall) -> Any:
        """Run `call` on every rank (two-phase: `rank_worker.control.protocol`); every rank's
        verdict and reply, as a `rank_worker.control.protocol.ControlResult`."""

    def guard(self, what: str) -> AbstractContextManager[None]:
        """Turn a failure inside into `EngineDeadError` naming the rank at fault."""

    def diagnose_stall(self, step_id: int) -> EngineDeadError | None:
        """For a watchdog while `execute` is stuck: what the ranks say about `step_id`."""

    def check_ranks(self) -> EngineDeadError | None:
        """Between steps, never blocking: a rank that died, reported an error or whose node
        fell silent since the last step (an idle engine runs no collective that would
        notice)."""

    def shutdown(self, exit_step_id: int | None) -> None:
        """Release the ranks: tell them to exit with `exit_step_id` (None: a rank failed, none
        is listening) and give back this process's device memory. Idempotent."""
