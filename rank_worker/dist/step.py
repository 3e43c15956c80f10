"""One step on one rank: the sequence every rank runs for every plan, rank 0 included, and the
one dispatcher of everything rank 0 sends.

    message received (workers: `StepExecutor.dispatch`)
      StepPlan RUN / DRAFT → `run` (below)
      StepPlan EXIT        → leave the worker loop
      ControlCall          → `control`: both phases of the call (`rank_worker.control.protocol`)

Rank 0 publishes each message and then calls `run` or `control` itself, since it needs what
they return (the logits, every rank's reply); it never receives an EXIT.

A RUN or DRAFT plan on every rank:

    plan received (workers) or published (rank 0)
      → fault hook (tests only, `fault_injection`)
      → the previous step's sampled tokens, if the plan's decodes read them (broadcast from
        rank 0: the workers never sample)
      → the forward pass (`ModelRunner.execute`, or `execute_draft` for DRAFT; its collectives
        keep the ranks in lock-step)

Written once so that the ranks cannot drift apart: every rank derives the same broadcast size
from the same plan, and issues the same collectives in the same order.
"""

from __future__ import annotations

import enum

import torch

import rank_worker.control.lora_ops
import rank_worker.control.sleep_ops
import rank_worker.control.weight_ops  # noqa: F401  (registers the weight-update ops)
from rank_worker.control.protocol import ControlResult, RankControl
from rank_worker.fault_injection import Fault
from rank_worker.runner.model_runner import ModelRunner
from rank_worker.tp import TPInfo, broadcast_tensor
from shm_ipc import Command, ControlCall, StepPlan


class Flow(enum.Enum):
    """What the worker loop does after a message."""

    CONTINUE = "continue"
    EXIT = "exit"


def placeholder_rows(plan: StepPlan) -> int:
    """How many of the previous step's sampled tokens `plan` reads through placeholder input
    ids (`-1 - row`, asynchronous scheduling); 0 when every input id is known. Every rank
    derives the same number from the same plan, so they agree on the broadcast's size."""
    if plan.input_ids.size == 0:
        return 0
    return max(0, -int(plan.input_ids.min()))


class StepExecutor:
    """Runs plans and control calls on this rank's `ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, tp: TPInfo, fault: Fault | None = None) -> None:
        self.runner = runner
        self.tp = tp
        self.fault = fault
        self.rank_control = RankControl(runner, tp)

    def dispatch(self, message: StepPlan | ControlCall) -> Flow:
        """Run one message from rank 0 (the worker loop's only call). A control call's result
        is dropped here: every rank's reply reaches rank 0 through the call's own gathers."""
        if isinstance(message, ControlCall):
            self.control(message)
        elif message.command == Command.EXIT:
            return Flow.EXIT
        else:
            self.run(message)
        return Flow.CONTINUE

    def control(self, call: ControlCall) -> ControlResult:
        """Both phases of `call` on this rank (collectives: every rank runs it)."""
        return self.rank_control.run(call)

    def run(self, plan: StepPlan, sampled: torch.Tensor | None = None) -> torch.Tensor | None:
        """One forward pass over `plan`: logits `[B', V]` on rank 0, None elsewhere.

        `sampled` (rank 0 only): the device tensor of the step in flight's sampled ids, which
        the plan's placeholder inputs read; the workers receive those rows from rank 0.
        """
        if self.fault is not None:
            self.fault.fire_if_due(self.tp.rank, plan.step_id)
        last_sampled = None
        num_rows = placeholder_rows(plan)
        if num_rows:
            if self.tp.is_first:
                if sampled is None:
                    raise ValueError(
                        f"step {plan.step_id}: the plan reads {num_rows} sampled tokens of the "
                        "step in flight, but rank 0 has none"
                    )
                last_sampled = sampled[:num_rows]
            else:
                last_sampled = torch.empty(num_rows, dtype=torch.int64, device=self.runner.device)
            broadcast_tensor(last_sampled, self.tp)
        if plan.command == Command.DRAFT:
            return self.runner.execute_draft(plan, last_sampled=last_sampled)
        return self.runner.execute(plan, last_sampled=last_sampled)
