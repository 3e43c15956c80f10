"""The wait for a trainer's group to form, as plain values: shared by rank 0's blocking join
(`weight_updates.init_weights_update_group`) and the API process's route, which polls rank 0
between steps (`tp_engine.server.api.admin_routes`). Imports nothing but the standard library,
so that the API process, which holds no model code, can use it; the default join timeout is the
ranks' (`rank_worker.control.weight_group.DEFAULT_JOIN_TIMEOUT_S`), so rank 0 resolves it and sends it
back in the start's reply."""

from __future__ import annotations

# A join's own timeout ends its wait on the rank; rank 0 gives the ranks this much longer to
# report why before it gives up on them.
JOIN_GRACE_S = 2.0
JOIN_POLL_S = 0.05


def join_timed_out(group_name: str, limit: float, pending_ranks: list[int]) -> str:
    """The refusal of a join that did not form in time, naming the ranks still waiting (a rank's
    own failure, when it comes in time, is reported instead, with its reason)."""
    waiting = ", ".join(f"rank {rank}" for rank in pending_ranks)
    return (
        f"init_weights_update_group {group_name!r}: not every member joined within {limit:g} s"
        + (f" (still joining: {waiting})" if waiting else "")
    )
