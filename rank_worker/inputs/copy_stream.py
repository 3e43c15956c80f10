"""How staged host memory reaches the device, and how the host learns that a copy is done.

The GPU's staging (`input_prep`) writes a step's inputs into a host buffer, queues ONE copy to
the device and moves on; the copy reads the host buffer whenever the stream gets to it. The
contract a stream offers the host, and the only one `input_prep` relies on:

    copy(dst, src)   queue `dst <- src`; `src` may be read at any time until ...
    mark()           ... the event returned by the next mark() has completed:
    event.synchronize()   after it returns, every copy queued before the mark has read its
                          source, so the host may overwrite it.

Two implementations here, and one stand-in in the tests:

| stream              | copy                                | mark / synchronize            |
| ------------------- | ----------------------------------- | ----------------------------- |
| `CudaCopyStream`    | `copy_(non_blocking=True)` on the   | a `torch.cuda.Event` recorded |
|                     | current stream (pinned source)      | on it / waits for that event  |
| `ImmediateCopies`   | `copy_` on the calling thread       | an event that is already done |
| tests' checking one | `copy_` now, and remembers `src`    | verifies `src` is unchanged   |

The checking stand-in (tests/test_input_prep.py) is how CI, on CPU, catches a host buffer
rewritten while its copy may still be reading it: the hazard a GPU turns into wrong tokens
once in a while and a CPU never shows.
"""

from __future__ import annotations

from typing import Protocol

import torch


class CopyEvent(Protocol):
    def synchronize(self) -> None:
        """Return once every copy queued before this event's mark has read its source."""


class CopyStream(Protocol):
    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst <- src` (same shape and dtype); `src` stays readable until a later mark
        has completed."""

    def mark(self) -> CopyEvent:
        """An event that completes after every copy queued so far."""


class _Done:
    """The event of a copy that already happened."""

    def synchronize(self) -> None:
        pass


_DONE = _Done()


class ImmediateCopies:
    """Copies on the calling thread (CPU devices): each is done when `copy` returns."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def mark(self) -> CopyEvent:
        return _DONE


class CudaCopyStream:
    """Asynchronous copies on `device`'s current stream, guarded by CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def mark(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def copy_stream_for(device: torch.device) -> CopyStream:
    return CudaCopyStream(device) if device.type == "cuda" else ImmediateCopies()
