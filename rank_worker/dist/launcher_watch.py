"""A rank exits when the process that launched it is gone.

torchrun starts every rank in a session of its own, so when its agent dies by SIGKILL (the OOM
killer, `kill -9`, a scheduler reclaiming the node) no signal reaches the ranks: without this
watch they live on as orphans that hold the port, the GPU memory and keep serving. Who watches
whom, and what each does once its watched process is gone:

    process                          watches                          then
    rank 0 under torchrun            its parent, the agent            ends the run like a dead
                                                                      engine (API process stopped,
                                                                      workers told EXIT), exit 1
    rank 1..N-1 under torchrun       its parent, the agent            rank 0 ends the run within
                                                                      TORCHRUN_WORKER_GRACE_S;
                                                                      else exit 4 (EXIT_LAUNCHER_GONE)
                                     rank 0 (recv, owner watchdog)    exit 3
    rank 1..N-1 spawned by rank 0    its parent, rank 0 (also from    remove rank 0's rendezvous
                                     before it joins the group)       directory, exit 3
    the API process                  rank 0 (`--parent-pid`)          remove rank 0's socket
                                                                      directory, exit 1

Rank 0 of `python launch/serve.py` or of `LLM` outside torchrun watches nothing: it is the
launcher, and its own parent may be a shell that exits while it runs on under nohup.

Once the parent is gone, `on_gone` starts an orderly shutdown from the watch thread and returns;
if the process has not ended `grace_s` later (its main thread is stuck in a collective, or busy
in a user's script), the watch ends it. That second stage cannot be cancelled: a process
whose launcher is gone always exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from shm_ipc.liveness import ParentWatch

logger = logging.getLogger(__name__)

# How often the parent is checked: bounds how late its death is noticed.
POLL_S = 0.25
# How long rank 0 gets to end the run in order once its launcher is gone, before it leaves
# without (it stops the API process and leaves the workers to notice it is gone).
RANK0_GRACE_S = 3.0
# How long a torchrun worker waits for rank 0's EXIT once the agent is gone: longer than rank 0's
# own grace, so that an orderly shutdown is never cut short by a worker leaving first.
TORCHRUN_WORKER_GRACE_S = 6.0


def exit_now(code: int) -> None:
    """End the process at once, from any thread, with the log flushed (no atexit handlers or
    finalizers run: whatever needs releasing must have been released by the caller)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe
            stream.flush()
    os._exit(code)


class LauncherWatch:
    """A daemon thread that watches `parent` (construct the `ParentWatch` first thing in the
    process) and, once it is gone, calls `on_gone(message)`, waits `grace_s`, calls
    `on_overdue(message)` if given (to release what only this process can) and exits with
    `exit_code`. A process that ends by itself in the meantime ends the thread with it."""

    def __init__(
        self,
        parent: ParentWatch,
        what: str,
        on_gone: Callable[[str], None],
        *,
        grace_s: float,
        exit_code: int = 1,
        on_overdue: Callable[[str], None] | None = None,
    ) -> None:
        self.parent = parent
        self.what = what
        self._on_gone = on_gone
        self.grace_s = grace_s
        self._exit_code = exit_code
        self._on_overdue = on_overdue
        self._stop = threading.Event()
        # Why this process is ending; None while the parent lives.
        self.gone: str | None = None
        self._thread = threading.Thread(target=self._run, name="launcher-watch", daemon=True)

    def start(self) -> LauncherWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the process is shutting down by itself). No effect once the parent
        has been found gone."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self.parent.alive():
                break
        else:
            return
        self.gone = f"{self.what} (pid {self.parent.pid}) is gone"
        try:
            self._on_gone(self.gone)
        except Exception:  # the second stage must run whatever the first did
            logger.exception("launcher watch: starting the shutdown failed")
        time.sleep(self.grace_s)
        logger.error("%s; not shut down after %g s, exiting now", self.gone, self.grace_s)
        if self._on_overdue is not None:
            self._on_overdue(self.gone)
        exit_now(self._exit_code)
