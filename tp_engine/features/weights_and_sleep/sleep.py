"""Sleep mode on rank 0: the engine's side of `sleep(level)` / `wake_up(tags)` (vLLM's names).

RL trainers that share the GPUs with the engine put it to sleep while they train and wake it
to generate. Every rank releases its memory in the SLEEP control call and takes it back in WAKE
(`rank_worker.control.sleep_ops`, `rank_worker.runner.device_sleep`, which also says what happens to the
weights at each level, to `data_ptr` and to the CUDA graphs). What the engine does around them:

    sleep(level)   the call runs first (quiesced: no step in flight), so a refusal changes
                   nothing. Then every unfinished request is aborted with the output it had
                   (vLLM's default `mode="abort"`: its K/V is gone, and recomputing after an
                   unknown wait is not what a trainer about to change the weights wants), the
                   prefix cache is flushed (the blocks it indexes are gone) and the scheduler's
                   gate closes. Sleeping while asleep is a no-op, except level 2 over level 1,
                   which drops the weights' host copy (and aborts nothing: the requests that
                   wait for the wake hold no K/V).
    asleep         new requests are accepted and wait; `has_work()` is False (the server's
                   watchdog must not call an idle sleeping engine dead); `LLM.generate`
                   refuses (it would wait forever).
    wake_up(tags)  restores the sleeping tags among `tags` (None: both); waking an awake tag is
                   a no-op. Once none sleeps, waiting requests run, unless the weights were
                   discarded:
    weights lost   after sleep(2), until `note_weights_loaded()` (a full weight update): the gate
                   stays closed and new requests and `generate` are refused with
                   `WeightsNotLoadedError`: generating from zeroed weights gives garbage
                   without an error (vLLM issue 29341), never here.

A pause (`LLMEngine.pause`) and sleep are independent: waking does not resume a paused engine,
and resuming does not wake a sleeping one; the gate is closed while either holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from rank_worker.control.protocol import ControlOp, ControlResult
from rank_worker.runner.device_sleep import SLEEP_LEVELS, SleepTag
from tp_engine.core.hooks import CoreAccess
from tp_engine.executor.control import ControlRefusedError, EngineControl, EngineInconsistentError

logger = logging.getLogger(__name__)

SLEEP_MODES = ("abort",)


class WeightsNotLoadedError(RuntimeError):
    """The weights were discarded by `sleep(level=2)` and nothing has loaded new ones."""

    def __init__(self) -> None:
        super().__init__(
            "the weights were discarded by sleep(level=2); load weights first (a full weight "
            "update), then generate"
        )


class EngineSleep:
    """The engine's sleep state, the same on every rank (checked at every call)."""

    def __init__(self, core: CoreAccess, control: EngineControl) -> None:
        self.core = core
        self.control = control
        # Sleeping tag -> the level it sleeps at, as every rank reported at the last call.
        self.asleep: dict[str, int] = {}
        self.weights_lost = False
        # Every rank's last report (`DeviceSleep.report`), rank order.
        self.memory: list[dict[str, int]] = []

    @property
    def is_sleeping(self) -> bool:
        """True while any tag sleeps (vLLM: until every tag is woken)."""
        return bool(self.asleep)

    @property
    def holds_requests(self) -> bool:
        """Whether the scheduler's gate stays closed for sleep mode's sake."""
        return self.is_sleeping or self.weights_lost

    def check_can_generate(self) -> None:
        if self.weights_lost and not self.is_sleeping:
            raise WeightsNotLoadedError()

    def sleep(self, level: int = 1, mode: str = "abort") -> list[str]:
        """See the module docstring; returns the ids of the sequences it aborted. ValueError
        for a bad level or mode, `ControlRefusedError` when a rank refused (nothing changed)."""
        if type(level) is not int or level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {list(SLEEP_LEVELS)}, got {level!r}")
        if mode not in SLEEP_MODES:
            raise ValueError(f"sleep mode must be one of {list(SLEEP_MODES)}, got {mode!r}")
        if self.is_sleeping and (level == 1 or self.asleep.get(SleepTag.WEIGHTS.value) == 2):
            return []  # already as deep asleep as asked
        deeper = self.is_sleeping  # level 2 over 1: the requests waiting for the wake stay
        self._call(ControlOp.SLEEP, {"level": level, "asleep": dict(self.asleep)})
        core = self.core
        aborted = [] if deeper else core.abort_unfinished()
        core.reset_prefix_cache()
        core.update_gate()
        logger.info("asleep (level %d); aborted %d sequences", level, len(aborted))
        return aborted

    def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """See the module docstring. ValueError for an unknown tag (nothing is sent),
        `ControlRefusedError` when a rank refused (nothing changed)."""
        wanted = [tag.value for tag in SleepTag.parse_all(tags)]
        if not any(tag in self.asleep for tag in wanted):
            return
        self._call(ControlOp.WAKE, {"tags": wanted, "asleep": dict(self.asleep)})
        self.core.update_gate()
        logger.info("woke %s; still asleep: %s", wanted, sorted(self.asleep) or "nothing")

    def note_weights_loaded(self) -> None:
        """Every parameter was written since sleep(level=2): serve again (the weight-update
        code calls this after a full update; each rank's commit should likewise call
        `DeviceSleep.note_weights_loaded`)."""
        self.weights_lost = False
        self.core.update_gate()

    def memory_report(self) -> list[dict[str, int]]:
        """Every rank's device and host bytes ({"weights", "kv_cache", "host_backup"})."""
        self._call(ControlOp.MEMORY_REPORT, {})
        return self.memory

    def _call(self, op: ControlOp, args: dict[str, Any]) -> ControlResult:
        result = self.control.call(op, args)
        if not result.ok:
            raise ControlRefusedError(result.message)
        states = result.results
        asleep = states[0]["asleep"]
        if any(s["asleep"] != asleep for s in states):
            error = EngineInconsistentError(
                f"{op.name}: the ranks' sleeping tags differ: {[s['asleep'] for s in states]}",
                result,
            )
            self.core.mark_inconsistent(error)
            raise error
        if op is not ControlOp.MEMORY_REPORT:
            self.asleep = dict(asleep)
        if op is ControlOp.SLEEP and args["level"] == 2:
            self.weights_lost = True
        self.memory = [s["memory"] for s in states]
        return result
