"""Draft-model proposals (vLLM's "draft_model" method): a smaller Qwen3 with the target's
vocabulary proposes greedily.

The draft runs on the same ranks as the target, sharded the same way, with a KV cache of its
own on the same block ids (`rank_worker.runner.model_runner`: a block of the pool holds both models'
K/V). Every RUN plan also runs the draft over the same tokens, so its cache always holds what
the target's holds: prompts, prefix-cache hits (a cached block holds both) and accepted tokens.
Drafting k tokens for the verify entries of a step is then k DRAFT plans, one token per
sequence each, at the positions the verify entry will compute (their blocks are allocated
first: `DraftProposer.drafts_after_allocation`). Each pass's input is the previous pass's
argmax, read on the device through placeholder input ids (`-1 - i`, as asynchronous scheduling
reads the previous step's samples), so the k passes queue without a host round trip; the drafts
come to the host once, at the end.
"""

from __future__ import annotations

import numpy as np
import torch

from shm_ipc.step_plan import Command, StepPlan
from tp_engine.core.plan_builder import table_change_arrays
from tp_engine.core.running_batch import TableChanges
from tp_engine.features.speculative.planned import PlannedDraftProposer


class DraftModelProposer(PlannedDraftProposer):
    """The step pipeline's `DraftProposer` for a draft model (`tp_engine.core.drafting` asks
    it once the verify entries hold their blocks)."""

    def propose(self, rows: np.ndarray, max_drafts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exactly `max_drafts[i]` greedy drafts for row i, whose blocks hold those positions."""
        b = self.batch
        wanted = np.asarray(max_drafts, dtype=np.int32)
        # Each row's last token (known, not yet computed by either model) sits at num_tokens - 1.
        first_pos = b.num_tokens[rows].astype(np.int64) - 1
        passes: list[tuple[np.ndarray, torch.Tensor]] = []
        sampled: torch.Tensor | None = None
        index_in_prev = np.zeros(rows.size, dtype=np.int64)
        for j in range(int(wanted.max(initial=0))):
            sel = np.flatnonzero(wanted > j)  # rows drafting a (j+1)-th token, in order
            if j == 0:
                input_ids = b.last_token[rows[sel]].astype(np.int32)
                # The step's block-table changes (the verify entries' blocks among them) reach
                # the ranks here, before its RUN plan (`Scheduler.fill_drafts` takes the rest).
                changes = table_change_arrays(b.take_changes())
            else:
                input_ids = (-1 - index_in_prev[sel]).astype(np.int32)
                changes = table_change_arrays(TableChanges())
            num = sel.size
            plan = StepPlan(
                step_id=0,  # the engine numbers it
                command=Command.DRAFT,
                input_ids=input_ids,
                query_start_loc=np.arange(num + 1, dtype=np.int32),
                seq_lens=(first_pos[sel] + j + 1).astype(np.int32),
                rows=rows[sel].astype(np.int32),
                logits_indices=np.arange(num, dtype=np.int32),
                **changes,
            )
            sampled = self.run(plan, sampled).argmax(dim=-1)  # [num] int64 on the device
            passes.append((sel, sampled))
            index_in_prev[sel] = np.arange(num)
        drafts = np.zeros((rows.size, max(len(passes), 1)), dtype=np.int32)
        for j, (sel, tokens) in enumerate(passes):
            drafts[sel, j] = tokens.cpu().numpy()
        mask = np.arange(drafts.shape[1]) < wanted[:, None]
        return drafts[mask], wanted
