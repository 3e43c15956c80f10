"""Copies between host and GPU that never make rank 0 wait for the GPU.

With asynchronous scheduling the GPU runs step t while rank 0 prepares step t+1, so rank 0 must
not synchronise the stream: a copy from pageable host memory, or `.tolist()` of a CUDA tensor,
waits for every kernel queued so far, the forward of step t included. These helpers copy
through pinned memory with `non_blocking=True` instead; a host copy is valid once a CUDA event
recorded after it has completed (`HostCopies.wait`). On CPU every helper is a no-op.

Pinned blocks come from torch's caching host allocator, which keeps each one until the copies
that use it have completed.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

T = TypeVar("T")


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, queued on the current stream without waiting for it."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class HostCopies:
    """Device tensors copied to pinned host memory, readable after `wait()`."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._event: torch.cuda.Event | None = None

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """Queue a copy of `tensor` to the host; returns the (not yet valid) host tensor."""
        if not self._cuda:
            return tensor
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def copy_fields(self, value: T) -> T:
        """A dataclass of tensors (e.g. LogprobsTensors) with every tensor field copied."""
        fields = {
            f.name: self.copy(getattr(value, f.name))
            for f in dataclasses.fields(value)  # type: ignore[arg-type]
            if isinstance(getattr(value, f.name), torch.Tensor)
        }
        return dataclasses.replace(value, **fields)  # type: ignore[type-var]

    def record(self) -> None:
        """Mark the end of the copies queued so far (call once, after the last `copy`)."""
        if self._cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Block until the recorded copies have landed (only those: later work may still run)."""
        if self._event is not None:
            self._event.synchronize()
