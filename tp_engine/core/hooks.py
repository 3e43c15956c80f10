"""The named points where features plug into the engine core.

The core knows no feature module: the bring-up (`tp_engine.engine.LLMEngine`) builds LoRA,
sleep mode and the rest, and registers here what each needs the core to do at these points.
A feature otherwise uses only the core's public methods (`waiting`, `finish_request`,
`reset_prefix_cache`, `advance_kv_epoch`, `update_gate`, `quiesce`...), never its scheduler or
block manager. An empty `CoreHooks` is a core with no features (the stand-in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from tp_engine.core.running_batch import RunningBatch
    from tp_engine.core.scheduled_step import DraftProposer
    from tp_engine.core.sequence import Sequence
    from tp_engine.lora_request import LoRARequest

__all__ = ["CoreHooks"]


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
    # Extra `EngineStats` fields (LoRA's adapters).
    stats: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    # Speculative decoding: make the proposer the step pipeline asks for drafts, given the
    # core's `run_draft_plan` (a draft model's forward passes on every rank) and `may_draft`
    # (which rows' sampling allows drafts). None: no speculative decoding.
    build_proposer: (
        Callable[[Callable[..., Any], Callable[[np.ndarray], np.ndarray]], DraftProposer] | None
    ) = None
