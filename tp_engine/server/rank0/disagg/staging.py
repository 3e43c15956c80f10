"""A decode server's host staging slots, where its ranks' device caches cannot be registered
for transfers (`rank_worker.kv.pd_staging`): every rank registered a pool of the same number of
slots instead, and rank 0 hands them out.

Life of a request's slots (`DecodeRooms` drives it):

    its blocks reserved ──► slots taken (as many as its blocks; a run of consecutive ones
        where there is one, so the prefill's writes merge) ──► the prefill writes into them
    its KVStatus ──► a copy slots → blocks queued for the next step plan
        (`BlockManager.copy_in`) ──► that step's tokens in: every rank ran the copy, the
        slots are free
    failed, timed out or aborted before its status: the slots are free at once

A request waits (its blocks held, its waiting timeout running) while the slots it needs are
taken; one that needs more than the pool holds fails at once, naming the flag that sizes it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["StagingSlots"]


class StagingSlots:
    """`num_slots` slots, each free or taken; see the module docstring."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a staging pool has at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free = np.ones(num_slots, dtype=bool)
        # (step id, slots): given back once that step's tokens are in.
        self._copying: list[tuple[int, list[int]]] = []

    @property
    def num_free(self) -> int:
        return int(self._free.sum())

    def take(self, count: int) -> list[int] | None:
        """`count` free slots (the first run of `count` consecutive ones, else the lowest free
        ones), or None and nothing taken if fewer are free."""
        if count > self.num_free:
            return None
        free = np.flatnonzero(self._free)
        # Runs of consecutive free slots: where each starts, and how long it is.
        breaks = np.flatnonzero(np.diff(free) != 1) + 1
        starts = np.concatenate(([0], breaks))
        lengths = np.diff(np.concatenate((starts, [free.size])))
        fits = np.flatnonzero(lengths >= count)
        chosen = free[starts[fits[0]] :][:count] if fits.size else free[:count]
        self._free[chosen] = False
        return chosen.tolist()

    def give(self, slots: list[int]) -> None:
        if slots and not (~self._free[slots]).all():
            raise ValueError(f"staging slots {slots} given back twice")
        self._free[slots] = True

    def give_after(self, step_id: int, slots: list[int]) -> None:
        """Give `slots` back once step `step_id` (the next plan, which carries their copy into
        the cache) has been applied."""
        self._copying.append((step_id, slots))

    def steps_applied(self, applied_step_id: int) -> None:
        """Every step up to `applied_step_id` ran on every rank: their slots are free."""
        left = []
        for step_id, slots in self._copying:
            if step_id <= applied_step_id:
                self.give(slots)
            else:
                left.append((step_id, slots))
        self._copying = left
