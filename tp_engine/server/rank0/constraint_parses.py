"""Rank 0's parses of requests' output constraints, off the engine loop.

The API process loads no torch, so it cannot parse a constraint (xgrammar imports torch): it
checks size and nesting, and sends each constraint's fields along with the request
(`AddRequest.constraint_checks`). The engine loop hands them here; each request's constraints
parse on a daemon thread of their own (a parse takes milliseconds; the API process has bounded
their size and nesting), so a slow parse holds its own request only, and the loop takes the
verdicts between steps. A parse that runs past its deadline is given up on: its request is
refused and the thread's late answer dropped (a daemon, so a parse that never ends does not
hold the process at exit).

Ownership: the engine loop's thread calls every method; a parse thread only writes its
verdict into `_done`, under the lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from tp_engine.features.structured.grammar import parse_refusal
from tp_engine.server.messages import AddRequest


@dataclass(frozen=True)
class Verdict:
    """How a request's constraints parsed: `why` is None when all parsed; otherwise the
    request's field that carried the refused one (None when the parse ran out of time)."""

    msg: AddRequest
    why: str | None = None
    param: str | None = None


class ConstraintParses:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[str, tuple[AddRequest, float]] = {}  # request id -> (msg, deadline)
        self._done: dict[str, tuple[str, str] | None] = {}  # request id -> first refusal
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._pending)

    def submit(self, msg: AddRequest) -> None:
        self._pending[msg.request_id] = (msg, time.monotonic() + self.timeout_s)
        threading.Thread(
            target=self._parse, args=(msg,), name="constraint-parse", daemon=True
        ).start()

    def discard(self, request_id: str) -> bool:
        """Forget a request (its client left); True if it was waiting here."""
        return self._pending.pop(request_id, None) is not None

    def take(self) -> list[Verdict]:
        """The verdicts ready now: parsed (refused or not), or out of time."""
        now = time.monotonic()
        with self._lock:
            done, self._done = self._done, {}
        verdicts = []
        for request_id, (msg, deadline) in list(self._pending.items()):
            if request_id in done:
                refusal = done[request_id]
                param, why = refusal if refusal is not None else (None, None)
                verdicts.append(Verdict(msg, why, param))
            elif now > deadline:
                why = (
                    f"the request's output constraint took longer than {self.timeout_s:g} s "
                    "to parse (--structured-outputs-timeout); give a simpler one"
                )
                verdicts.append(Verdict(msg, why))
            else:
                continue
            del self._pending[request_id]
        return verdicts

    def drop_all(self) -> list[str]:
        """Forget every waiting request; their ids."""
        ids = list(self._pending)
        self._pending.clear()
        return ids

    def _parse(self, msg: AddRequest) -> None:
        refusal = _first_refusal(msg.constraint_checks)
        with self._lock:
            self._done[msg.request_id] = refusal


def _first_refusal(checks: dict[str, dict[str, Any]]) -> tuple[str, str] | None:
    """The first constraint of `checks` (the request's field -> the constraint's fields) that
    does not parse, as (field, why); None when all parse."""
    for param, fields in checks.items():
        try:
            why = parse_refusal(fields, param)
        except Exception as exc:  # a parser's own failure refuses this request only
            why = f"{param} could not be parsed: {type(exc).__name__}: {exc}"
        if why is not None:
            return param, why
    return None
