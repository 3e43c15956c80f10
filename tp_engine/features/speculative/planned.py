"""What the proposers that run DRAFT plans on the ranks share (`draft_model`, `eagle3`): the
batch they follow, which rows may draft, and how their plans are run."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from shm_ipc.step_plan import StepPlan
from tp_engine.core.running_batch import RunningBatch

# Sends a DRAFT plan to every rank and runs rank 0's part; the tensor argument is what the
# plan's placeholder inputs read (the previous pass's tokens), or None.
RunDraftPlan = Callable[[StepPlan, torch.Tensor | None], torch.Tensor]


class PlannedDraftProposer:
    """A `DraftProposer` whose drafts come from DRAFT plans (`tp_engine.core.drafting` asks it
    once the verify entries hold their blocks); subclasses write `propose`."""

    drafts_after_allocation = True

    def __init__(
        self,
        k: int,
        run: RunDraftPlan,
        may_draft: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.num_speculative_tokens = k
        self.run = run
        self.may_draft = may_draft
        self._batch: RunningBatch | None = None

    def follow(self, batch: RunningBatch) -> None:
        """The batch whose rows are drafted (the scheduler's)."""
        self._batch = batch

    def eligible(self, rows: np.ndarray) -> np.ndarray:
        if self.may_draft is None:
            return np.ones(rows.size, dtype=bool)
        return self.may_draft(rows)

    @property
    def batch(self) -> RunningBatch:
        assert self._batch is not None, "follow() the batch first"
        return self._batch
