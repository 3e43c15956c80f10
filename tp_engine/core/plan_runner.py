"""Plans to the executor: the step-id counter, failures named by rank, and whether the ranks
can run anything at all.

Every message to every rank (a RUN plan, a draft model's DRAFT plans, a control call) takes its
id from one counter here, so that ids give their order on the plan channel. A failure of the
executor becomes `EngineDeadError` naming the rank at fault, and the engine is dead from then
on; a control call whose commit failed leaves the ranks inconsistent (`EngineInconsistentError`):
no plan runs until a full weight load repairs it.

Ownership: one `PlanRunner` per `EngineCore`, over the executor it is given; it owns the
counter, the dead and inconsistent states and the optional step timeline. The step pipeline
and the proposer of a draft model run their plans through it; control calls
(`tp_engine.executor.control`) take their ids and name their failures here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from shm_ipc import StepPlan
from tp_engine.common.failures import EngineDeadError
from tp_engine.common.step_timeline import StepTimeline, phase_or_null

if TYPE_CHECKING:
    from tp_engine.executor.base import Executor
    from tp_engine.executor.control import EngineInconsistentError

__all__ = ["PlanRunner"]


class PlanRunner:
    """Runs plans on every rank through `executor` (see the module docstring)."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.step_id = 0
        # Once a step has failed, every later call raises this.
        self.dead: EngineDeadError | None = None
        # Once a control call's commit has failed, every later step raises this (the ranks
        # may hold different weights), but the executor works: shutdown still tells the ranks.
        self.inconsistent: EngineInconsistentError | None = None
        # Set to a StepTimeline to record where each step's time goes (launch/bench.py).
        self.timeline: StepTimeline | None = None

    def check_usable(self, repairing: bool = False) -> None:
        """Raise why the engine cannot step, if it cannot (a rank failed, or a control call's
        commit failed; `repairing`: a weight load, which an inconsistent engine still takes)."""
        if self.dead is not None:
            raise self.dead
        if self.inconsistent is not None and not repairing:
            raise self.inconsistent

    def take_step_id(self) -> int:
        """The next step id, for a message sent to every rank outside `step()` (a control
        call): plans and calls share one counter, so ids give their order on the channel."""
        step_id = self.step_id
        self.step_id += 1
        return step_id

    def run_plan(self, plan: StepPlan, sampled: torch.Tensor | None) -> torch.Tensor:
        """Have the executor run `plan`; `sampled`: what its placeholder ids read. Its logits
        rows."""
        with self.failures_named(f"step {plan.step_id}"):
            return self.executor.execute(plan, sampled, self.timeline).logits

    def run_draft_plan(self, plan: StepPlan, sampled: torch.Tensor | None) -> torch.Tensor:
        """A DRAFT plan of the draft-model proposer (numbered here), run on every rank."""
        plan = dataclasses.replace(plan, step_id=self.take_step_id())
        with self.phase("draft", plan.step_id):
            return self.run_plan(plan, sampled)

    def diagnose_stall(self) -> EngineDeadError | None:
        """For a watchdog thread while a step is stuck: what the workers say about the step in
        progress (see `failures.diagnose_stall`), or None when every worker is silent and alive
        (a rank is truly hung)."""
        return self.executor.diagnose_stall(self.step_id - 1)

    def phase(self, name: str, step_id: int) -> Any:
        """A timed phase of the timeline (a no-op context without one)."""
        return phase_or_null(self.timeline, name, step_id)

    @contextmanager
    def failures_named(self, what: str) -> Iterator[None]:
        """Turn a failure into EngineDeadError naming the rank at fault; the engine is dead
        from then on."""
        try:
            with self.executor.guard(what):
                yield
        except EngineDeadError as exc:
            self.dead = exc
            raise

    def shutdown(self) -> None:
        """Release the executor (the ranks exit); the last step id goes with it unless a step
        failed."""
        self.executor.shutdown(self.step_id if self.dead is None else None)
