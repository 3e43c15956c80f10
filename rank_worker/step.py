"""One step on one rank: the sequence every rank runs for every plan, rank 0 included.

    plan received (workers) or published (rank 0)
      → fault hook (tests only, `fault_injection`)
      → the previous step's sampled tokens, if the plan's decodes read them (broadcast from
        rank 0: the workers never sample)
      → the forward pass (`ModelRunner.execute`; its collectives keep the ranks in lock-step)

Written once so that the ranks cannot drift apart: every rank derives the same broadcast size
from the same plan, and issues the same collectives in the same order.
"""

from __future__ import annotations

import torch

from rank_worker.fault_injection import Fault
from rank_worker.model_runner import ModelRunner
from rank_worker.tp import TPInfo, broadcast_tensor
from shm_ipc import Command, StepPlan


def placeholder_rows(plan: StepPlan) -> int:
    """How many of the previous step's sampled tokens `plan` reads through placeholder input
    ids (`-1 - row`, asynchronous scheduling); 0 when every input id is known. Every rank
    derives the same number from the same plan, so they agree on the broadcast's size."""
    if plan.input_ids.size == 0:
        return 0
    return max(0, -int(plan.input_ids.min()))


class StepExecutor:
    """Runs plans on this rank's `ModelRunner` (see the module docstring)."""

    def __init__(self, runner: ModelRunner, tp: TPInfo, fault: Fault | None = None) -> None:
        self.runner = runner
        self.tp = tp
        self.fault = fault

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
