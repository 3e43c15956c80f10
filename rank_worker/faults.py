"""Fault injection for tests: make a chosen rank raise, stall or exit at a chosen step.

Set `TP_ENGINE_FAULT="rank=R,step=S,kind=K"` (K: raise, stall, exit) in the environment of the
ranks; the worker loop and rank 0's engine call `maybe_inject(rank, step_id)` before each
forward pass. Unset, it costs one attribute check per step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

ENV_VAR = "TP_ENGINE_FAULT"
_KINDS = ("raise", "stall", "exit")


class InjectedFault(RuntimeError):
    """The exception a `kind=raise` fault throws."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str

    @classmethod
    def parse(cls, spec: str) -> Fault:
        try:
            fields = dict(part.split("=", 1) for part in spec.split(","))
            fault = cls(int(fields["rank"]), int(fields["step"]), fields.get("kind", "raise"))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"{ENV_VAR}={spec!r}: expected 'rank=R,step=S,kind=K'") from exc
        if fault.kind not in _KINDS:
            raise ValueError(f"{ENV_VAR}: kind must be one of {_KINDS}, got {fault.kind!r}")
        return fault


_FAULT = Fault.parse(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else None


def maybe_inject(rank: int, step_id: int) -> None:
    if _FAULT is None or _FAULT.rank != rank or _FAULT.step != step_id:
        return
    if _FAULT.kind == "raise":
        raise InjectedFault(f"injected fault on rank {rank} at step {step_id}")
    if _FAULT.kind == "stall":
        while True:
            time.sleep(3600)
    os._exit(17)
