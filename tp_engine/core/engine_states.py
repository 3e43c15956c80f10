"""What a running engine is doing besides serving: paused (three ways), and the gate they close.

RL trainers pause generation around a weight update and resume it afterwards (vLLM's
`/pause?mode=`, SGLang's `/pause_generation`). The modes differ in what happens to the requests
already running:

    mode    running requests                              new requests
    abort   end now, with the output they have            wait, then run after resume
    wait    run to completion (the pause is complete       wait, then run after resume
            once none is left)
    keep    frozen where they are, their K/V kept;         wait, then run after resume
            after resume they continue (on whatever
            weights the engine has then)

`Gate` is what the scheduler reads: whether it may admit waiting requests, which ones (a LoRA
request only once its adapter holds a device slot: `tp_engine.features.lora.registry`), and whether it may step
the running ones. The engine owns it (`LLMEngine.pause` / `resume`); the scheduler only
reads it, so every way of holding requests back goes through one place.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tp_engine.core.sequence import Sequence


class PauseMode(str, enum.Enum):
    ABORT = "abort"
    WAIT = "wait"
    KEEP = "keep"

    @classmethod
    def parse(cls, value: str) -> PauseMode:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown pause mode {value!r}; expected one of {names}") from None


@dataclass
class Gate:
    """The scheduler's permissions, set by the engine's state."""

    # Waiting requests may be admitted (closed while paused).
    admitting: bool = True
    # Running requests may be scheduled (closed while paused in `keep` mode).
    stepping: bool = True
    # Which waiting sequences may be admitted now (the others wait, and later ones may pass
    # them); None: any.
    admits: Callable[[Sequence], bool] | None = None

    @classmethod
    def for_pause(
        cls, mode: PauseMode | None, admits: Callable[[Sequence], bool] | None = None
    ) -> Gate:
        if mode is None:
            return cls(admits=admits)
        return cls(admitting=False, stepping=mode is not PauseMode.KEEP, admits=admits)
