"""The named points where features plug into the engine core, and what they may call on it.

The core knows no feature module: the bring-up (`tp_engine.engine.LLMEngine`) builds the core,
then LoRA, sleep mode and the rest, and registers in `CoreHooks` what each needs the core to do
at these points. A feature otherwise holds a `CoreAccess`, the protocol of the core's few
operations it may call (`waiting`, `finish_request`, `reset_prefix_cache`, `advance_kv_epoch`,
`update_gate`, `quiesce`...), never the engine, the scheduler or the block manager; its per-row
state is its own (a `RowFollower` of the running batch), and what a plan needs of it comes
through `CoreHooks.plan_sections`. An empty `CoreHooks` is a core with no features (the
stand-in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from tp_engine.core.running_batch import RunningBatch
    from tp_engine.core.scheduled_step import DraftProposer
    from tp_engine.core.sequence import Sequence, SequenceStatus
    from tp_engine.executor.control import EngineInconsistentError
    from tp_engine.lora_request import LoRARequest

__all__ = ["CoreAccess", "CoreHooks"]


@dataclass
class CoreHooks:
    """What each feature asks of the core; every list runs in registration order."""

    # Before a new request is checked: raise to refuse every new request (sleep level 2: no
    # weights until a full load).
    admission_checks: list[Callable[[], None]] = field(default_factory=list)
    # A request with a `lora_request`: attach its adapter to its sequences (None: LoRA is off,
    # and such a request is refused).
    attach_adapter: Callable[[LoRARequest, list[Sequence]], None] | None = None
    # At the start of a step that may admit, before anything is scheduled (LoRA: fill the
    # ranks' adapter slots with control calls). Gets the sequences not in the scheduler yet;
    # returns sequences it ended, whose outputs the step reports.
    before_step: list[Callable[[Iterable[Sequence]], list[Sequence]]] = field(default_factory=list)
    # Something follows the rows of each new running batch (a scheduler is built at start and
    # by `reconfigure`): LoRA's slots, a proposer's per-row state.
    batch_followers: list[Callable[[RunningBatch], None]] = field(default_factory=list)
    # While any says True, nothing is admitted and nothing steps (asleep, weights lost).
    holds_requests: list[Callable[[], bool]] = field(default_factory=list)
    # Which waiting sequences may be admitted now (LoRA: its adapter has a slot); None: all.
    admits: Callable[[Sequence], bool] | None = None
    # Sections a feature adds to each RUN plan from its own per-row state, given the plan's
    # batch rows; None when it has nothing for them (LoRA: the rows' adapter slots).
    plan_sections: list[Callable[[np.ndarray], dict[str, np.ndarray] | None]] = field(
        default_factory=list
    )
    # Extra `EngineStats` fields (LoRA's adapters).
    stats: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    # Speculative decoding: make the proposer the step pipeline asks for drafts, given the
    # core's `run_draft_plan` (a draft model's forward passes on every rank) and `may_draft`
    # (which rows' sampling allows drafts). None: no speculative decoding.
    build_proposer: (
        Callable[[Callable[..., Any], Callable[[np.ndarray], np.ndarray]], DraftProposer] | None
    ) = None


class CoreAccess(Protocol):
    """What a feature may call on the engine core (`EngineCore` is one), between steps."""

    def waiting(self) -> list[Sequence]:
        """The scheduler's waiting queue, first come first served (a copy)."""

    def finish_request(
        self, seq_id: str, status: SequenceStatus, stop_reason: int | str | None = None
    ) -> bool:
        """End one sequence from outside the step loop; False if unknown or finished."""

    def abort_unfinished(self) -> list[str]:
        """Abort every unfinished sequence; their ids."""

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached block; True when nothing stays cached."""

    def advance_kv_epoch(self, flush: bool = True) -> None:
        """New weights: K/V computed before now is never a prefix-cache hit again."""

    def update_gate(self) -> None:
        """Read the engine's states again (the hooks' `holds_requests` and `admits`)."""

    def follow_batch(self, follow: Callable[[RunningBatch], None]) -> None:
        """Have `follow` follow the running batch, now and after every `reconfigure`."""

    @property
    def inconsistent(self) -> EngineInconsistentError | None:
        """Why the ranks may hold different models, until a full weight load repairs it."""

    def mark_inconsistent(self, error: EngineInconsistentError) -> None:
        """From now on every step raises `error`."""

    def note_consistent(self) -> None:
        """A weight load wrote every weight on every rank: the ranks agree again."""

    # Control calls (`tp_engine.executor.control.ControlHost`, the same four).
    def check_usable(self, repairing: bool = False) -> None:
        """Raise the engine's error if it cannot run a call."""

    def quiesce(self) -> None:
        """Apply the step in flight, if any, keeping its outputs for the next `step()`."""

    def take_step_id(self) -> int:
        """The next step id (plans and calls share the counter)."""

    def failures_named(self, what: str) -> AbstractContextManager[None]:
        """Turn a failure inside into EngineDeadError naming the rank at fault."""
