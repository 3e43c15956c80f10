"""Speculative decoding's place in the step pipeline: the proposer is asked here, between the
scheduler's two questions, never by the scheduler itself.

    draft_slots ──► proposer.eligible / propose ──► schedule(drafts) ──► (late) propose ──►
    (Scheduler)     (a proposer that knows its         (verify entries,     fill_drafts
                    drafts before blocks: n-gram)      their blocks)        (a draft model)

A proposer that drafts before allocation (n-gram lookup) may give a row fewer drafts than it
was offered; one that drafts after (a draft model, which writes its own K/V at the drafted
positions and so needs their blocks) is asked once the verify entries hold their blocks, for
exactly the drafts each was given, and its plans carry the step's block-table changes to the
ranks first. Nothing changes the scheduler's state between `draft_slots` and `schedule`.
"""

from __future__ import annotations

import numpy as np

from tp_engine.core.scheduled_step import DraftProposer, Drafts, ScheduledStep
from tp_engine.core.scheduler import Scheduler


def schedule_step(scheduler: Scheduler, proposer: DraftProposer | None) -> ScheduledStep:
    """Schedule one step, with `proposer`'s drafts for the decodes that may verify some."""
    if proposer is None:
        return scheduler.schedule()
    drafts = None
    slots = scheduler.draft_slots(proposer.num_speculative_tokens)
    if slots is not None:
        eligible = proposer.eligible(slots.rows)
        rows, wanted = slots.rows[eligible], slots.max_drafts[eligible]
        if rows.size and proposer.drafts_after_allocation:
            drafts = Drafts(rows, wanted, None)
        elif rows.size:
            tokens, counts = proposer.propose(rows, wanted)
            drafts = Drafts(rows, counts, tokens)
    scheduled = scheduler.schedule(drafts)
    late = scheduled.late_drafts
    if late is None:
        return scheduled
    try:
        tokens, counts = proposer.propose(late.rows, late.counts)
        assert np.array_equal(counts, late.counts), "a late proposer gives the drafts asked"
    except BaseException:
        scheduler.discard(scheduled)  # its tokens will never be applied
        raise
    return scheduler.fill_drafts(scheduled, tokens)
