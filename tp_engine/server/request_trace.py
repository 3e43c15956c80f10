"""Per-request timestamps across the server's two processes: where a request's TTFT goes.

Off unless `TP_ENGINE_REQUEST_TRACE` names a directory; then each process that asks
(`for_process("api")`, `for_process("rank0")`) appends one JSON line per event to
`<dir>/<process>-<pid>.jsonl`:

    {"t": <time.monotonic()>, "stage": "...", "id": "<engine request id>", ...fields}

`time.monotonic()` is CLOCK_MONOTONIC, one clock for every process of the machine, so the API
process's, rank 0's and a local client's times (`time.perf_counter()` is the same clock on
Linux) subtract directly. The id is the engine's (`<request id>-<prompt index>`), which the
client gets back as the chunks' `id` plus `-0`. Off, `for_process` returns None and the
callers skip their marks (one `is None` test each).

Stages, in a request's order (the TTFT breakdown, `benchmarks/ttft_breakdown.py`, names the
gaps between them):

    api_route      the route handler starts (HTTP parsed by uvicorn, body not yet read)
    api_add        the AddRequest goes to rank 0 (body validated, prompt tokenized)
    r0_add         rank 0's loop reads it
    r0_first_out   the engine step that returns its first token ends (`queue_time_s`: from
                   r0_add to its first schedule; `step`: the loop's step count)
    r0_sent        rank 0 begins sending the EngineOutputs that carry that token
    api_delta      the API process reads it
    api_chunk      the API process hands the first SSE chunk to the server to write
    step           rank 0, per loop step: `start`, `end` (`t` = end), `outputs`

The writer is for measurement runs: a line-buffered file, one write per event, under a lock (the
API process marks `api_route` and `api_add` on the request-pool thread that sends the request).
"""

from __future__ import annotations

import contextvars
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

ENV_VAR = "TP_ENGINE_REQUEST_TRACE"

# When the current request's route handler started (API process; read by the Generation that
# the handler creates, in the same task).
_route_start: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "request_trace_route_start", default=None
)


class RequestTrace:
    """One process's event file; `mark_once` records a (stage, id) pair only the first time."""

    def __init__(self, directory: str | Path, process: str) -> None:
        path = Path(directory) / f"{process}-{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
        self._seen: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def mark(self, stage: str, request_id: str, t: float | None = None, **fields: Any) -> None:
        t = time.monotonic() if t is None else t
        line = json.dumps({"t": t, "stage": stage, "id": request_id, **fields}) + "\n"
        with self._lock:
            self._file.write(line)

    def mark_once(self, stage: str, request_id: str, **fields: Any) -> None:
        key = (stage, request_id)
        if key not in self._seen:
            self._seen.add(key)
            self.mark(stage, request_id, **fields)


def for_process(process: str) -> RequestTrace | None:
    """This process's trace when `TP_ENGINE_REQUEST_TRACE` is set, else None."""
    directory = os.environ.get(ENV_VAR)
    return RequestTrace(directory, process) if directory else None


def route_started() -> None:
    """Called first thing by a route handler: the time `api_route` reports."""
    _route_start.set(time.monotonic())


def route_start() -> float | None:
    return _route_start.get()
