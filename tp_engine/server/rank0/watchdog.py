"""Rank 0's watchdog: notices an engine that stopped making progress while work is queued.

A thread, because a hung step (a rank stuck in a collective, a wedged GPU) never returns to the
engine loop, so the loop cannot notice its own hang. The loop reports (`busy`, `progress`); the
watchdog fires `on_stall` once, from its own thread, when no step has completed for
`timeout_s` while work was queued. What firing means is the caller's business (the engine
loop declares the engine dead and ends the process).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable

_CHECK_S = 0.25


class Watchdog:
    def __init__(self, timeout_s: float, on_stall: Callable[[float], None]) -> None:
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        # Written by the loop thread, read here; single attribute stores are atomic.
        self._busy = False
        self._last_progress = time.monotonic()
        self._stop = threading.Event()
        self.fired = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def busy(self, busy: bool) -> None:
        """Whether work is queued now; an idle engine is making all the progress it can."""
        self._busy = busy
        if not busy:
            self._last_progress = time.monotonic()

    def progress(self) -> None:
        """A step computed tokens."""
        self._last_progress = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(_CHECK_S):
            stalled_for = time.monotonic() - self._last_progress
            if self._busy and stalled_for > self.timeout_s:
                self.fired.set()
                self._on_stall(stalled_for)
                return


def park() -> None:
    while True:
        time.sleep(3600)


def stop_api_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """Wait for the API process to exit on its own; terminate, then kill it if it does not."""
    for action in (None, proc.terminate, proc.kill):
        if action is not None:
            action()
        try:
            proc.wait(timeout=timeout_s if action is None else 5.0)
            return
        except subprocess.TimeoutExpired:
            continue
