"""A second stream for KV-block copies between tiers, overlapped with the forward passes.

The contract `rank_worker.kv.copies.HostBlockCopier` relies on, and all a `SideStream` offers:

    run(work)     queue `work` (device ops) after everything the compute stream has queued so
                  far; returns an event that completes after it
    wait(event)   the compute stream's later work starts after `event`
    synchronize(event)  the host returns once `event` has completed

| stream                 | run                                          | wait                      |
| ---------------------- | -------------------------------------------- | ------------------------- |
| `CudaSideStream`       | on a `torch.cuda.Stream` that first waits    | `wait_event` on the       |
|                        | for the current stream                       | current stream            |
| `ImmediateSideStream`  | now, on the calling thread (CPU)             | nothing to wait for       |
| `DeferredSideStream`   | later: at the first `wait` for it or for a   | runs the queued work, in  |
|                        | later event (tests)                          | order, up to that event   |

The deferred one is the test stand-in for a GPU's asynchrony: work runs as late as the contract
allows, so a forward pass that reads a block before waiting for its copy reads stale K/V and
the greedy tokens change. CPU tests ask for it through the rank's environment
(`TP_ENGINE_KV_COPY_STREAM=deferred`, read once when the copier is made), since the ranks are
processes no test can reach into; without the variable it is never used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = [
    "ENV_VAR",
    "CudaSideStream",
    "DeferredSideStream",
    "ImmediateSideStream",
    "SideStream",
    "side_stream_for",
]

ENV_VAR = "TP_ENGINE_KV_COPY_STREAM"


class SideStream(Protocol):
    def run(self, work: Callable[[], None]) -> object:
        """Queue `work` after the compute stream's work so far; an event completing after it."""

    def wait(self, event: object) -> None:
        """The compute stream's later work starts after `event` has completed."""

    def synchronize(self, event: object) -> None:
        """Return once `event` has completed (the host reads what the work wrote)."""


class ImmediateSideStream:
    """CPU: the work is done when `run` returns."""

    def run(self, work: Callable[[], None]) -> object:
        work()
        return None

    def wait(self, event: object) -> None:
        pass

    def synchronize(self, event: object) -> None:
        pass


class CudaSideStream:
    """A CUDA stream of its own beside `device`'s current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, work: Callable[[], None]) -> object:
        # After the forward passes queued so far: they may still write blocks this work reads
        # (a block freed by a finished sequence while its last step runs) or overwrites.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            work()
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def wait(self, event: object) -> None:
        assert isinstance(event, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self, event: object) -> None:
        assert isinstance(event, torch.cuda.Event)
        event.synchronize()


class DeferredSideStream:
    """Tests: queued work runs only when the compute stream waits for it (or for later work)."""

    def __init__(self) -> None:
        self._queued: list[tuple[int, Callable[[], None]]] = []
        self._next = 0

    def run(self, work: Callable[[], None]) -> object:
        self._next += 1
        self._queued.append((self._next, work))
        return self._next

    def wait(self, event: object) -> None:
        assert isinstance(event, int)
        while self._queued and self._queued[0][0] <= event:
            self._queued.pop(0)[1]()

    synchronize = wait  # the host waits as the compute stream would: the work runs now

    @property
    def num_queued(self) -> int:
        return len(self._queued)


def side_stream_for(device: torch.device) -> SideStream:
    """The side stream for `device` (the environment may ask for the deferred test stand-in)."""
    kind = os.environ.get(ENV_VAR)
    if kind == "deferred":
        return DeferredSideStream()
    if kind not in (None, ""):
        raise ValueError(f"{ENV_VAR}={kind!r}: the only value is 'deferred' (tests)")
    return CudaSideStream(device) if device.type == "cuda" else ImmediateSideStream()
