"""EAGLE-3 proposals (vLLM's "eagle3" method, SGLang's EAGLE3): a one-layer head fed by three
of the target's hidden states drafts a chain of k tokens.

Rank 0's half is one DRAFT plan per step: each drafting sequence's last token (not yet through
the target), its length and how many drafts it wants (`eagle_drafts`). The ranks run the
whole chain from it (`rank_worker.spec.eagle3_runner`): the head's first entry reads the target
states the last RUN plan left on every rank, the next ones the head's own output, each on the
head's own cache at positions the verify entry's blocks hold (allocated first:
`drafts_after_allocation`, and this plan carries the step's block-table changes). So drafting
costs one plan and no host round trip between drafts; the drafts come to the host once.
"""

from __future__ import annotations

import numpy as np

from shm_ipc.step_plan import Command, StepPlan
from tp_engine.core.plan_builder import table_change_arrays
from tp_engine.features.speculative.planned import PlannedDraftProposer


class Eagle3Proposer(PlannedDraftProposer):
    """The step pipeline's `DraftProposer` for an EAGLE-3 head (`tp_engine.core.drafting`
    asks it once the verify entries hold their blocks)."""

    def propose(self, rows: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exactly `max_drafts[i]` greedy drafts for row i, whose blocks hold those positions."""
        b = self.batch
        wanted = np.asarray(max_drafts, dtype=np.int32)
        num = rows.size
        plan = StepPlan(
            step_id=0,  # the engine numbers it
            command=Command.DRAFT,
            input_ids=b.last_token[rows].astype(np.int32),
            query_start_loc=np.arange(num + 1, dtype=np.int32),
            # The last token sits at num_tokens - 1: the head's first entry is the one before.
            seq_lens=(b.num_tokens[rows] - 1).astype(np.int32),
            rows=rows.astype(np.int32),
            logits_indices=np.zeros(0, dtype=np.int32),
            **table_change_arrays(b.take_changes()),
        ).with_sections(eagle_drafts=wanted)
        tokens = self.run(plan, None).cpu().numpy()  # [R, max drafts]
        mask = np.arange(tokens.shape[1]) < wanted[:, None]
        return tokens[mask].astype(np.int32), wanted
